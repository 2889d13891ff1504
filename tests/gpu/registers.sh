#!/usr/bin/env bash
# Registers, spills, stack and static shared memory of every kernel in kernels/cuda, per
# architecture, as ptxas reports them (no GPU needed): the numbers docs/gpu-kernels.md
# "Registers and spills" quotes. The build itself fails on a spill for sm_90 and sm_121
# (kernels/cuda/CMakeLists.txt); this prints the whole table.
# Usage: tests/gpu/registers.sh [ARCH...]   (default: 90 121; ~2 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
archs=("$@")
[ ${#archs[@]} -gt 0 ] || archs=(90 121)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for arch in "${archs[@]}"; do
  echo "== sm_$arch: registers  spill stores/loads (bytes)  stack (bytes)  static smem (bytes)  kernel"
  for f in kernels/cuda/*.cu; do
    nvcc -O3 -DNDEBUG -std=c++17 -I. --generate-code=arch=compute_$arch,code=sm_$arch \
      -Xptxas -v -c "$f" -o "$tmp/k.o" >"$tmp/ptxas.txt" 2>&1 ||
      { cat "$tmp/ptxas.txt" >&2; exit 1; }
    # ptxas prints, per entry function: its mangled name, then its stack and spills, then its
    # registers and shared memory.
    awk -v file="$(basename "$f" .cu)" '
      /Compiling entry function/ { match($0, /'"'"'[^'"'"']+'"'"'/); name = substr($0, RSTART + 1, RLENGTH - 2) }
      /bytes stack frame/ { stack = $1; st = $5; ld = $9 }
      /Used [0-9]+ registers/ && name != "" {
        match($0, /Used [0-9]+ registers/); regs = substr($0, RSTART + 5, RLENGTH - 15)
        smem = 0; if (match($0, /[0-9]+ bytes smem/)) smem = substr($0, RSTART, RLENGTH - 11)
        printf "%4d  %4d/%-4d  %4d  %6d  %s %s\n", regs, st, ld, stack, smem, file, name; name = "" }
    ' "$tmp/ptxas.txt" | c++filt | sed -E 's/fm::cuda::(\(anonymous namespace\)::)?//g; s/\(([^)]*)\)$//'
  done
done
