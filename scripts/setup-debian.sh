#!/usr/bin/env bash
# Installs every Debian package plm needs to build, test and run on the CPU (Debian bookworm).
# Idempotent: installs only what is missing; uses sudo only when not run as root.
# This list is the one place plm's system dependencies are written down.
set -euo pipefail

PACKAGES=(
  # toolchain
  cmake g++ gcc make git pkg-config python3
  # Kokkos, Kokkos Kernels and Teuchos (Trilinos 13.2, Serial backend) and BLAS/LAPACK
  libtrilinos-kokkos-dev libtrilinos-kokkos-kernels-dev libtrilinos-teuchos-dev libopenblas-dev
  # MPI and parallel HDF5
  libopenmpi-dev openmpi-bin libhdf5-openmpi-dev zlib1g-dev
  # tests and the format check; h5py and numpy for validation/ckpt_ls.py (test_ckpt_ls)
  libgtest-dev clang-format python3-h5py python3-numpy
  # plots of validation/scaling.py (the CPU scaling study in ctest)
  python3-matplotlib
  # real proteins for the quickstart (/usr/share/doc/mmseqs2/example-data/DB.fasta.gz)
  mmseqs2-examples
)

missing=()
for package in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#PACKAGES[@]} Debian packages plm needs are installed"
  exit 0
fi

sudo=()
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo > /dev/null; then
    echo "setup: need root to install: ${missing[*]} (run as root or install sudo)" >&2
    exit 1
  fi
  sudo=(sudo)
fi

echo "setup: installing ${#missing[@]} Debian packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -q
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "setup: done"
