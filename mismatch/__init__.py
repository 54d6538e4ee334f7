"""mismatch: a numerics mismatch profiler and simulator for large-model RL."""

__version__ = "0.1.0"
