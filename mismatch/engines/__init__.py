"""Engines: the trainer-side scorer and the samplers (emulated here; HTTP and measured later)."""
