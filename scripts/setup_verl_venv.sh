#!/usr/bin/env bash
# A virtual environment with verl 0.9.x and this project, for tests/test_integration_verl.py
# (it reads $MISMATCH_VERL_VENV) and for trying the verl plug-in (mismatch.integrations.verl).
#
#   scripts/setup_verl_venv.sh [VENV_DIR]      default: .venv-verl in the repository root
#
# Idempotent: does nothing when VENV_DIR already finds the project's losses in verl's registry.
# Its own venv, because verl 0.9.1 needs transformers >=5.5.3,<5.11 while the project's venv
# resolves to 5.14 (its pin is <5.15); the intersection (5.10.x) satisfies both here. Order
# matters: torch 2.13.0 first (pip takes this machine's local CPU wheel, 2.13.0+cpu), named again
# with verl so that pip keeps it: verl's plain install asks only for torchdata/tensordict, but its
# extras pin torch 2.11 + CUDA, so none is installed. The project goes in editable, which
# registers its `verl.plugins` entry point (pyproject.toml): `import verl` then loads the losses.
set -euo pipefail

VERL_VERSION="0.9.1"
TORCH_VERSION="2.13.0"

root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$root/.venv-verl}"
python="${PYTHON:-python3}"
start=$(date +%s)

elapsed() { echo "$(( $(date +%s) - start ))s"; }
check() {
    "$venv/bin/python" -c "import verl
from verl.trainer.ppo.core_algos import get_policy_loss_fn
get_policy_loss_fn('mismatch_sc+mis')" >/dev/null 2>&1
}

if [[ -x "$venv/bin/python" ]] && check; then
    echo "setup_verl_venv: $venv already has verl $("$venv/bin/python" -c \
        'import importlib.metadata as m; print(m.version("verl"))') — nothing to do ($(elapsed))"
    exit 0
fi

echo "setup_verl_venv: creating $venv"
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

echo "setup_verl_venv: torch==$TORCH_VERSION (the local CPU wheel) ($(elapsed))"
pip_install "torch==$TORCH_VERSION"
torch_version="$("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
if [[ "$torch_version" != "$TORCH_VERSION+cpu" ]]; then
    echo "setup_verl_venv: pip installed torch '$torch_version', not $TORCH_VERSION+cpu" >&2
    exit 1
fi

echo "setup_verl_venv: verl==$VERL_VERSION and the project ($(elapsed))"
pip_install "verl==$VERL_VERSION" "torch==$TORCH_VERSION+cpu" -e "$root" "pytest>=8"

echo "setup_verl_venv: checking verl finds the project's losses ($(elapsed))"
if ! check; then
    "$venv/bin/python" -c "import verl
from verl.trainer.ppo.core_algos import get_policy_loss_fn
get_policy_loss_fn('mismatch_sc+mis')"  # show the error
    exit 1
fi
"$venv/bin/python" -c "import importlib.metadata as m; print('setup_verl_venv:', ', '.join(
    f'{d} {m.version(d)}' for d in ('verl', 'torch', 'transformers', 'tensordict')))"
echo "setup_verl_venv: done in $(elapsed): $venv ($(du -sh "$venv" | cut -f1))"
