"""Decode → re-encode round trips of sampled completions (the retokenization probe's part (a);
retokenization.py explains the measurement).

A BPE encoder writes any text in one canonical segmentation; a sampled sequence need not be
canonical (" apples" drawn as " app" + "les"), and then its ids change on a round trip through
text. A token survives when the re-encoding has a token with the same id over the same
characters; the trainer compares the surviving tokens under both contexts.
"""

from __future__ import annotations

from dataclasses import dataclass

from mismatch.engines.episodes import decode_ids as _decode
from mismatch.engines.episodes import encode_text as _encode

from .aligned_pairs import AlignedPairs
from .context import ProbeContext
from .tally import Tally

__all__ = ["RoundTrip", "round_trip", "measure_round_trips"]

_HIST_BINS = 10  # first-change positions, in tenths of the completion


@dataclass
class RoundTrip:
    """One sampled completion decoded to text and encoded again."""

    original: list[int]
    reencoded: list[int]
    aligned: list[tuple[int, int]]
    """(index in original, index in reencoded) of the tokens that survive: same id, same span."""

    @property
    def changed(self) -> bool:
        return self.original != self.reencoded

    @property
    def first_change(self) -> int | None:
        """Index in `original` of the first id that differs (None when unchanged)."""
        for i, (a, b) in enumerate(zip(self.original, self.reencoded)):
            if a != b:
                return i
        return None if not self.changed else min(len(self.original), len(self.reencoded))

    @property
    def affected(self) -> int:
        """Tokens of `original` that do not survive the round trip."""
        return len(self.original) - len(self.aligned)


def _spans(tokenizer, ids: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, id) of each token in the decoded text (ends from decoding each prefix)."""
    ends = [len(_decode(tokenizer, ids[:k + 1])) for k in range(len(ids))]
    return [(s, e, i) for s, e, i in zip([0] + ends[:-1], ends, ids)]


def round_trip(tokenizer, ids: list[int]) -> RoundTrip:
    """Decode `ids` (special tokens kept) and encode the text again."""
    reencoded = _encode(tokenizer, _decode(tokenizer, ids))
    if reencoded == list(ids):
        return RoundTrip(list(ids), reencoded, [(i, i) for i in range(len(ids))])
    where = {span: j for j, span in enumerate(_spans(tokenizer, reencoded))}
    aligned = [(i, where[span]) for i, span in enumerate(_spans(tokenizer, ids)) if span in where]
    return RoundTrip(list(ids), reencoded, aligned)


def _pieces(tokenizer, ids: list[int]) -> list[str]:
    return [_decode(tokenizer, [i]) for i in ids]


def _round_trip_example(tokenizer, trip: RoundTrip) -> str:
    d = trip.first_change or 0
    return (f"{_decode(tokenizer, trip.original[max(0, d - 3):d + 4])!r}: sampled as "
            f"{_pieces(tokenizer, trip.original[d:d + 4])}, re-encoded as "
            f"{_pieces(tokenizer, trip.reencoded[d:d + 4])}")


def measure_round_trips(ctx: ProbeContext, prompts: list[list[int]],
                        completions: list[list[int]],
                        examples: int = 2) -> tuple[dict, Tally]:
    """Round-trip each completion; figures and the trainer's Tally on the surviving tokens
    (reference = prompt + re-encoded ids, other = prompt + sampled ids)."""
    tok = ctx.tokenizer
    pairs = AlignedPairs(ctx)
    trips = [round_trip(tok, ids) for ids in completions]
    for prompt, trip in zip(prompts, trips):
        p = len(prompt)
        pairs.add(prompt + trip.reencoded, prompt + trip.original,
                  [p + j for _, j in trip.aligned], [p + i for i, _ in trip.aligned])
    changed = [t for t in trips if t.changed]
    tokens = sum(len(t.original) for t in trips)
    first = [t.first_change for t in changed]
    relative = [f / max(1, len(t.original)) for f, t in zip(first, changed)]
    hist = [0] * _HIST_BINS
    for r in relative:
        hist[min(_HIST_BINS - 1, int(r * _HIST_BINS))] += 1
    figures = {
        "sequences": len(trips),
        "sampled_tokens": tokens,
        "changed_sequences": len(changed),
        "changed_sequence_fraction": len(changed) / max(1, len(trips)),
        "changed_token_fraction": sum(t.affected for t in trips) / max(1, tokens),
        "first_change_position_mean": sum(first) / len(first) if first else None,
        "first_change_relative_position_mean":
            sum(relative) / len(relative) if relative else None,
        "first_change_relative_position_hist": hist,
        "examples": [_round_trip_example(tok, t) for t in changed[:examples]],
    }
    return figures, pairs.tally(ctx.cfg.batch_size)

