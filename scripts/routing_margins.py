"""How close a MoE model's routing decisions are to flipping: the gap at the top-k boundary.

A router picks the top-k experts by logit; a numerics change flips a choice when it moves the
k-th and (k+1)-th logits across each other. So the flip rate a probe measures (the routing
source: `mismatch probe --sources routing`) depends on how often that gap is small against the
size of the numerics' perturbation of the logits. This script scores held-out prompts of a MoE
model (the embedded one by default) in FP32 and in BF16 and reports, per layer:

- the boundary gap g = logit_k − logit_(k+1) of the FP32 router (quantiles, in logit units);
- the BF16 forward's perturbation of the router logits, |Δ logit| (quantiles);
- the share of positions with g below the perturbation's median: a first-order estimate of
  the flip rate.

With the number of layers L, 1 − (1 − p)^L is the share of positions with at least one flip
when per-layer flips (rate p) are independent: the depth term of R3's 94% (arXiv:2510.11370).

    python scripts/routing_margins.py [--model DIR] [--n-prompts 32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mismatch.engines.routing import routers  # noqa: E402
from mismatch.zoo import load_model, load_tokenizer  # noqa: E402
from mismatch.zoo.prompts import load_prompts  # noqa: E402


def router_logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each router's logits [positions, experts] in FP32, over every prompt (one at a time)."""
    found = routers(model)
    out: list[list[torch.Tensor]] = [[] for _ in found]
    hooks = [r.register_forward_hook(
        lambda mod, args, _res, i=i: out[i].append(
            torch.nn.functional.linear(args[0].reshape(-1, mod.weight.shape[-1]).float(),
                                       mod.weight.float()).detach()))
        for i, r in enumerate(found)]
    try:
        with torch.no_grad():
            for p in prompts:
                model(input_ids=torch.tensor([p]))
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(x) for x in out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--n-prompts", type=int, default=32)
    args = parser.parse_args()
    tok = load_tokenizer(args.model)
    prompts = load_prompts(tok, None, args.n_prompts)
    fp32, bf16 = load_model(args.model, "float32"), load_model(args.model, "bfloat16")
    k = routers(fp32)[0].top_k
    ref, low = router_logits(fp32, prompts), router_logits(bf16, prompts)
    print(f"{len(ref)} MoE layers, {ref[0].shape[1]} experts, top-{k}, "
          f"{ref[0].shape[0]} positions")
    print("| layer | gap p10 | gap p50 | |Δ logit| p50 | |Δ logit| p90 | gap < |Δ| p50 |")
    print("|---|---|---|---|---|---|")
    shares = []
    for layer, (r, b) in enumerate(zip(ref, low)):
        top = r.topk(k + 1, dim=-1).values
        gap = top[:, k - 1] - top[:, k]
        delta = (b - r).abs()
        med = delta.median()
        share = float((gap < med).double().mean())
        shares.append(share)
        q = torch.tensor([0.1, 0.5])
        g10, g50 = torch.quantile(gap, q).tolist()
        d50, d90 = torch.quantile(delta.flatten(), torch.tensor([0.5, 0.9])).tolist()
        print(f"| {layer} | {g10:.3g} | {g50:.3g} | {d50:.2e} | {d90:.2e} | {share:.2%} |")
    p = sum(shares) / len(shares)
    print(f"mean per-layer estimate p = {p:.2%}; 1 - (1 - p)^{len(ref)} = "
          f"{1 - (1 - p) ** len(ref):.2%}; at R3's per-layer 10% over 48 layers: "
          f"{1 - 0.9 ** 48:.1%}")


if __name__ == "__main__":
    main()
