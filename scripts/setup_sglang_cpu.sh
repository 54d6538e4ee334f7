#!/usr/bin/env bash
# Install SGLang into its own virtual environment, working on a CPU without AMX, for the
# SGLang `engine` tests and `mismatch qualify --engine sglang` against a real server on
# 127.0.0.1 (mismatch/remote/launch.py starts it).
#
#   scripts/setup_sglang_cpu.sh [VENV_DIR]    default: .venv-sglang in the repository root
#
# Idempotent: does nothing when VENV_DIR already imports SGLang's server with both fixes below.
# Why each step:
# - The sglang 0.5.23 wheel pins torch 2.14.1 and CUDA-only packages (flashinfer, sglang-kernel,
#   cuda-python, nvidia-*, tilelang, ...), so it goes in with --no-deps on torch 2.13.0 (this
#   machine's local CPU wheel), plus the part of its Requires-Dist that the CPU server imports,
#   plus `dill`, which it imports without declaring. Its own venv: it wants transformers 5.19.0,
#   the project pins <5.15.
# - torchvision: SGLang imports it at start-up; the only build for torch 2.13 is 0.28.0+cu130,
#   whose _meta_registrations.py registers fake kernels for torchvision::nms / qnms at import
#   and fails on a CPU torch ("operator torchvision::nms does not exist"). The script makes
#   those two registrations conditional on torchvision.extension._has_ops() (text models never
#   call nms).
# - sgl_kernel: SGLang's CPU kernel package is on no index reachable here. Without AMX the CPU
#   server computes with native torch, but some modules import names from `sgl_kernel` at import
#   time, and the plain generate path calls one, assign_req_to_token_pool_cpu. The script
#   installs a small pure-torch `sgl_kernel` (scripts/sgl_kernel_cpu_shim.py) with that function;
#   any other name raises a RuntimeError naming it when called. Enough for a dense
#   model without speculative decoding; not for MoE, quantized or multimodal models.
set -euo pipefail

SGLANG_VERSION="0.5.23"
TORCH_VERSION="2.13.0"
TORCHVISION_SPEC="torchvision==0.28.0"
# The CPU-relevant part of sglang 0.5.23's Requires-Dist (versions pinned where it pins them).
DEPS=(
    "transformers==5.19.0" "tokenizers==0.23.2" "xgrammar==0.2.7" "sentencepiece==0.2.1"
    "openai==2.8.0" "openai-harmony==0.0.4" "compressed-tensors==0.18.0" "numba==0.65.1"
    "blobfile==3.0.0" "soundfile==0.13.1" "llguidance>=1.7.6,<2.0.0" "python-dateutil<3"
    "uvicorn>=0.51" "prometheus-client>=0.20.0" "pyzmq>=25.1.2" "mistral_common>=1.11.5"
    "anthropic>=0.20.0"
    aiohttp build datasets distro easydict einops fastapi gguf interegular IPython modelscope
    msgspec ninja numpy nvidia-ml-py orjson packaging partial_json_parser pillow psutil py-spy
    pybase64 pydantic python-multipart regex requests scipy setproctitle tiktoken tqdm uvloop
    watchfiles xxhash zstandard dill
)

root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$root/.venv-sglang}"
python="${PYTHON:-python3}"
shim="$root/scripts/sgl_kernel_cpu_shim.py"
start=$(date +%s)

elapsed() { echo "$(( $(date +%s) - start ))s"; }
fail() { echo "setup_sglang_cpu: $*" >&2; exit 1; }
# The check: the server module imports (which imports torchvision and sgl_kernel) and the shim
# is this repository's current one.
check() {
    "$venv/bin/python" - "$shim" >/dev/null 2>&1 <<'EOF'
import filecmp, sys, sgl_kernel
assert filecmp.cmp(sys.argv[1], sgl_kernel.__file__, shallow=False)
import sglang.launch_server  # noqa: F401
EOF
}

