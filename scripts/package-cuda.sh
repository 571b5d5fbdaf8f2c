#!/usr/bin/env bash
# Collects a CUDA build for a GPU machine that has CUDA, NCCL and OpenMPI but not plm's other
# libraries: the plm binary, the GPU test and benchmark binaries, and every shared library they
# need that is not the C/C++ runtime, CUDA, NCCL or MPI (parallel HDF5 and what it links), into
# one folder.  Run there with LD_LIBRARY_PATH=<folder>/lib:/usr/local/cuda/lib64 (see
# validation/gpu_run.sh).
#
# Usage: scripts/package-cuda.sh [BUILD_DIR] [OUT_DIR]   (defaults build-cuda, build-cuda/pkg)
#
# PLM_PKG_CTEST=1 also mirrors the whole ctest suite into OUT_DIR/tree/ (every test executable
# at its path relative to BUILD_DIR, every CTestTestfile.cmake) and records the absolute build
# and source directories the ctest files name (OUT_DIR/BUILD_DIR, OUT_DIR/SOURCE_DIR), so that
# `validation/gpu_run.sh ctest` can rebuild the build tree there and run plain `ctest`.  The
# folder is about 400 MB (40 test binaries of ~17 MB that share most of their bytes); a large
# xz window finds the repeats: `tar -cf - pkg | xz -6 --lzma2=dict=256MiB` gives about 28 MB,
# under the device tool's 64 MiB carry limit.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$repo/build-cuda}
out=${2:-$build/pkg}
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"

bins=()
[[ -x "$build/plm" ]] && bins+=("$build/plm")
while IFS= read -r f; do bins+=("$f"); done < <(find "$build/test" "$build/bench" -maxdepth 3 -type f -executable \
  \( -name 'test_gpu_*' -o -name 'test_fp8_gpu_*' -o -name 'test_fp8_training' -o -name 'test_train_fsdp' -o -name 'test_fp8_fsdp' -o -name 'test_dist_staged_communicator' -o -name 'test_fp8_moe' -o -name 'test_ckpt_moe_expert_parallel' -o -name 'test_ckpt_moe_fsdp' -o -name 'bench_gpu*' -o -name 'gpu_parity_dump' \) 2>/dev/null | sort)
for b in "${bins[@]}"; do cp "$b" "$out/bin/"; strip --strip-debug "$out/bin/$(basename "$b")" 2>/dev/null || true; done

if [[ "${PLM_PKG_CTEST:-0}" == 1 ]]; then
  build=$(cd "$build" && pwd)
  echo "$build" > "$out/BUILD_DIR"
  sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt" > "$out/SOURCE_DIR"
  while IFS= read -r f; do
    rel=${f#"$build"/}
    mkdir -p "$out/tree/$(dirname "$rel")"
    cp "$f" "$out/tree/$rel"
  done < <(find "$build" -path "$out" -prune -o -path "$build/pkg*" -prune -o -name CTestTestfile.cmake -print)
  while IFS= read -r f; do
    rel=${f#"$build"/}
    mkdir -p "$out/tree/$(dirname "$rel")"
    cp "$f" "$out/tree/$rel"; strip --strip-debug "$out/tree/$rel" 2>/dev/null || true
    bins+=("$f")
  done < <(find "$build/test" -type f -executable -name 'test_*' ! -name '*.sh' ! -name '*.py')
fi

# A test binary in both bin/ and tree/ is stored once (a hard link): tar keeps one copy.
if [[ "${PLM_PKG_CTEST:-0}" == 1 ]]; then
  for f in "$out"/bin/*; do
    t=$(find "$out/tree" -type f -name "$(basename "$f")" | head -1)
    [[ -n "$t" ]] && cmp -s "$f" "$t" && ln -f "$t" "$f"
  done
fi

# Left to the GPU machine: glibc and the compiler runtime, CUDA (NVRTC too), NCCL, cuDNN (it loads its engine
# libraries from its own folder at run time), MPI and what MPI links.
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|libpthread\.|librt\.|libresolv\.|libgcc_s\.|libstdc\+\+\.|libcuda|libcudart|libcublas|libnccl|libcudnn|libnvrtc|libmpi|libopen-rte|libopen-pal|libhwloc|libevent|libudev)'
for b in "${bins[@]}"; do
  ldd "$b" | awk '/=> \// {print $1, $3}'
done | sort -u | while read -r name path; do
  if [[ ! "$name" =~ $skip ]]; then cp -L "$path" "$out/lib/$name"; fi
done
echo "package-cuda: $(ls "$out/bin" | wc -l) binaries, $(ls "$out/lib" | wc -l) libraries, $(du -sh "$out" | cut -f1) in $out"
