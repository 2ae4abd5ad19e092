#!/usr/bin/env bash
# Installs the Debian packages needed for the offline Bazel build.
# Idempotent and silent when everything is already installed.
set -euo pipefail

# bazel-bootstrap pulls in the JDK (default-jdk-headless) and build-essential;
# python3 and g++ are listed because tools/test.sh and the build use them
# directly; python3-numpy runs the safetensors interop test (an independent reader);
# lld-14 links the ASan build (.bazelrc); cmake builds the CMake package's check
# (tools/cmake_check.sh, //test/cmake:cmake_package_test); libtorch-dev (libtorch 1.13, CPU)
# is what the torch adapter (include/fsdp/torch, //:fsdp_torch, fsdp::torch), its tests
# (test/torch) and its example (//examples:torch_train) build and link against.
PACKAGES=(
  bazel-bootstrap bazel-platforms bazel-rules-java cmake
  doctest-dev libboost-dev libcli11-dev libfmt-dev nlohmann-json3-dev
  libopenmpi-dev openmpi-bin libgloo-dev gnuplot-nox libxxhash-dev
  libtorch-dev
  clang-14 libclang-rt-14-dev lld-14
  g++ python3 python3-numpy
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Abbrev}' "$pkg" 2>/dev/null || true)
  [[ "$status" == ii* ]] || missing+=("$pkg")
done
((${#missing[@]} == 0)) && exit 0

if ((EUID == 0)); then
  SUDO=()
elif command -v sudo >/dev/null; then
  SUDO=(sudo)
else
  echo "setup.sh: need root or sudo to install: ${missing[*]}" >&2
  exit 1
fi

echo "setup.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
# Lock timeout: another apt run (e.g. provisioning) may still hold the lock.
APT=("${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -q -y
     -o DPkg::Lock::Timeout=600)
"${APT[@]}" update >/dev/null
"${APT[@]}" install --no-install-recommends "${missing[@]}"
