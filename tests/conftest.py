"""Shared fixtures: tiny random Qwen3 / Qwen3-MoE checkpoints written with `save_pretrained`."""

from __future__ import annotations

import json
import select
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from mismatch.quantize.checkpoint_formats import CHECKPOINT_FORMATS
from mismatch.quantize.codecs import encode

TinyModelFactory = Callable[..., Path]
FAULT_SERVER = Path(__file__).with_name("fault_server.py")
_QKV, _GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


def build_tiny_model(path: Path, *, kind: str = "dense", hidden: int = 128, seed: int = 0,
                     tokenizer: bool = False) -> Path:
    """Write a random BF16 causal LM to `path`: 2 layers, 4 heads of 32, 2 KV heads, vocab 512.

    kind: "dense" (Qwen3, MLP 256) or "moe" (Qwen3-MoE, 8 experts top-2, expert MLP 64).
    tokenizer: also save a byte-level BPE tokenizer (279 tokens) next to the weights.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=512,
                  max_position_embeddings=256, tie_word_embeddings=False)
    if kind == "dense":
        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=256, **common))
    elif kind == "moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
            intermediate_size=256, decoder_sparse_step=1, **common))
    else:
        raise ValueError(f"kind must be 'dense' or 'moe', got {kind!r}")
    model.to(torch.bfloat16).save_pretrained(str(path))
    if tokenizer:
        _tiny_tokenizer().save_pretrained(str(path))
    return path


def modelopt_amax_group(module: str, fmt: str) -> list[str]:
    """The modules whose max |w| sets `module`'s per-tensor scale in modelopt 0.47's export.

    NVFP4 / W4A16 / MXFP4: linears that read the same input share it (q/k/v; gate/up).
    FP8: each linear has its own, except a fused MoE expert's gate/up (one quantizer per expert).
    """
    prefix, _, leaf = module.rpartition(".")
    for group in (_QKV, _GATE_UP):
        shared = fmt != "fp8" or (group == _GATE_UP and ".experts." in module)
        if leaf in group and shared:
            return [f"{prefix}.{p}" for p in group]
    return [module]


def _reference_encode(source: dict[str, torch.Tensor], module: str, fmt: str):
    """Our encoder applied to the BF16 source weight with modelopt's per-tensor scale rule."""
    codec = CHECKPOINT_FORMATS[fmt].codec
    amax = max(source[f"{m}.weight"].abs().amax().float() for m in modelopt_amax_group(module, fmt))
    global_scale = {"fp8": amax / 448.0, "nvfp4": amax / (6.0 * 448.0),
                    "w4a16-nvfp4": amax / (6.0 * 448.0), "mxfp4": None}[fmt]
    return encode(source[f"{module}.weight"], codec, global_scale=global_scale)


@pytest.fixture(scope="session")
def reference_encode() -> Callable:
    """_reference_encode(source_state_dict, module, fmt) → QTensor (modelopt's scale rule)."""
    return _reference_encode


def _tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world", "the quick brown fox jumps"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    """Returns build(name, **kwargs) → a fresh checkpoint directory (see build_tiny_model)."""

    def build(name: str, **kwargs) -> Path:
        return build_tiny_model(tmp_path_factory.mktemp(name) / "model", **kwargs)

    return build


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory("qwen3", kind="dense")


@pytest.fixture(scope="session")
def tiny_moe_dir(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory("qwen3moe", kind="moe", seed=1)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE with a tokenizer and chat template, for end-to-end probe runs."""
    return build_tiny_model(tmp_path_factory.mktemp("m") / "moe", kind="moe", tokenizer=True)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    """Six `{"prompt": ...}` lines for --prompts."""
    p = tmp_path_factory.mktemp("p") / "prompts.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": f"question number {i}: what is {i} + {i}?"})
                           for i in range(6)) + "\n")
    return p


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: skip them, with the reason, where there is none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def serve(tmp_path):
    """serve(mode, *args) → base URL of a fresh fault server; all are killed afterwards."""
    procs = []

    def start(mode: str, *args: str) -> str:
        log = tmp_path / f"server-{len(procs)}.log"
        with open(log, "w") as err:
            proc = subprocess.Popen([sys.executable, str(FAULT_SERVER), "--mode", mode, "--port", "0",
                                     *args], stdout=subprocess.PIPE, stderr=err, text=True)
        procs.append(proc)
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("READY "):
            pytest.fail(f"fault server {mode} did not start: {log.read_text()[-500:]}")
        return f"http://127.0.0.1:{int(line.split()[1])}"

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()


@pytest.fixture(scope="module")
def model():
    """The embedded model in BF16 (a module's tests share one load)."""
    from mismatch.zoo import load_model

    return load_model(dtype="bfloat16")


@pytest.fixture(scope="module")
def tok():
    """The embedded model's tokenizer."""
    from mismatch.zoo import load_tokenizer

    return load_tokenizer()


def grpo_batch(model, tok, samples: int):
    """Units 3 and 4 (two GRPO groups of `samples` arithmetic episodes each, rewards 0, 1, 0, …),
    sampled by the homogeneous fleet's group with the embedded model, as one right-padded
    trainer batch."""
    from mismatch.train.batch import Unit, build_batch, task_of
    from mismatch.train.fleet import fleet
    from mismatch.train.rollout import run_episodes

    group = fleet("homogeneous")[0]
    units = []
    for u in (3, 4):
        eps = run_episodes(model, tok, [task_of(u, 0, ("arith",))] * samples, group, version=0,
                           max_turns=2, max_new_tokens=40, top_k_candidates=16, seed=u)
        for j, ep in enumerate(eps):
            ep.reward = float(j % 2)
        units.append(Unit(index=u, group=group.name, version=0, episodes=eps, seconds=0.0))
    return build_batch(units, step=0, pad_id=tok.pad_token_id)
