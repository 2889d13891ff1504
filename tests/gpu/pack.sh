#!/usr/bin/env bash
# Packs a CUDA build for a GPU machine that cannot build the project (no Debian -dev packages,
# no network; docs/gpu.md "Running the GPU checks"): the GPU test binaries, bench_cuda_gemv,
# test_integration and flashmesh, with every shared library they load that such a machine
# lacks, into .devrun/ (git-ignored). There: tests/gpu/run.sh --prebuilt.
# Usage (repo root or anywhere): tests/gpu/pack.sh [BUILD_DIR]   (default: build)
# The build needs CUDA on and sm_90 (H100/H200) among CMAKE_CUDA_ARCHITECTURES (the default).
# Left out, as the GPU machine has its own: glibc, libstdc++/libgcc_s, the CUDA driver, NCCL.
set -euo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:-$top/build}" && pwd)
dst=$top/.devrun
bins=(cli/flashmesh tests/gpu/test_cuda_kernels tests/gpu/test_cuda_shard tests/gpu/bench_cuda_gemv
      tests/gpu/test_nccl_smoke tests/gpu/test_nccl_communicator tests/integration/test_integration)

grep -q 'code=\[compute_90,sm_90\]' "$build/build.ninja" ||
  { echo "pack.sh: $build is not a CUDA build with sm_90 SASS (see CMAKE_CUDA_ARCHITECTURES)" >&2; exit 1; }
rm -rf "$dst"
mkdir -p "$dst/bin" "$dst/lib"
for b in "${bins[@]}"; do
  if [ -f "$build/$b" ]; then cp "$build/$b" "$dst/bin/"; else echo "pack.sh: not built, left out: $b"; fi
done
[ -f "$dst/bin/flashmesh" ] || { echo "pack.sh: $build/cli/flashmesh is missing" >&2; exit 1; }
strip --strip-debug "$dst"/bin/*

for b in "$dst"/bin/*; do
  if ldd "$b" | grep 'not found'; then echo "pack.sh: $(basename "$b") has unresolved libraries" >&2; exit 1; fi
  ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// {print $3}'
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libgcc_s.so*|libstdc++.so*) ;;
    libcuda.so*|libnccl.so*) ;;
    *) cp -L "$lib" "$dst/lib/" ;;
  esac
done
# What the binaries were built for, so run.sh can say what it runs.
git -C "$top" describe --always --dirty >"$dst/commit" 2>/dev/null || echo unknown >"$dst/commit"
if grep -q '^FLASHMESH_NATIVE:BOOL=ON' "$build/CMakeCache.txt"; then
  echo "pack.sh: note: built with -march=native, so the GPU machine's CPU needs this one's" \
       "extensions (reconfigure with -DFLASHMESH_NATIVE=OFF for a portable pack)"
fi
echo "pack.sh: $(du -sh "$dst" | cut -f1) in $dst ($(ls "$dst/bin" | wc -l) binaries, $(ls "$dst/lib" | wc -l) libraries)"
