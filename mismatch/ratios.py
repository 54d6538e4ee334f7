"""The importance ratio's two constants, as data without torch: the MIS band (the loss arms'
registry, train/arms.py, reads it without loading torch) and the log-ratio clamp. The metrics
(mismatch.metrics), the probes' tallies and the losses use them; mismatch.metrics re-exports them.
"""

from __future__ import annotations

__all__ = ["MIS_LOW", "MIS_HIGH", "MAX_LOG_RATIO"]

# the MIS range for π/μ, outside which tokens are masked: IcePop (Zhao et al., Ant Group 2025,
# https://ringtech.notion.site/icepop)
MIS_LOW, MIS_HIGH = 0.5, 5.0
MAX_LOG_RATIO = 20.0
"""The bound |log π − log μ| is clamped to wherever a ratio is exponentiated (importance weights,
k3, the SC multipliers): e^20 ≈ 4.9e8 stays finite in float32 and its square in a mean does too,
while a ratio that far out is masked by MIS (0.5–5) or truncated by TIS long before; the one
constant of the project's metrics, probes' tallies and losses."""
