#!/usr/bin/env bash
# Builds the CUDA dependencies of plm from Debian bookworm's Trilinos 13.2 source:
# Kokkos 3.4.01 (CUDA + Serial, Hopper sm_90), Kokkos Kernels 3.4.01 (header use only, no
# explicit instantiations) and Teuchos (core, parser, parameter lists, comm), static, C++17,
# with mpicxx wrapping Kokkos' nvcc_wrapper.  The four patches in patches/ make Kokkos 3.4.01
# build with CUDA 13 and know Hopper (doc/gpu.md says what each one changes and why).
#
# Usage: scripts/build-deps-cuda.sh [PREFIX]     (default /opt/plm-deps/trilinos-13.2.0-cuda-sm90)
# Environment: PLM_DEPS_WORK (scratch, default /tmp/plm-deps-build), JOBS (default nproc),
#              TRILINOS_TARBALL (use this trilinos_13.2.0.orig.tar.gz instead of downloading).
# If PREFIX already holds a finished build (its stamp file matches the patches), nothing is done:
# the prebuilt deps/trilinos-13.2.0-cuda-sm90.tar.xz extracted at / is exactly this build.
#
# Then build plm against it:  cmake --preset cuda && cmake --build --preset cuda
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
prefix=${1:-/opt/plm-deps/trilinos-13.2.0-cuda-sm90}
work=${PLM_DEPS_WORK:-/tmp/plm-deps-build}
jobs=${JOBS:-$(nproc)}
cuda_arch=HOPPER90   # Kokkos_ARCH_<name>; sm_90

# The header-only GPU dependencies first (each a no-op when already installed): CUTLASS for the
# grouped expert GEMM (optional: plm falls back to a loop of cuBLASLt calls without it).
bash "$repo/scripts/get-cutlass.sh" ||
  echo "build-deps-cuda: note: CUTLASS headers not installed; the grouped expert GEMM is left out" >&2

