#!/usr/bin/env bash
# Installs every Debian package flashmesh needs to build, test and fuzz.
# Idempotent and non-interactive; CUDA and NCCL come with the machine's CUDA toolkit.
set -euo pipefail
PKGS=(
  build-essential cmake ninja-build pkg-config git
  clang libclang-rt-14-dev          # libFuzzer + sanitizer runtimes
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libboost-dev                      # Boost.Asio (header-only)
  libboost-context-dev              # fibers of the CUDA emulation (tests/gpu/emulate.sh)
  libssl-dev                        # libcrypto: HMAC-SHA256 data-plane authentication
  prometheus-cpp-dev                # /metrics: registry + text exposition format
  libyaml-cpp-dev nlohmann-json3-dev libpcre2-dev
  libgtest-dev libgmock-dev libbenchmark-dev
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node.js + npm run the official `openai` client in the HTTP API test; a machine that already
# has them (e.g. from NodeSource, whose nodejs bundles npm) keeps its own.
command -v node >/dev/null 2>&1 || missing+=(nodejs)
command -v npm >/dev/null 2>&1 || missing+=(npm)
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PKGS[@]} packages and node/npm present"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "install-deps: installing ${missing[*]}"
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
