#!/usr/bin/env bash
# A private CUDA 12 toolkit for the cuda12_* nox cells, where PyPI has no CUDA 12 nvcc.
#
#   bash scripts/get_cuda12_toolkit.sh [PREFIX]     # default PREFIX: .nox/_toolkits/cuda12
#
# Downloads Debian trixie's non-free nvidia-cuda-toolkit 12.4.131 (and the headers and runtime
# it needs, about 1 GB) with apt-get, using a private package list in a temporary folder: the
# system's apt sources, lists and installed packages are not touched, and nothing is installed.
# The packages are unpacked and laid out as a CUDA_HOME (bin/nvcc, include/, lib64/) in PREFIX.
# Needs apt-get and dpkg-deb (Debian or Ubuntu) and a host g++ from 6 to 13.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=${1:-$ROOT/.nox/_toolkits/cuda12}
PACKAGES=(nvidia-cuda-toolkit nvidia-cuda-dev libcudart12 libnvvm4 libcu++-dev libcub-dev libthrust-dev)
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/lists/partial" "$WORK/cache/archives/partial" "$WORK/debs" "$WORK/root"
echo "deb [signed-by=$KEYRING] http://deb.debian.org/debian trixie main contrib non-free" \
  > "$WORK/sources.list"
APT=(-o "Dir::Etc::SourceList=$WORK/sources.list" -o Dir::Etc::SourceParts=/dev/null
     -o "Dir::State::Lists=$WORK/lists" -o "Dir::Cache=$WORK/cache" -o APT::Architecture=amd64
     -o APT::Sandbox::User=root)

echo "== downloading ${PACKAGES[*]} (Debian trixie, non-free)"
apt-get "${APT[@]}" -qq update
(cd "$WORK/debs" && apt-get "${APT[@]}" -qq download "${PACKAGES[@]}")
for deb in "$WORK"/debs/*.deb; do dpkg-deb -x "$deb" "$WORK/root"; done

echo "== laying out $PREFIX"
U=$WORK/root/usr
rm -rf "$PREFIX"
mkdir -p "$PREFIX/bin" "$PREFIX/nvvm"
# nvcc and what it runs: the real binaries, not Debian's /usr/bin/nvcc wrapper script.
cp -a "$U/lib/nvidia-cuda-toolkit/bin/." "$PREFIX/bin/"
for tool in "$U"/bin/*; do
  [ "$(basename "$tool")" = nvcc ] || cp -a "$tool" "$PREFIX/bin/"
done
cp -a "$U/lib/nvidia-cuda-toolkit/libdevice" "$PREFIX/nvvm/libdevice"
cp -a "$U/include" "$PREFIX/include"
cp -a "$U/lib/x86_64-linux-gnu" "$PREFIX/lib64"
# Debian's nvcc.profile is a link to /etc/nvcc.profile with absolute /usr paths; this one is
# relative to nvcc itself, like the one in NVIDIA's own toolkits.
rm -f "$PREFIX/bin/nvcc.profile"
cat > "$PREFIX/bin/nvcc.profile" <<'EOF'
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
PATH            += $(_HERE_):
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib64/stubs" "-L$(TOP)/lib64"
CUDAFE_FLAGS    +=
PTXAS_FLAGS     +=
EOF

echo "== checking"
"$PREFIX/bin/nvcc" --version | tail -2
printf '__global__ void k(float *x) { x[threadIdx.x] *= 2.f; }\n' > "$WORK/k.cu"
"$PREFIX/bin/nvcc" -arch=sm_80 -c "$WORK/k.cu" -o "$WORK/k.o"
echo "CUDA 12 toolkit ready: CUDA_HOME=$PREFIX (the cuda12_* nox cells find it there)"
