"""Regenerate reports/ladder-h100-fp8.md and reports/fleet-mixed.md (EMULATED, embedded model).

    python scripts/make_source_reports.py [--fleet-prompts 512]

1. `mismatch probe --gpu h100 --dtype fp8 --sources all --ladder` (the defaults: 512 prompts,
   128 for the per-GPU/fleet/sampling grids), timed; its report and plots are copied into
   reports/ with a `ladder-h100-fp8-` prefix.
2. `mismatch probe --gpu h100 --dtype fp8 --sources accelerator --subset-prompts N`: the study's
   mixed fleet on N prompts, written as reports/fleet-mixed.md with a plot.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORTS = ROOT / "reports"


def _run(args: list[str], out: Path) -> tuple[dict, float, str]:
    cmd = ["mismatch", "probe", *args, "--out", str(out)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    return json.loads((out / "results.json").read_text()), wall, "mismatch probe " + " ".join(args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fleet-prompts", type=int, default=512)
    ap.add_argument("--runs", type=Path, default=ROOT / "runs")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from mismatch.app.sources_report import fleet_markdown, fleet_plot

    REPORTS.mkdir(exist_ok=True)
    out = a.runs / "ladder-h100-fp8"
    _, wall, cmd = _run(["--gpu", "h100", "--dtype", "fp8", "--sources", "all", "--ladder"], out)
    text = (out / "report.md").read_text()
    for png in sorted(out.glob("*.png")):
        shutil.copy(png, REPORTS / f"ladder-h100-fp8-{png.name}")
        text = re.sub(rf"\]\({re.escape(png.name)}\)", f"](ladder-h100-fp8-{png.name})", text)
    text = text.replace(f"Command: `{cmd} --out {out}`", f"Command: `{cmd}`", 1)
    text += (f"\nWall time of the command on this machine (2 CPU cores): {wall:.0f} s "
             f"(measured by scripts/make_source_reports.py).\n")
    (REPORTS / "ladder-h100-fp8.md").write_text(text)
    print(f"ladder-h100-fp8: {wall:.0f} s")

    out = a.runs / "fleet-mixed"
    summary, wall, cmd = _run(["--gpu", "h100", "--dtype", "fp8", "--sources", "accelerator",
                               "--subset-prompts", str(a.fleet_prompts)], out)
    fleet_plot(summary, REPORTS / "fleet-mixed.png")
    (REPORTS / "fleet-mixed.md").write_text(
        fleet_markdown(summary, cmd, "fleet-mixed.png")
        + f"\nWall time: {wall:.0f} s on this machine (2 CPU cores).\n")
    print(f"fleet-mixed: {wall:.0f} s")


if __name__ == "__main__":
    main()