stamp_of_patches() { cat "$repo"/patches/*.patch | sha256sum | cut -d' ' -f1; }
stamp="$prefix/.plm-deps-stamp"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$(stamp_of_patches)" ]]; then
  echo "build-deps-cuda: $prefix is up to date (stamp matches patches/); nothing to do"
  exit 0
fi
if [[ -f "$prefix/lib/cmake/Kokkos/KokkosConfig.cmake" && ! -f "$stamp" ]] &&
   grep -q "KOKKOS_ARCH_HOPPER90" "$prefix/include/KokkosCore_config.h" 2>/dev/null &&
   [[ "${PLM_DEPS_FORCE:-0}" != 1 ]]; then
  echo "build-deps-cuda: $prefix already holds a Hopper CUDA Kokkos (the prebuilt cache);"
  echo "  set PLM_DEPS_FORCE=1 to rebuild it from source"
  exit 0
fi

for tool in cmake mpicxx nvcc patch tar; do
  command -v "$tool" >/dev/null || { echo "build-deps-cuda: '$tool' is not on PATH" >&2; exit 1; }
done

mkdir -p "$work"
cd "$work"

# 1. The source: Debian bookworm's trilinos source package (deb-src line of our own, so the
#    system's apt configuration stays untouched).
tarball=${TRILINOS_TARBALL:-$work/trilinos_13.2.0.orig.tar.gz}
if [[ ! -f "$tarball" ]]; then
  mkdir -p apt/lists/partial apt/sources
  cat > apt/sources/bookworm-src.sources <<'EOF'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  apt_opts=(-o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts="$work/apt/sources"
            -o Dir::State::Lists="$work/apt/lists")
  apt-get "${apt_opts[@]}" update
  apt-get "${apt_opts[@]}" source --download-only trilinos=13.2.0-4 ||
    apt-get "${apt_opts[@]}" source --download-only trilinos
fi
echo "build-deps-cuda: sha256 $(sha256sum "$tarball" | cut -d' ' -f1)  $(basename "$tarball")"

src="$work/Trilinos-trilinos-release-13-2-0"
rm -rf "$src"
tar xzf "$tarball"
# 2. The patches (Kokkos 3.4.01 on CUDA 13 and sm_90).
for p in "$repo"/patches/*.patch; do
  echo "build-deps-cuda: applying $(basename "$p")"
  patch -d "$src" -p1 --forward --fuzz=0 < "$p"
done

# 3. Configure a subset of Trilinos.  mpicxx calls Kokkos' own nvcc_wrapper (from the patched
#    source), which compiles .cpp files as CUDA.  Explicit instantiation of Kokkos Kernels under
#    nvcc takes hours on 2 cores, and plm uses its headers only, so every ETI option is off.
export OMPI_CXX="$src/packages/kokkos/bin/nvcc_wrapper"
export NVCC_WRAPPER_DEFAULT_COMPILER=${NVCC_WRAPPER_DEFAULT_COMPILER:-g++}
kk_eti=()
for t in DOUBLE FLOAT COMPLEX_DOUBLE COMPLEX_FLOAT ORDINAL_INT ORDINAL_INT64_T OFFSET_INT \
         OFFSET_SIZE_T LAYOUTLEFT LAYOUTRIGHT EXECSPACE_CUDA MEMSPACE_CUDASPACE \
         MEMSPACE_CUDAUVMSPACE EXECSPACE_SERIAL MEMSPACE_HOSTSPACE EXECSPACE_OPENMP \
         EXECSPACE_THREADS; do
  kk_eti+=(-DKokkosKernels_INST_${t}=OFF)
done
build="$work/build"
rm -rf "$build"
cmake -S "$src" -B "$build" \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_INSTALL_PREFIX="$prefix" \
  -DCMAKE_CXX_COMPILER=mpicxx -DCMAKE_C_COMPILER=mpicc \
  -DCMAKE_CXX_STANDARD=17 \
  -DBUILD_SHARED_LIBS=OFF \
  -DTrilinos_ENABLE_ALL_PACKAGES=OFF \
  -DTrilinos_ENABLE_ALL_OPTIONAL_PACKAGES=OFF \
  -DTrilinos_ENABLE_TESTS=OFF -DTrilinos_ENABLE_EXAMPLES=OFF \
  -DTrilinos_ENABLE_Fortran=OFF \
  -DTrilinos_ENABLE_Kokkos=ON \
  -DTrilinos_ENABLE_KokkosKernels=ON \
  -DTrilinos_ENABLE_TeuchosCore=ON \
  -DTrilinos_ENABLE_TeuchosParser=ON \
  -DTrilinos_ENABLE_TeuchosParameterList=ON \
  -DTrilinos_ENABLE_TeuchosComm=ON \
  -DTPL_ENABLE_MPI=ON \
  -DTPL_ENABLE_CUDA=ON \
  -DTPL_ENABLE_CUBLAS=ON \
  -DTPL_ENABLE_CUSPARSE=OFF \
  -DTPL_ENABLE_BLAS=OFF -DTPL_ENABLE_LAPACK=OFF \
  -DKokkos_ENABLE_CUDA=ON \
  -DKokkos_ENABLE_CUDA_LAMBDA=ON \
  -DKokkos_ENABLE_SERIAL=ON \
  -DKokkos_ENABLE_OPENMP=OFF \
  -DKokkos_ARCH_${cuda_arch}=ON \
  -DKokkosKernels_ENABLE_TPL_CUSPARSE=OFF \
  "${kk_eti[@]}"

# 4. Build and install; the stamp records which patches this prefix was built with.
cmake --build "$build" -j "$jobs"
cmake --install "$build"
stamp_of_patches > "$stamp"
echo "build-deps-cuda: installed to $prefix"
echo "  configure plm with:  cmake --preset cuda   (or -DCMAKE_PREFIX_PATH=$prefix,"
echo "  -DCMAKE_CXX_COMPILER=mpicxx and OMPI_CXX=$prefix/bin/nvcc_wrapper)"
