"""The model zoo: the embedded tiny Qwen3-MoE policy, its tokenizer, and its tool-use task family.

    load_model(path=None, dtype="bfloat16")   a causal LM from a local directory (None: embedded)
    load_tokenizer(path=None)                 its tokenizer, with the chat template
    default_model_dir()                       where the embedded model lives (package data)

The task family (`mismatch.zoo.tasks`, `mismatch.zoo.episode`) is what the RL trainer reuses.
Importing this package is cheap: torch and transformers load inside the functions.
"""

from .errors import ZooError
from .loading import check_model_dir, default_model_dir, load_model, load_tokenizer

__all__ = ["ZooError", "check_model_dir", "default_model_dir", "load_model", "load_tokenizer"]
