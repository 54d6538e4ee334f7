"""The live inference servers this project has a client for, by the names `mismatch qualify
--engine/--launch` take (vllm_client.py, sglang_client.py). Names only, importing nothing, so the
command line reads them without loading a network stack; `app.qualify_remote.ENGINES` keys its
clients by them."""

from __future__ import annotations

__all__ = ["LIVE_ENGINES"]

LIVE_ENGINES = ("vllm", "sglang")
