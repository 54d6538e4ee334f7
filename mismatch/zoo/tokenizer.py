"""The embedded model's tokenizer: byte-level BPE trained on the synthetic transcripts.

The pipeline is Qwen2/Qwen3's, at a small vocabulary:
- pre-tokenizer: Qwen2's split regex (words with their leading space, single digits, runs of
  punctuation, newlines) followed by the GPT-2 byte-to-unicode map, so every byte string encodes
  and `decode(encode(text)) == text` for any text;
- model: BPE trained with `tokenizers`' BpeTrainer over the rendered transcripts, the 256 byte
  symbols always in the alphabet;
- added tokens: the control tokens (special: skipped by `skip_special_tokens`) and the markup
  tokens `<think>`, `<tool_call>`, ... (atomic, kept on decode, as in Qwen3). Ids 0..8 are these
  nine, in the order of chat_template.SPECIAL_TOKENS then ADDED_TOKENS.

Files written: `tokenizer.json` (the whole pipeline) and `tokenizer_config.json` (class,
eos/pad tokens and the chat template inline), which `AutoTokenizer.from_pretrained(dir)` loads
offline. Training is deterministic for a given corpus (BpeTrainer breaks count ties by pair order).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
import re
from typing import Iterable, Iterator

from .chat_template import ADDED_TOKENS, CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS

__all__ = ["TokenizerSpec", "train_tokenizer", "save_tokenizer"]

# Qwen2's pre-tokenization regex: contractions, letters with one leading non-letter, single
# digits (arithmetic stays digit by digit), punctuation runs, newline runs, other whitespace.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_ADDED_SPLIT = re.compile("|".join(re.escape(t) for t in (*SPECIAL_TOKENS, *ADDED_TOKENS)))


@dataclass(frozen=True, kw_only=True)
class TokenizerSpec:
    """How the BPE is trained."""

    vocab_size: int = 1024
    """Target size including the 256 byte symbols and the added tokens."""
    min_frequency: int = 2
    """A pair must occur this often to be merged."""
    model_max_length: int = 1024
    """Written to tokenizer_config.json (the model's max_position_embeddings)."""

    def __post_init__(self) -> None:
        floor = 256 + len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
        if self.vocab_size <= floor:
            raise ValueError(f"TokenizerSpec.vocab_size must exceed {floor} (bytes + added "
                             f"tokens), got {self.vocab_size}")
        if self.min_frequency < 1 or self.model_max_length < 1:
            raise ValueError("TokenizerSpec.min_frequency and model_max_length must be >= 1")


def _pieces(texts: Iterable[str]) -> Iterator[str]:
    """The corpus with every added token cut out, so no merge ever spans or enters one."""
    for text in texts:
        yield from (piece for piece in _ADDED_SPLIT.split(text) if piece)


def train_tokenizer(texts: Iterable[str], spec: TokenizerSpec = TokenizerSpec()):
    """Train the byte-level BPE on `texts`; returns a `tokenizers.Tokenizer`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size, min_frequency=spec.min_frequency, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[*SPECIAL_TOKENS, *ADDED_TOKENS],  # ids 0..8, in this order
    )
    tokenizer.train_from_iterator(_pieces(texts), trainer=trainer)
    # The trainer adds every token as special; Qwen3 keeps the markup tokens on decode.
    state = json.loads(tokenizer.to_str())
    for entry in state["added_tokens"]:
        entry["special"] = entry["content"] in SPECIAL_TOKENS
    return Tokenizer.from_str(json.dumps(state))


def save_tokenizer(tokenizer, out_dir: Path, spec: TokenizerSpec = TokenizerSpec()) -> None:
    """Write tokenizer.json and tokenizer_config.json into `out_dir` (which must exist)."""
    out_dir = Path(out_dir)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": spec.model_max_length,
        "padding_side": "right",
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
