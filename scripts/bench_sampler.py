"""Emulated sampler generation time: NVFP4 (W4A4, B200) against plain BF16, side by side.

Three runs of the same prompts and sampling seed on the same model, interleaved --repeats times
(these machines are noisy; compare ratios within one run):

    plain       the model's own forward, no emulation (torch's CPU kernels)
    bf16        the emulated B200 BF16 sampler (same engine: GEMM and attention emulation)
    nvfp4       the emulated B200 NVFP4 sampler (+ NVFP4 weights and activations)

    python scripts/bench_sampler.py [--model DIR] [--prompts 16] [--tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: embedded)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the probe's "
                        "default for small models is 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from mismatch.cli.common import quiet_libraries

    quiet_libraries()
    from mismatch.engines.numerics import apply_numerics, calibrate
    from mismatch.engines.logits import SamplingParams
    from mismatch.engines.generation import generate
    from mismatch.zoo.prompts import load_prompts
    from mismatch.profiles import resolve
    from mismatch.zoo import load_model, load_tokenizer

    tok = load_tokenizer(args.model)
    model = load_model(args.model)
    if args.model is None:  # the shipped held-out tool-use prompts
        prompts = load_prompts(tok, None, args.prompts)
    else:
        prompts = [tok(f"prompt {i} " * 4)["input_ids"] for i in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.tokens, seed=0)
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    specs = {"bf16": resolve("b200", "bf16"), "nvfp4": resolve("b200", "nvfp4")}
    calib = [(torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long)) for p in prompts[:8]]
    scales = {k: calibrate(model, s, calib) for k, s in specs.items()}

    def run(name: str) -> tuple[float, int]:
        t0 = time.perf_counter()
        if name == "plain":
            r = generate(model, prompts, params, pad_id=0, eos_ids=eos, label=name)
        else:
            with apply_numerics(model, specs[name], scales[name]):
                r = generate(model, prompts, params, pad_id=0, eos_ids=eos, label=name)
        return time.perf_counter() - t0, r.n_tokens

    times: dict[str, list[float]] = {"plain": [], "bf16": [], "nvfp4": []}
    tokens: dict[str, int] = {}
    for name in times:  # warm-up
        run(name)
    for _ in range(args.repeats):
        for name in times:
            sec, n = run(name)
            times[name].append(sec)
            tokens[name] = n
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"# {args.prompts} prompts x <= {args.tokens} new tokens, model "
          f"{args.model or 'embedded'}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, median of {args.repeats} interleaved runs")
    print(f"{'sampler':<8}{'seconds':>10}{'tokens':>8}{'vs plain':>10}{'vs bf16':>10}")
    for k in times:
        print(f"{k:<8}{med[k]:>10.2f}{tokens[k]:>8}{med[k] / med['plain']:>10.2f}"
              f"{med[k] / med['bf16']:>10.2f}")


if __name__ == "__main__":
    main()
