"""slime's and Miles' console metric lines → dicts.

Both log their metrics (besides wandb / tensorboard) through Python logging, one line per
report: `[<asctime>] <file>:<line> - <kind> <n>: <dict repr>`
(THUDM/slime@624b824:slime/observability/logging_utils.py configure_logger, format
`[%(asctime)s{prefix}] %(filename)s:%(lineno)d - %(message)s`; radixark/miles@31f1ca9:
miles/utils/logging_utils.py configure_logger_raw, `[%(asctime)s.%(msecs)03d {name}] ...`).
The kinds and what `n` is (slime's files; Miles' log_utils.py / metrics.py mirror them):

- `step N` — train metrics, N = train/step (megatron_utils/model.py train_one_step's log);
  `critic-step N` is the critic's and is another event here;
- `rollout N`, `multi_turn N`, `passrate N` — N = the rollout id
  (observability/train_metric_utils.py gather_log_data);
- `perf N` — N = the rollout id (train_metric_utils.py log_perf_data,
  rollout_metrics.py log_rollout_data, which also carries rollout/response_len/...);
- `eval N` — evaluation (rollout_metrics.py log_eval_rollout_data): another event here.

The dict is a Python repr (`{'rollout/raw_reward': 0.63, ...}`), read with `ast.literal_eval`
(bare `nan` / `inf`, which repr writes for non-finite floats, are accepted). Train lines get
`train/step`, the others `rollout_id`: the adapter's two step axes.
"""

from __future__ import annotations

import ast
import re
from typing import Any

__all__ = ["parse_console_line", "CONSOLE_EXAMPLE"]

CONSOLE_EXAMPLE = "[2026-08-21 10:01:00] train_metric_utils.py:134 - rollout 7: {...}"

_LINE = re.compile(r"^\[[^\]]*\]\s+\S+:\d+ - (?P<kind>critic-step|step|rollout|perf|eval|"
                   r"multi_turn|passrate) (?P<n>-?\d+): (?P<body>\{.*\})\s*$")
_OTHER_KINDS = {"critic-step", "eval"}
_NONFINITE = {"nan": float("nan"), "inf": float("inf")}


class _NonFinite(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in _NONFINITE:
            return ast.copy_location(ast.Constant(_NONFINITE[node.id]), node)
        return node


def _literal(body: str) -> Any:
    try:
        return ast.literal_eval(body)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        pass
    try:  # repr of a non-finite float is a bare name: nan, inf, -inf
        tree = _NonFinite().visit(ast.parse(body, mode="eval"))
        return ast.literal_eval(tree)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def parse_console_line(text: str) -> dict[str, Any] | None:
    """The metrics dict of one console metric line, with its step field; None if it is none.

    An eval or critic line comes back as `{"type": "console_<kind>"}`: another event.
    """
    m = _LINE.match(text)
    if m is None:
        return None
    body = _literal(m["body"])
    if not isinstance(body, dict):
        return None
    kind, n = m["kind"], int(m["n"])
    if kind in _OTHER_KINDS:
        return {"type": f"console_{kind}"}
    out = {str(k): v for k, v in body.items()}
    if kind == "step":
        out["train/step"] = n
    else:
        out["rollout_id"] = n
    out["type"] = "metric"  # Miles' adapter reads only metric events
    out["console_kind"] = kind
    return out
