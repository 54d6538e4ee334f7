"""Hooks that make a training framework write what `mismatch monitor` reads, live.

- `mismatch.integrations.trl`: a transformers `TrainerCallback` (TRL's trainers are transformers
  Trainers) that appends each log as one JSON line.
- `mismatch.integrations.verl`: the correction arms as verl policy losses; importing it registers
  them, so it imports verl at once (verl imports it in turn, through the project's entry point).

`mismatch` itself imports neither: `import mismatch` works without the frameworks.
"""