if [[ -x "$venv/bin/python" ]] && check; then
    echo "setup_sglang_cpu: $venv already has sglang $("$venv/bin/python" -c \
        'import importlib.metadata as m; print(m.version("sglang"))') — nothing to do ($(elapsed))"
    exit 0
fi
[[ "$(uname -m)" == "x86_64" ]] || fail "only x86_64 is supported (this machine is $(uname -m))"
[[ -f "$shim" ]] || fail "$shim is missing (run the script from a checkout of the repository)"

echo "setup_sglang_cpu: creating $venv"
"$python" -m venv "$venv" || fail "could not create a virtual environment with $python"
vpy="$venv/bin/python"
# pip's output without the "WARNING: Location ... is ignored" lines of this machine's pip config
pip_install() {
    local log rc=0
    log="$(mktemp)"
    "$vpy" -m pip install --disable-pip-version-check -q "$@" >"$log" 2>&1 || rc=$?
    grep -v "^WARNING: Location" "$log" >&2 || true
    rm -f "$log"
    [[ $rc == 0 ]] || fail "pip install $* failed (exit $rc; its output is above)"
}

echo "setup_sglang_cpu: torch==$TORCH_VERSION (the local CPU wheel) ($(elapsed))"
pip_install "torch==$TORCH_VERSION"
torch_version="$("$vpy" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
[[ "$torch_version" == "$TORCH_VERSION+cpu" ]] || fail "pip installed torch '$torch_version'," \
    "not $TORCH_VERSION+cpu (the CPU wheel this kind of machine keeps on disk)"

echo "setup_sglang_cpu: sglang==$SGLANG_VERSION --no-deps and its CPU dependencies ($(elapsed))"
# torch is named again so that pip keeps the +cpu build instead of resolving it anew.
pip_install "torch==$TORCH_VERSION+cpu" "$TORCHVISION_SPEC" "${DEPS[@]}"
pip_install --no-deps "sglang==$SGLANG_VERSION"

echo "setup_sglang_cpu: torchvision's nms/qnms fake registrations, sgl_kernel shim ($(elapsed))"
"$vpy" - <<'EOF' || fail "could not patch torchvision (see the error above)"
import importlib.util, pathlib, re
path = pathlib.Path(importlib.util.find_spec("torchvision").submodule_search_locations[0])
meta = path / "_meta_registrations.py"
text = meta.read_text()
guard = "if extension._has_ops():  # patched by setup_sglang_cpu.sh\n"
if guard not in text:
    # each `@torch.library.register_fake("torchvision::nms")` (and qnms) block, to the end of
    # its function, goes under the guard
    pattern = re.compile(r'^@torch\.library\.register_fake\("torchvision::q?nms"\)\n'
                         r'def .*?(?=^\S)', re.M | re.S)
    blocks = pattern.findall(text)
    if len(blocks) != 2:
        raise SystemExit(f"{meta}: expected the nms and qnms registrations, found {len(blocks)}")
    for block in blocks:
        indented = "".join("    " + l if l.strip() else l for l in block.splitlines(True))
        text = text.replace(block, guard + indented, 1)
    if "from torchvision import extension" not in text:
        text = "from torchvision import extension\n" + text
    meta.write_text(text)
EOF
site="$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$site/sgl_kernel"
cp "$shim" "$site/sgl_kernel/__init__.py"

echo "setup_sglang_cpu: checking the server imports ($(elapsed))"
if ! check; then
    "$vpy" -c "import sglang.launch_server" 2>&1 | tail -3 >&2
    fail "sglang.launch_server does not import in $venv (the error is above)"
fi
"$vpy" -c "import importlib.metadata as m; print('setup_sglang_cpu:', ', '.join(
    f'{d} {m.version(d)}' for d in ('sglang', 'torch', 'transformers', 'torchvision')))"
echo "setup_sglang_cpu: done in $(elapsed): $venv ($(du -sh "$venv" | cut -f1))"
