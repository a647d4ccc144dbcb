#!/usr/bin/env bash
# Install the Debian packages dstrain builds and runs with. Idempotent: packages that are
# already present are skipped, and nothing is done at all when every one of them is there.
# CUDA is not installed here: when nvcc is on PATH the CUDA backend is built, otherwise not.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libopenmpi-dev openmpi-bin            # MPI: process groups and host-memory collectives
  libhdf5-dev hdf5-tools                # checkpoints and golden files (h5dump for users)
  libyaml-cpp-dev                       # config files
  libspdlog-dev libfmt-dev              # logging
  nlohmann-json3-dev                    # JSON: HF config.json, metrics, safetensors header
  libpcre2-dev                          # regexes of Hugging Face tokenizer.json pre-tokenizers
  libgtest-dev                          # tests (GoogleTest, run through CTest)
  libopenblas-openmp-dev                # CPU GEMM (OpenMP build: safe inside parallel regions)
  libdnnl-dev                           # oneDNN: the other CPU GEMM, measured against OpenBLAS
  clang libclang-rt-14-dev libomp-14-dev   # the sanitizer build and libFuzzer targets (tools/run-sanitized.sh)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install-deps: done"
