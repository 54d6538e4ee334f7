"""The rollout engine: continuous batching over a preallocated slot KV cache, with KV reuse.

What a serving engine (vLLM, SGLang) does to keep a batch full, done here on the emulated model
under whatever numerics are active on it (`numerics.apply_numerics`: weight and activation
formats, accumulation models, attention kernel families with split-KV decode, FP8 KV cache,
router precision):

- **Slots.** The engine holds `slots` sequences at once. A request takes a free slot, is
  prefilled, then decodes one token per engine step together with every other running sequence;
  it leaves at EOS, at its length cap, or at the end of its forced tokens, and a waiting request
  takes its slot at the next step. Nobody decodes padding while the longest reply finishes.
- **Preallocated KV cache.** Per layer one [slots, kv_heads, capacity, head_dim] key and value
  tensor in the compute dtype; a step writes its new positions in place (`SlotCache.update`) and
  attention reads the first `Tk` positions of the batch's slots (Tk = the longest context among
  them). No per-step concatenation; the capacity grows (one copy) only when a request needs a
  longer context than any before it.
- **KV reuse across turns.** A request that names a `session` keeps its slot and KV after it
  finishes. The session's next request (a later turn of the same conversation) prefills only what
  follows the longest common prefix of its prompt and the cached tokens, as SGLang's radix cache
  and vLLM's prefix caching do: the earlier turns' KV is the one their prefill and decode steps
  wrote. New requests of one prefill with the same prompt and lane (a GRPO group's samples)
  are computed once, the others' slots given a copy of that KV, as those caches serve parallel
  sampling (prefix_sharing.py). `kv_reuse=False` prefills every request from its first token,
  alone (the switch the kernels probe uses to measure the difference). Idle sessions are evicted
  least recently used first when a request needs their slot; an evicted session's next request
  is prefilled in full.
- **Per-sequence random streams.** Each request carries its own `seed`; its j-th token is drawn
  by the j-th uniform of that stream (streams.py), so a sequence's draws never depend on which
  other sequences share its batch, or when it joined.

What is batch-invariant and what is not. Invariant: each sequence's random draws, its prompt,
positions and mask, the activation scales (static, per tensor) and dynamic per-group scales
(per row). Not invariant, as on a real server: the decode attention's split-KV partition and
tile walk cover Tk = the longest context in the batch, and a CPU GEMM may block its reduction by
the batch's row count, so log-probs can differ in their last bits with the batch's composition
(the batch-composition source of the kernels probe); a sampled token changes only where such a
difference moves the inverse CDF across a token boundary.

What a request asks and what its `Completion` holds: requests.py.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable

import torch

from ..kernels.bf16_gemm import bf16_module_gemms
from .kv_cache import SlotCache
from .lanes import batch_lanes
from .outputs import SlotOutputs
from .prefix_sharing import copy_shared, shared_rows
from .requests import Completion, EngineStats, Request
from .routing import routers as find_routers
from .logits import process_rows, ranked_topk
from .streams import next_tokens

__all__ = ["Engine"]

_CAPACITY_STEP = 256  # the KV capacity grows in whole multiples of this many positions


@dataclass
class _Seq:
    """A running request in its slot."""

    request: Request
    slot: int
    cached: int
    tokens: list[int] = field(default_factory=list)
    pending: int | None = None  # the last sampled token, not yet in the cache


@dataclass
class _SlotState:
    tokens: list[int] = field(default_factory=list)  # ids whose KV the slot holds, in order
    session: Hashable | None = None


class Engine:
    """Continuous batching of `Request`s on `model` (see the module docstring).

    `slots`: sequences held at once; `max_len`: the longest context (default the model's
    max_position_embeddings); `prefill_tokens`: the padded size of one prefill forward at most
    (more waiting requests join at the next steps); `with_routing`: record MoE routing.

    `run` serves a list of requests (and, through `on_finish`, the follow-up requests of
    multi-turn conversations as each turn ends) and returns their completions in order of
    submission. The model is used as configured when `run` is called: enter `apply_numerics`
    around it for one emulated sampler, `apply_lane_numerics` for several (`Request.lane`)."""

    def __init__(self, model: torch.nn.Module, *, pad_id: int, eos_ids: Iterable[int],
                 slots: int = 64, max_len: int | None = None, kv_reuse: bool = True,
                 with_routing: bool = True, prefill_tokens: int = 32768) -> None:
        if slots < 1:
            raise ValueError(f"an engine needs at least one slot, got {slots}")
        self.model, self.pad_id, self.slots, self.kv_reuse = model, pad_id, slots, kv_reuse
        self.prefill_tokens = prefill_tokens  # padded prefill batch size at most (≥ 1 request)
        self.eos_ids = sorted(set(eos_ids))
        config = model.config
        limit = getattr(config, "max_position_embeddings", None)
        self.max_len = max_len or limit or 4096
        if limit is not None and self.max_len > limit:
            raise ValueError(f"max_len {self.max_len} exceeds the model's "
                             f"max_position_embeddings {limit}")
        self.routers = find_routers(model) if with_routing else []
        self.stats = EngineStats()
        self._cache: SlotCache | None = None
        self._routing: torch.Tensor | None = None  # [slots, capacity, L, k] experts per position
        self._out = SlotOutputs(slots)
        self._state = [_SlotState() for _ in range(slots)]
        self._sessions: OrderedDict[Hashable, int] = OrderedDict()  # session → slot, LRU first
        self._device = next(model.parameters()).device

    # ------------------------------------------------------------------ cache and slots

    def _ensure_cache(self, need: int) -> SlotCache:
        need = min(self.max_len, -(-need // _CAPACITY_STEP) * _CAPACITY_STEP)
        if self._cache is None:
            cfg = self.model.config
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            dtype = next(self.model.parameters()).dtype
            self._cache = SlotCache(cfg.num_hidden_layers, self.slots, kv_heads, head_dim, need,
                                    dtype, self._device)
        elif need > self._cache.capacity:
            self._cache.grow(need)
        return self._cache

    def _routing_table(self, capacity: int, k: int) -> torch.Tensor:
        """[slots, capacity, L, k] experts chosen at each slot's positions (grown as needed)."""
        table = self._routing
        if table is None or table.shape[1] < capacity:
            grown = torch.full((self.slots, capacity, len(self.routers), k), -1,
                               dtype=torch.long)
            if table is not None:
                grown[:, :table.shape[1]] = table
            self._routing = table = grown
        return table

    def release(self, session: Hashable) -> None:
        """Forget a session's cached KV (its slot becomes free)."""
        slot = self._sessions.pop(session, None)
        if slot is not None:
            self._state[slot] = _SlotState()

    def reset(self) -> None:
        """Forget every session (the model's weights changed, or a new batch of work)."""
        self._sessions.clear()
        self._state = [_SlotState() for _ in range(self.slots)]

    def _cached(self, request: Request, busy: set[int]) -> int:
        """Prompt tokens of `request` its session's idle slot holds (the longest common
        prefix, leaving at least one token to prefill); 0 without one."""
        slot = self._sessions.get(request.session) if request.session is not None else None
        if slot is None or slot in busy:
            return 0
        held, prompt = self._state[slot].tokens, request.prompt
        n, limit = 0, min(len(held), len(prompt) - 1)
        while n < limit and held[n] == prompt[n]:
            n += 1
        return n

    def _take_slot(self, request: Request, busy: set[int]) -> tuple[int, int] | None:
        """(slot, cached prompt tokens) for `request`, or None while every slot is busy."""
        slot = self._sessions.get(request.session) if request.session is not None else None
        if slot is not None and slot not in busy:
            self._sessions.move_to_end(request.session)
            return slot, self._cached(request, busy)
        pinned = set(self._sessions.values())
        free = [s for s in range(self.slots) if s not in busy and s not in pinned]
        if not free:
            idle = [(sess, s) for sess, s in self._sessions.items() if s not in busy]
            if not idle:
                return None
            sess, s = idle[0]  # least recently used idle session
            del self._sessions[sess]
            self.stats.evictions += 1
            free = [s]
        slot = free[0]
        self._state[slot] = _SlotState()
        if request.session is not None and self.kv_reuse:
            self._sessions.pop(request.session, None)
            self._sessions[request.session] = slot
            self._state[slot].session = request.session
        return slot, 0

    # ------------------------------------------------------------------ forward

    def _forward(self, rows: list[int], starts: list[int], inputs: list[list[int]],
                 lanes: list[int]) -> torch.Tensor:
        """One forward over the batch: rows' new tokens `inputs` at positions starts[i]… →
        [B, V] FP32 logits at each row's last new token, row i computed with the numerics of
        lane lanes[i] (lanes.py). Records routing per position. With KV reuse, rows of the same
        new prompt are computed once and the others' slots get a copy (prefix_sharing.py)."""
        shared = shared_rows(starts, inputs, lanes) if self.kv_reuse and len(rows) > 1 else None
        if shared is None:
            return self._compute(rows, starts, inputs, lanes)
        computed, source = shared
        logits = self._compute(*([a[i] for i in computed] for a in (rows, starts, inputs, lanes)))
        self.stats.shared_tokens += copy_shared(self._cache, self._routing, self._state, rows,
                                                inputs, computed, source)
        return logits[torch.tensor(source, device=logits.device)]

    def _compute(self, rows: list[int], starts: list[int], inputs: list[list[int]],
                 lanes: list[int]) -> torch.Tensor:
        """_forward's batch, every row computed."""
        dev = self._device
        b = len(rows)
        width = max(len(x) for x in inputs)
        if width == 1:  # a decode step: one token a row
            ids = torch.tensor(inputs, dtype=torch.long)
        else:
            ids = torch.full((b, width), self.pad_id, dtype=torch.long)
            for i, x in enumerate(inputs):
                ids[i, :len(x)] = torch.tensor(x, dtype=torch.long)
        counts = torch.tensor([len(x) for x in inputs], dtype=torch.long)
        start = torch.tensor(starts, dtype=torch.long)
        tk = max(s + len(x) for s, x in zip(starts, inputs))
        cache = self._ensure_cache(tk)
        row_t = torch.tensor(rows, dtype=torch.long)
        cache.plan(row_t.to(dev), start.to(dev), counts.to(dev), width, tk)
        pos = start[:, None] + torch.arange(width)[None, :]  # [B, width]
        keys = torch.arange(tk)
        allowed = keys[None, None, :] <= pos[:, :, None]  # causal, own slot only
        allowed = allowed[:, None]  # [B, 1, width, tk]
        sink: list[list[torch.Tensor]] = [[] for _ in self.routers]
        handles = []
        for i, router in enumerate(self.routers):
            def hook(_m, _inp, output, i=i):
                sink[i].append(output[-1].detach())
            handles.append(router.register_forward_hook(hook))
        try:
            with bf16_module_gemms(self.model), batch_lanes(lanes, dev):
                hidden = self.model.model(input_ids=ids.to(dev), attention_mask=allowed.to(dev),
                                          position_ids=pos.to(dev), past_key_values=cache,
                                          use_cache=True).last_hidden_state
                last = hidden[torch.arange(b, device=dev), (counts - 1).to(dev)]
                logits = self.model.get_output_embeddings()(last).float()
        finally:
            for h in handles:
                h.remove()
        if self.routers and all(len(s) == 1 for s in sink):
            chosen = torch.stack([s[0].view(b, width, -1) for s in sink], dim=2).cpu()
            b_idx, j_idx, slot_idx, pos_idx = cache.planned_positions()
            table = self._routing_table(cache.capacity, chosen.shape[-1])
            table[slot_idx.cpu(), pos_idx.cpu()] = chosen[b_idx.cpu(), j_idx.cpu()]
        for slot, s0, x in zip(rows, starts, inputs):
            st = self._state[slot]
            del st.tokens[s0:]
            st.tokens.extend(x)
        return logits

    # ------------------------------------------------------------------ serving

    @torch.no_grad()
    def run(self, requests: list[Request], *,
            on_finish: Callable[[Completion], Request | None] | None = None,
            progress: Callable[[int], None] | None = None) -> list[Completion]:
        """Serve `requests`; returns one completion per request, follow-ups included, in order of
        submission. `on_finish(completion)` may return the next request of the same
        conversation (served as soon as a slot allows, ahead of requests not yet started);
        returning None ends that conversation and releases its session. `progress(n)` is called
        with the number of tokens each step generated."""
        if not requests:
            return []
        order: list[Request] = list(requests)
        waiting: deque[Request] = deque(requests)
        done: dict[int, Completion] = {}
        running: dict[int, _Seq] = {}
        self._out.ensure(requests, self._vocab())
        full: dict[int, list[torch.Tensor]] = {}  # keep_full rows: their raw log-softmax rows
        t0 = time.perf_counter()
        while waiting or running:
            # the sequences already running decode this step, whatever joins beside them
            live = sorted(running.values(), key=lambda s: s.slot)
            admitted: list[_Seq] = []
            busy = set(running)
            while waiting:
                r = waiting[0]
                if len(r.prompt) >= self.max_len:
                    raise ValueError(f"a prompt of {len(r.prompt)} tokens leaves no room in the "
                                     f"engine's context of {self.max_len} positions")
                if admitted:  # bound one prefill forward's padded size
                    width = max(len(r.prompt) - self._cached(r, busy),
                                *(len(a.request.prompt) - a.cached for a in admitted))
                    if (len(admitted) + 1) * width > self.prefill_tokens:
                        break
                got = self._take_slot(r, busy)
                if got is None:
                    break
                waiting.popleft()
                slot, cached = got
                busy.add(slot)
                seq = _Seq(request=r, slot=slot, cached=cached)
                admitted.append(seq)
                if r.keep_full:
                    full[id(seq)] = []
            if admitted:  # prefill what each new request's cache does not hold yet
                inputs = [s.request.prompt[s.cached:] for s in admitted]
                logits = self._forward([s.slot for s in admitted], [s.cached for s in admitted],
                                       inputs, [s.request.lane for s in admitted])
                self.stats.prefill_tokens += sum(len(x) for x in inputs)
                self.stats.cached_tokens += sum(s.cached for s in admitted)
                self.stats.requests += len(admitted)
                self._sample(admitted, logits, full)
            if live:  # one decode step: each running sequence feeds its last token
                starts = [len(self._state[s.slot].tokens) for s in live]
                logits = self._forward([s.slot for s in live], starts,
                                       [[s.pending] for s in live],
                                       [s.request.lane for s in live])
                self._sample(live, logits, full)
            for s in admitted:
                running[s.slot] = s
            stepped = live + admitted
            self.stats.steps += 1
            self.stats.decode_tokens += len(stepped)
            if progress is not None:
                progress(len(stepped))
            for s in stepped:
                reason = self._finished(s)
                if reason is None:
                    continue
                del running[s.slot]
                comp = self._complete(s, reason, full.pop(id(s), None))
                done[id(s.request)] = comp
                follow = on_finish(comp) if on_finish is not None else None
                session = s.request.session
                if follow is not None:
                    self._out.ensure([follow], self._vocab())
                    order.append(follow)
                    waiting.appendleft(follow)
                elif on_finish is not None and session is not None:
                    self.release(session)  # the conversation ended
                if self._sessions.get(session) != s.slot:
                    self._state[s.slot] = _SlotState()  # nothing to keep: the slot is free
        self.stats.busy_s += time.perf_counter() - t0
        return [done[id(r)] for r in order]

    def _finished(self, s: _Seq) -> str | None:
        r = s.request
        last = s.tokens[-1]
        if last in self.eos_ids:
            return "eos"
        if r.forced is not None:
            if len(s.tokens) == len(r.forced):
                return "forced"
        elif len(s.tokens) >= r.params.max_new_tokens:
            return "length"
        if len(r.prompt) + len(s.tokens) >= self.max_len:
            return "context"
        return None

    def _vocab(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor, full: dict) -> None:
        """Draw (or force) each row's next token; write its log-probs and candidates into the
        slots' output buffers (one indexed write per buffer for the whole batch)."""
        raw = torch.log_softmax(logits, dim=-1)
        proc = process_rows(logits, [s.request.params for s in seqs], raw)
        tokens = next_tokens(proc, [s.request for s in seqs], [len(s.tokens) for s in seqs])
        tok_dev = tokens.to(raw.device)
        cand_lp, cand_ids = ranked_topk(raw, self._out.k)
        self._out.write(torch.tensor([s.slot for s in seqs]),
                        torch.tensor([len(s.tokens) for s in seqs]),
                        raw=raw.gather(-1, tok_dev[:, None])[:, 0].cpu(),
                        proc=proc.gather(-1, tok_dev[:, None])[:, 0].cpu(),
                        cid=cand_ids.cpu(), clp=cand_lp.cpu(),
                        sup=torch.isfinite(proc.gather(-1, cand_ids)).cpu())
        for i, (s, t) in enumerate(zip(seqs, tokens.tolist())):
            if full and id(s) in full:
                full[id(s)].append(raw[i].cpu())
            s.tokens.append(t)
            s.pending = t

    def _complete(self, s: _Seq, reason: str, full: list[torch.Tensor] | None) -> Completion:
        r, n = s.request, len(s.tokens)
        st = self._state[s.slot]
        routed = None
        table = self._routing
        if table is not None:
            total = len(r.prompt) + n
            routed = torch.full((total, *table.shape[2:]), -1, dtype=torch.long)
            have = min(len(st.tokens), total)  # the last token was never fed back
            routed[:have] = table[s.slot, :have]
        return Completion(
            request=r, tokens=list(s.tokens),
            **self._out.read(s.slot, n, min(r.params.candidates, self._out.k)),
            finish_reason=reason, cached_tokens=s.cached, routed_experts=routed,
            full_logprobs=torch.stack(full) if full else None)
