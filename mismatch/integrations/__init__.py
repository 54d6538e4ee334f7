"""Hooks that make a training framework write what `mismatch monitor` reads, live.

- `mismatch.integrations.trl`: a transformers `TrainerCallback` (TRL's trainers are transformers
  Trainers) that appends each log as one JSON line.

Each module imports its framework only when its hook is first used, so `import mismatch` works
without them.
"""
