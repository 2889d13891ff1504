#!/usr/bin/env bash
# Packs a CUDA build for a GPU machine that cannot build the project (no Debian -dev packages,
# no network; docs/gpu.md "Running the GPU checks"): the GPU test binaries, bench_cuda_gemv,
# test_integration and flashmesh, with every shared library they load that such a machine
# lacks, into .devrun/pack.tgz (git-ignored). There: tests/gpu/run.sh --prebuilt.
# Usage (repo root or anywhere):
#   tests/gpu/pack.sh             builds them first in build-pack/: Release, sm_90 only (H100/
#                                 H200; half the fatbin), -march=x86-64-v3 (AVX2: runs on any
#                                 GPU host's CPU); through ccache when installed
#   tests/gpu/pack.sh BUILD_DIR   packs that build (brought up to date; CUDA with sm_90); a
#                                 -march=native build records its AVX extensions, and run.sh
#                                 refuses a CPU without them
# Left out, as the GPU machine has its own: glibc, libstdc++/libgcc_s, the CUDA driver, NCCL.
# The device tool carries at most 64 MiB of tree: the pack must stay under 56 MiB.
set -euo pipefail
top=$(cd "$(dirname "$0")/../.." && pwd)
dst=$top/.devrun
bins=(cli/flashmesh tests/gpu/test_cuda_kernels tests/gpu/test_cuda_shard tests/gpu/bench_cuda_gemv
      tests/gpu/test_nccl_smoke tests/gpu/test_nccl_communicator tests/integration/test_integration)
targets=()
for b in "${bins[@]}"; do targets+=("$(basename "$b")"); done

if [ $# -eq 0 ]; then
  build=$top/build-pack
  launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache
                                           -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  cmake -S "$top" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHMESH_CUDA=ON \
    -DFLASHMESH_NATIVE=OFF -DCMAKE_CXX_FLAGS=-march=x86-64-v3 -DCMAKE_CUDA_ARCHITECTURES=90 \
    "${launcher[@]}" >/dev/null
else
  build=$(cd "$1" && pwd)
fi
grep -q 'code=\[compute_90,sm_90\]' "$build/build.ninja" ||
  { echo "pack.sh: $build is not a CUDA build with sm_90 SASS (see CMAKE_CUDA_ARCHITECTURES)" >&2; exit 1; }
# Binaries older than the sources would measure the wrong code: bring them up to date (a
# no-op when they are).
cmake --build "$build" -j "${JOBS:-$(nproc)}" --target "${targets[@]}"
rm -rf "$dst"
mkdir -p "$dst/bin" "$dst/lib"
for b in "${bins[@]}"; do
  [ -f "$build/$b" ] || { echo "pack.sh: $build/$b was not built" >&2; exit 1; }
  cp "$build/$b" "$dst/bin/"
done
strip --strip-unneeded "$dst"/bin/*

for b in "$dst"/bin/*; do
  if ldd "$b" | grep 'not found' >&2; then echo "pack.sh: $(basename "$b") has unresolved libraries" >&2; exit 1; fi
  ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// {print $3}'
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libgcc_s.so*|libstdc++.so*) ;;
    libcuda.so*|libnccl.so*) ;;
    *) cp -L "$lib" "$dst/lib/" ;;
  esac
done
# What the binaries were built for, so run.sh can say what it runs (and check the CPU).
git -C "$top" describe --always --dirty >"$dst/commit" 2>/dev/null || echo unknown >"$dst/commit"
if grep -q '^FLASHMESH_NATIVE:BOOL=ON' "$build/CMakeCache.txt"; then
  echo "-march=native" >"$dst/march"
  grep -o 'avx[0-9a-z_]*' /proc/cpuinfo | sort -u | tr '\n' ' ' >"$dst/cpuflags"
  echo "pack.sh: note: built with -march=native: the GPU host's CPU needs $(cat "$dst/cpuflags")" \
       "(run.sh checks; tests/gpu/pack.sh with no argument makes a portable pack)"
else
  # The flag of CMAKE_CXX_FLAGS itself (the cache also holds option help texts that name flags).
  grep -oP '^CMAKE_CXX_FLAGS:STRING=.*?\K-march=\S+' "$build/CMakeCache.txt" >"$dst/march" ||
    echo "the compiler's default" >"$dst/march"
fi
n_bins=$(ls "$dst/bin" | wc -l) n_libs=$(ls "$dst/lib" | wc -l)
tar -C "$dst" -czf "$dst/pack.tgz" bin lib
rm -rf "$dst/bin" "$dst/lib"
size=$(du -sm "$dst" | cut -f1)
[ "$size" -le 56 ] ||
  { echo "pack.sh: the pack is $size MiB: over the 56 MiB that leaves the tree room in the tool's 64 MiB" >&2; exit 1; }
echo "pack.sh: $size MiB in $dst/pack.tgz ($n_bins binaries, $n_libs libraries; run.sh --prebuilt unpacks it)"
