"""Lossless speculative decoding (Leviathan et al. 2023; Chen et al. 2023) with KV-cached target and draft.

    gen = SpeculativeGenerator(target, draft, gamma=5)
    out = gen.generate(prompt_ids, max_new_tokens=128, temperature=0.0)
    out.tokens, out.stats["tau"], out.stats["tokens_per_s"]

Each step the draft proposes up to γ tokens with its own cache, the target scores all of them plus one
bonus position in a single forward, tokens are accepted left to right, and both caches are cropped back
to the accepted length (no recomputation). Greedy output equals target-only greedy token for token;
sampled output follows the target's warped distribution exactly (temperature, top-k, top-p applied
identically to p and q).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from . import kernels
from .config import hidden_layers
from .losses import teacher_topk


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"bad sampling parameters {self}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _cut_to_nucleus(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest prefix of descending ``sorted_probs`` whose mass reaches ``top_p``.

    The token that crosses ``top_p`` stays. The one top-p rule of ``warp`` and ``nucleus``, so the target's
    and the draft's warped distributions cannot drift apart.
    """
    return sorted_probs.masked_fill(sorted_probs.cumsum(-1) - sorted_probs >= top_p, 0.0)


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (the same function for target and draft)."""
    logits = logits.float() / max(params.temperature, 1e-8)
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        probs = torch.zeros_like(probs).scatter(-1, order, _cut_to_nucleus(sorted_probs, params.top_p))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def verify(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
           generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative sampling's accept/resample rule for one block.

    target_probs (γ+1, V), draft_probs (γ, V), draft_tokens (γ,). Returns (accepted count n, next token):
    the first n drafts are kept and ``next`` is the residual sample norm(max(0, p−q)) at the first
    rejection, or a sample from p at the bonus position when all γ are accepted.
    """
    gamma = draft_tokens.shape[0]
    for i in range(gamma):
        token = int(draft_tokens[i])
        p, q = target_probs[i, token], draft_probs[i, token]
        u = torch.rand((), generator=generator)
        if q > 0 and u * q <= p:
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp(min=0)
        if residual.sum() <= 0:  # p == q up to rounding: sample p itself
            residual = target_probs[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return gamma, int(torch.multinomial(target_probs[gamma], 1, generator=generator))


NUCLEUS_CANDIDATES = 256


def nucleus(logits: torch.Tensor, params: SamplingParams, candidates: int = NUCLEUS_CANDIDATES,
            top: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``warp`` for a batch (B, V) without its full-vocabulary sort: (token ids, probabilities), each (B, K).

    Top-p keeps few tokens, so the nucleus is searched among each row's top ``candidates`` logits
    (probabilities from the full row's logsumexp); only the rows whose candidates hold less than ``top_p`` of
    the mass are sorted in full. Rows shorter than K are padded with probability 0. The distribution is
    ``warp``'s, exactly. ``top``: the rows' top (values, ids) of the unscaled fp32 logits, at least
    ``candidates`` wide, when the caller has them already (data generation's teacher top-k): one top-k pass
    over the vocabulary instead of two, ≈ 10 ms of a 90-row step.
    """
    logits = logits.float() / max(params.temperature, 1e-8)
    vocab = logits.shape[-1]
    if params.top_k:
        logits, ids = logits.topk(min(params.top_k, vocab), dim=-1)  # sorted, so already the candidates
        top = None
    else:
        ids = torch.arange(vocab).expand_as(logits)
    if params.top_p >= 1.0:
        return ids, torch.softmax(logits, dim=-1)
    log_total = logits.logsumexp(-1, keepdim=True)
    wanted = min(candidates, logits.shape[-1])
    if top is not None and top[0].shape[-1] >= wanted:
        # Dividing by T > 0 keeps the order, and the same division of the same value gives the same float.
        values, order = top[0][:, :wanted] / max(params.temperature, 1e-8), top[1][:, :wanted]
    else:
        values, order = logits.topk(wanted, dim=-1)
    probs = (values - log_total).exp()
    short = probs.sum(-1) < params.top_p
    if bool(short.any()):
        full_values, full_order = logits[short].sort(dim=-1, descending=True)
        full_probs = (full_values - log_total[short]).exp()
        # Only as wide as the widest short row's nucleus (the tail would be cut to 0), not the vocabulary: one
        # flat row among 128 would otherwise widen every row's cut, cumsum and gather to 49k columns.
        wide = max(probs.shape[-1], int((full_probs.cumsum(-1) - full_probs < params.top_p).sum(-1).max()))
        pad = wide - probs.shape[-1]
        probs = torch.nn.functional.pad(probs, (0, pad))
        order = torch.nn.functional.pad(order, (0, pad))
        probs[short] = full_probs[:, :wide]
        order[short] = full_order[:, :wide]
    probs = _cut_to_nucleus(probs, params.top_p)
    return ids.gather(-1, order), probs / probs.sum(-1, keepdim=True)


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | list[torch.Generator] | None = None,
                  top: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[int]:
    """One next token per row of ``logits`` (B, V): argmax when greedy, else a draw from the warped distribution.

    Draws by inverting the CDF with one uniform per row: ``torch.multinomial`` spends an exponential draw on
    every vocabulary entry. ``generator`` may be a list, one per row, so a row's draws do not depend on which
    other rows share its batch. ``top``: as ``nucleus``'s.
    """
    if params.greedy:
        return logits.argmax(-1).tolist()
    ids, probs = nucleus(logits, params, top=top)
    cdf = probs.cumsum(-1)
    if isinstance(generator, list):
        u = torch.cat([torch.rand(1, 1, generator=g) for g in generator])
    else:
        u = torch.rand(cdf.shape[0], 1, generator=generator)
    u = u * cdf[:, -1:]
    picks = torch.searchsorted(cdf, u, right=True).clamp(max=cdf.shape[-1] - 1)
    return ids.gather(-1, picks).squeeze(-1).tolist()


@dataclass
class GenerationOutput:
    tokens: list[int]
    stats: dict = field(default_factory=dict)
    # With ``record_top_k``: per new token, the target's top-k (ids, log-probs at T=1) of the logits it came from.
    teacher: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # With ``record_prompt``: the same at prompt positions 0..P-2 (each predicting the next prompt token).
    prompt_teacher: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # With ``record_hidden_layer``: per new token, the target's residual stream after that many layers (each
    # layer's, side by side) at the position whose logits sampled it (the teacher of ``train.hidden_weight``).
    hidden: list[torch.Tensor] = field(default_factory=list)


def cache_kwarg(model) -> str:
    """transformers renamed ``past_key_values`` to ``cache``; use whichever this version's forward takes."""
    forward = getattr(model, "inner", model).forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` with spare slots: ``keys``/``values`` are views of a larger buffer, so appending a token
    writes it in place. ``DynamicLayer`` copies the whole cache (``torch.cat``) on every step: a third of a
    128-row decode step on a 2-core CPU. A crop shrinks the view; anything that replaces ``keys`` with a new
    tensor (a gather, an index) is adopted into a fresh buffer on the next append."""

    HEADROOM = 64  # spare slots per growth, at least (else a quarter of the length)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.key_buffer = self.value_buffer = None

    @staticmethod
    def _is_prefix_of(view: torch.Tensor, buffer: torch.Tensor | None) -> bool:
        return (buffer is not None and view.data_ptr() == buffer.data_ptr() and view.stride() == buffer.stride()
                and view.shape[:2] == buffer.shape[:2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if not (self._is_prefix_of(self.keys, self.key_buffer) and self._is_prefix_of(self.values, self.value_buffer)
                and end <= self.key_buffer.shape[-2]):
            capacity = end + max(self.HEADROOM, end // 4)
            self.key_buffer = self._adopt(self.keys, key_states, capacity)
            self.value_buffer = self._adopt(self.values, value_states, capacity)
        self.key_buffer[:, :, length:end] = key_states
        self.value_buffer[:, :, length:end] = value_states
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values

    @staticmethod
    def _adopt(old: torch.Tensor, new_states: torch.Tensor, capacity: int) -> torch.Tensor:
        batch, heads, _, dim = new_states.shape
        buffer = new_states.new_empty(batch, heads, capacity, dim)
        if old.numel():
            buffer[:, :, : old.shape[-2]] = old
        return buffer

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() and self._is_prefix_of(self.keys, self.key_buffer):
            length = self.keys.shape[-2]
            self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
            self.keys, self.values = self.key_buffer[:, :, :length], self.value_buffer[:, :, :length]
        else:
            super().batch_select_indices(indices)


def growing_cache(config) -> DynamicCache:
    """A ``DynamicCache`` whose full-attention layers append in place (``GrowingLayer``)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class _CachedModel:
    """A model, its KV cache for a batch of rows, and which cache slots each row may attend to.

    Rows advance by different amounts per step. A row's rejected slots stay in the cache as holes that the
    attention mask hides (RoPE positions come from ``lengths``, not from slot indices); slots no row needs
    are cropped off the end, and holes are squeezed out once they fill half the cache. With one row there
    are never holes, so no mask is built and the forward is the plain cached one.

    ``row_invariant`` (the target's cache, never the draft's): a bf16 forward of several tokens gives each
    position bit for bit the logits of one-token steps (``kernels``), so bf16 greedy decoding is lossless.
    """

    def __init__(self, model, batch: int = 1, row_invariant: bool = False):
        self.model = kernels.prepare(model, row_invariant)
        self.row_invariant = row_invariant
        self.cache = growing_cache(model.config)
        self.cache_kwarg = cache_kwarg(model)
        forward = getattr(model, "inner", model).forward
        self.keeps_logits = "logits_to_keep" in inspect.signature(forward).parameters
        self.valid = torch.zeros(batch, 0, dtype=torch.bool)
        self.lengths = [0] * batch  # context tokens per row = the next RoPE position
        self.compact_above = 32  # slots; below this, holes cost less than moving the cache
        # Compact once the cache is this many slots wider than its longest row (None: twice as wide). A pool that
        # rows keep joining and leaving sets it, as each step's attention reads every slot, holes included.
        self.max_spare_slots: int | None = None
        self.compactions = 0

    @torch.no_grad()  # not inference_mode: the slot mask is edited in place between forwards
    def feed(self, rows: list[list[int]], last_only: bool = False) -> list[torch.Tensor] | torch.Tensor:
        """Append each row's tokens (rows may differ in length, even be empty); per-row logits (len_b, V).

        ``last_only``: every row is non-empty and only its last position's logits are wanted, returned as one
        (B, V) tensor; the LM head then runs on B positions instead of B × width (a 64-prompt prefill).
        """
        width = max(len(r) for r in rows)
        if width == 0:
            return [torch.empty(0) for _ in rows]
        batch = len(rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)
        offsets = torch.arange(width)
        positions = torch.tensor(self.lengths).unsqueeze(1) + offsets
        fed = offsets.unsqueeze(0) < torch.tensor([len(r) for r in rows]).unsqueeze(1)
        # Padding slots are visible during this forward (only to later padding, by causality) so no query row
        # is fully masked — a fully masked row gives NaN keys/values that would poison later attention.
        visible = torch.cat([self.valid, torch.ones(batch, width, dtype=torch.bool)], dim=1)
        mask = None if bool(visible.all()) else visible.long()
        extra = {}
        if last_only:
            if min(len(r) for r in rows) == 0:
                raise ValueError("last_only needs a token in every row")
            if self.keeps_logits:
                # Per-row positions (B, 1): a contiguous gather, so the head is one plain matmul.
                extra["logits_to_keep"] = torch.tensor([[len(r) - 1] for r in rows], device=self.model.device)
        with kernels.small_batch_kernels(self.row_invariant):
            out = self.model(input_ids=ids.to(self.model.device), attention_mask=mask,
                             position_ids=positions.to(self.model.device), use_cache=True,
                             **{self.cache_kwarg: self.cache}, **extra)
        self.valid = torch.cat([self.valid, fed], dim=1)
        self.lengths = [n + len(r) for n, r in zip(self.lengths, rows)]
        if last_only:
            if extra:
                return out.logits[:, -1]
            return torch.stack([out.logits[b, len(r) - 1] for b, r in enumerate(rows)])
        return [out.logits[b, : len(r)] for b, r in enumerate(rows)]

    def keep(self, row: int, length: int) -> None:
        """Roll ``row`` back to its first ``length`` context tokens."""
        if length >= self.lengths[row]:
            return
        slots = self.valid[row].nonzero().squeeze(1)
        self.valid[row, slots[length:]] = False
        self.lengths[row] = length

    def _trim(self) -> None:
        used = self.valid.any(0).nonzero()
        tail = self.valid.shape[1] - (int(used[-1]) + 1 if used.numel() else 0)
        if tail:
            self.cache.crop(-tail)  # transformers ≥ 5.2x takes the number of slots to drop, negated
            self.valid = self.valid[:, : self.valid.shape[1] - tail]
        size, longest = self.valid.shape[1], max(self.lengths)
        spare = longest if self.max_spare_slots is None else self.max_spare_slots
        if size > self.compact_above and size - longest > spare:
            self._compact()

    def _compact(self) -> None:
        # Move each row's valid slots to the right end (stable, so their order is kept), then drop the
        # leading columns that are holes in every row.
        order = torch.sort(self.valid.long(), dim=1, stable=True).indices
        drop = self.valid.shape[1] - max(self.lengths)
        order = order[:, drop:]
        for layer in self.cache.layers:
            index = order.to(layer.keys.device)[:, None, :, None]
            layer.keys = layer.keys.gather(2, index.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
            layer.values = layer.values.gather(2, index.expand(-1, layer.values.shape[1], -1,
                                                               layer.values.shape[3]))
        self.valid = self.valid.gather(1, order)
        self.compactions += 1

    def right_align(self) -> None:
        """Move each row's slots to the cache's right end (a prefill of unequal prompts leaves holes after the
        short ones). Appending keeps rows right-aligned, so each row's slots then run from its first to the last:
        what lets ``kernels.pool_attention`` skip a chunk of rows' leading holes."""
        if not bool(self.valid.all()):
            self._compact()

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (finished ones leave the batch)."""
        self.cache.batch_select_indices(torch.tensor(rows, device=self.model.device))
        self.valid = self.valid[rows]
        self.lengths = [self.lengths[r] for r in rows]
        self._trim()

    def absorb(self, other: _CachedModel) -> None:
        """Append ``other``'s rows (prefilled in their own cache) after this batch's rows.

        The narrower cache is padded on the left with holes, so both end at the same slot; slot order carries no
        meaning (RoPE positions come from ``lengths``), only the mask does.
        """
        width = max(self.valid.shape[1], other.valid.shape[1])

        def left_pad(t: torch.Tensor, dim: int, value=0) -> torch.Tensor:
            missing = width - t.shape[dim]
            if not missing:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_full(shape, value), t], dim=dim)

        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([left_pad(mine.keys, 2), left_pad(theirs.keys, 2)])
            mine.values = torch.cat([left_pad(mine.values, 2), left_pad(theirs.values, 2)])
        self.valid = torch.cat([left_pad(self.valid, 1, False), left_pad(other.valid, 1, False)])
        self.lengths = self.lengths + other.lengths


def _stop_rule(prompts: list[list[int]], eos_token_id, stop_sequences) -> tuple[set[int], list[list[int]]]:
    """Check the prompts and normalise what ends a row: the EOS id(s) and non-empty stop sequences."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    return eos, [list(s) for s in stop_sequences or [] if s]


def _finish(generated: list[int], new: list[int], eos: set[int], stops: list[list[int]], budget: int
            ) -> tuple[list[int], bool]:
    """Cut ``new`` at the first EOS, completed stop sequence or the token budget; also say if the row is done.

    Stop sequences are matched on generated tokens only (never the prompt), token by token, so speculative and
    target-only decoding stop at the same token.
    """
    # Only the last tokens can complete a stop sequence: never copy the whole generated row per token.
    recent = generated[-max(map(len, stops)):] if stops else []
    for j, token in enumerate(new[:budget]):
        if token in eos:
            return new[: j + 1], True
        if stops:
            tail = recent + new[: j + 1]
            if any(len(tail) >= len(stop) and tail[-len(stop):] == stop for stop in stops):
                return new[: j + 1], True
    new = new[:budget]
    return new, len(new) == budget


class SpeculativeGenerator:
    """Target + draft pair; ``gamma`` fixed, ``schedule="heuristic"`` (HF's ±) or ``confidence`` stop."""

    def __init__(self, target, draft, gamma: int = 5, schedule: str = "fixed", confidence: float = 0.4,
                 max_gamma: int = 12):
        if target.config.vocab_size != draft.config.vocab_size:
            raise ValueError(f"vocab size mismatch: target {target.config.vocab_size}, draft {draft.config.vocab_size}")
        if schedule not in ("fixed", "heuristic", "confidence"):
            raise ValueError("schedule must be fixed, heuristic or confidence")
        if gamma < 1:
            raise ValueError("gamma must be >= 1")
        self.target, self.draft = target.eval(), draft.eval()
        self.gamma, self.schedule, self.confidence, self.max_gamma = gamma, schedule, confidence, max_gamma

    def stream_batch(self, prompts: list[list[int]], max_new_tokens: int = 128, eos_token_id=None,
                     params: SamplingParams | None = None, seed: int | None = None,
                     stats: list[dict] | None = None, stop_sequences: list[list[int]] | None = None
                     ) -> Iterator[list[list[int]]]:
        """Decode several prompts together; yield each row's newly accepted tokens (maybe none) per step.

        Every row keeps its own accepted count, draft length and stop; finished rows leave the batch.
        ``stats`` (one dict per row, if given) is filled as it runs. Generation of a row ends at EOS, at the end
        of any of ``stop_sequences`` (token ids) or after ``max_new_tokens``, exactly where target-only would.
        """
        params = params or SamplingParams()
        eos, stops = _stop_rule(prompts, eos_token_id, stop_sequences)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        batch = len(prompts)
        stats = stats if stats is not None else [{} for _ in prompts]
        stats.extend({} for _ in range(batch - len(stats)))
        for s in stats:
            s.update(accepted=[], drafted=[], target_calls=0, draft_calls=0)
        tokens = [list(p) for p in prompts]
        produced, gammas = [0] * batch, [self.gamma] * batch
        active = list(range(batch))  # original row index of each batch slot
        target, draft = _CachedModel(self.target, batch, row_invariant=True), _CachedModel(self.draft, batch)
        start = time.perf_counter()

        def emit(s: int, r: int, new: list[int], emitted: list[list[int]], still: list[int]) -> None:
            """Row ``r`` (batch slot ``s``) gets ``new``, cut at its stop; it stays in ``still`` unless done."""
            new, done = _finish(tokens[r][len(prompts[r]):], new, eos, stops, max_new_tokens - produced[r])
            tokens[r] += new
            produced[r] += len(new)
            emitted[r] = new
            if "ttft_s" not in stats[r]:
                stats[r]["ttft_s"] = time.perf_counter() - start
            if done:
                seconds = time.perf_counter() - start
                stats[r].update(new_tokens=produced[r], seconds=seconds, tokens_per_s=produced[r] / seconds,
                                tau=produced[r] / max(stats[r]["target_calls"], 1))
            else:
                still.append(s)

        def leave(still: list[int]) -> None:
            nonlocal active
            if not still:
                active = []
            elif len(still) < len(active):
                target.select(still)
                draft.select(still)
                active = [active[s] for s in still]
            else:
                target._trim()

        # The target's prefill takes the whole prompt and emits the first token, as target-only decoding does:
        # the same forward, so in bf16 too the first token and the prompt's cache are target-only's bit for bit
        # (``kernels``' row-invariance covers the verify forwards after it). The draft catches up on its own.
        draft.feed([t[:-1] for t in tokens])
        first = sample_tokens(target.feed([list(t) for t in tokens], last_only=True), params, generator)
        emitted, still = [[] for _ in range(batch)], []
        for s, r in enumerate(active):
            stats[r]["target_calls"] += 1
            emit(s, r, [first[s]], emitted, still)
        leave(still)
        yield emitted
        while active:
            blocks = [min(gammas[r], max(max_new_tokens - produced[r] - 1, 0)) for r in active]
            for slot, r in enumerate(active):
                draft.keep(slot, min(draft.lengths[slot], len(tokens[r]) - 1))
            draft._trim()
            pending = [tokens[r][draft.lengths[slot]:] for slot, r in enumerate(active)]
            proposals = [[] for _ in active]
            q_rows = [[] for _ in active]
            proposing = [block > 0 for block in blocks]
            for i in range(max(blocks)):
                rows = [pending[s] if proposing[s] and i < blocks[s] else [] for s in range(len(active))]
                if not any(rows):
                    break
                logits = draft.feed(rows)
                for s, r in enumerate(active):
                    if not rows[s]:
                        proposing[s] = False
                        continue
                    last = logits[s][-1]
                    stats[r]["draft_calls"] += 1
                    if params.greedy:
                        token = int(last.argmax())
                        confident = (torch.softmax(last.float(), -1).max() if self.schedule == "confidence"
                                     else 1.0)
                    else:
                        q = warp(last, params)
                        token = int(torch.multinomial(q, 1, generator=generator))
                        q_rows[s].append(q)
                        confident = q.max() if self.schedule == "confidence" else 1.0
                    proposals[s].append(token)
                    pending[s] = [token]
                    if self.schedule == "confidence" and confident < self.confidence:
                        proposing[s] = False
            logits = target.feed([[tokens[r][-1]] + proposals[s] for s, r in enumerate(active)])
            emitted, still = [[] for _ in range(batch)], []
            for s, r in enumerate(active):
                proposal = proposals[s]
                stats[r]["target_calls"] += 1
                if params.greedy:
                    choice = logits[s].argmax(-1).tolist()
                    n = 0
                    while n < len(proposal) and proposal[n] == choice[n]:
                        n += 1
                    new = proposal[:n] + [choice[n]]
                else:
                    p = warp(logits[s], params)
                    q = torch.stack(q_rows[s]) if q_rows[s] else p.new_zeros((0, p.shape[-1]))
                    n, nxt = verify(p, q, torch.tensor(proposal, dtype=torch.long), generator)
                    new = proposal[:n] + [nxt]
                # The target cache keeps the context through the accepted drafts; the new last token is fed next.
                target.keep(s, len(tokens[r]) + n)
                stats[r]["accepted"].append(n)
                stats[r]["drafted"].append(len(proposal))
                if self.schedule == "heuristic":  # HF assisted generation's schedule
                    gammas[r] = min(self.max_gamma, gammas[r] + 2) if n == len(proposal) else max(1, gammas[r] - 1)
                emit(s, r, new, emitted, still)
            leave(still)
            yield emitted

    def stream(self, prompt_ids: list[int], max_new_tokens: int = 128, eos_token_id: int | list[int] | None = None,
               params: SamplingParams | None = None, seed: int | None = None, stats: dict | None = None,
               stop_sequences: list[list[int]] | None = None) -> Iterator[list[int]]:
        """Yield the newly accepted tokens of every step; ``stats`` (if given) is filled as it runs."""
        stats = stats if stats is not None else {}
        for emitted in self.stream_batch([list(prompt_ids)], max_new_tokens, eos_token_id, params, seed, [stats],
                                         stop_sequences):
            yield emitted[0]

    def generate(self, prompt_ids: list[int], max_new_tokens: int = 128, eos_token_id=None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop_sequences: list[list[int]] | None = None) -> GenerationOutput:
        return self.generate_batch([prompt_ids], max_new_tokens, eos_token_id, temperature, top_k, top_p, seed,
                                   stop_sequences)[0]

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int = 128, eos_token_id=None,
                       temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                       stop_sequences: list[list[int]] | None = None) -> list[GenerationOutput]:
        stats: list[dict] = [{} for _ in prompts]
        tokens: list[list[int]] = [[] for _ in prompts]
        for emitted in self.stream_batch(prompts, max_new_tokens, eos_token_id,
                                         SamplingParams(temperature, top_k, top_p), seed, stats, stop_sequences):
            for row, new in zip(tokens, emitted):
                row += new
        return [GenerationOutput(t, s) for t, s in zip(tokens, stats)]


def target_only_generate_batch(target, prompts: list[list[int]], max_new_tokens: int = 128, eos_token_id=None,
                               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                               seed: int | None = None, stop_sequences: list[list[int]] | None = None,
                               record_top_k: int = 0, record_prompt: bool = False) -> list[GenerationOutput]:
    """The fair baseline: the same model, dtype, cache, batching and sampling code, one target call per token.

    One batch of ``target_generate_stream`` (the data generator's loop): finished rows leave the batch.
    ``record_top_k`` keeps the target's top-k log-probs behind every new token: the distillation teacher at
    those positions, already paid for by the generation forward. ``record_prompt`` also keeps them at the
    prompt's positions 0..P-2 (predicting prompt tokens 1..P-1) in ``prompt_teacher``: the prefill forward is
    paid for too, and only its LM head runs on more positions (≈ ⅕ of a generated token's cost).
    """
    [(_, outputs)] = target_generate_stream(
        target, [(0, prompts)], max(1, len(prompts)), max_new_tokens, eos_token_id, temperature, top_k, top_p,
        seed, stop_sequences, record_top_k=record_top_k, record_prompt=record_prompt)
    return outputs


POOL_SPARE_SLOTS = 64  # holes a pool's cache may hold beyond its longest row before it is compacted
POOL_ATTENTION_CHUNK = 16  # rows per attention call in a pool's decode step (kernels.pool_attention)


def target_generate_stream(target, batches: Iterable[tuple[int, list[list[int]]]], max_active_rows: int,
                           max_new_tokens: int = 128, eos_token_id=None, temperature: float = 0.0,
                           top_k: int = 0, top_p: float = 1.0, seed: int | None = 0,
                           stop_sequences: list[list[int]] | None = None, record_top_k: int = 0,
                           record_prompt: bool = False, record_hidden_layer: int | list[int] = 0
                           ) -> Iterator[tuple[int, list[GenerationOutput]]]:
    """``target_only_generate_batch`` over a stream of prompt batches, decoding up to ``max_active_rows`` rows
    together: yields ``(index, outputs)`` as each batch's last row finishes.

    Rows leave at EOS and the next batch is pulled from ``batches`` once a batch as large as the largest so far
    fits (only then, so a producer that stops on a time budget starts nothing after it); it is prefilled in its
    own cache and joins the running one (``_CachedModel.absorb``). A 2-core CPU's matmuls run ≈ 2× faster per row at 128 rows than at 32
    (``scripts/bench_generate.py``), and a fixed batch shrinks as its rows finish. Row ``r`` of batch
    ``index`` samples with its own generator, seeded from ``(seed, index, r)``: what it draws does not depend
    on the rows it shares the pool with, only float rounding of the batch shape can differ (``seed=None``: the
    global RNG). Per-row stats: ``ttft_s`` and ``seconds`` count from the row's batch being pulled.
    ``record_hidden_layer`` > 0 keeps, per new token, the output of decoder layer ``record_hidden_layer`` (1-based)
    at the position that sampled it, read by a forward hook on the very forwards that decode; a list keeps each
    layer's, concatenated in its order. The last layer is read after the final norm, as the LM head sees it (and
    as ``output_hidden_states`` reports it).
    """
    params = SamplingParams(temperature, top_k, top_p)
    if record_prompt and not record_top_k:
        raise ValueError("record_prompt needs record_top_k > 0")
    body = getattr(target, target.base_model_prefix)
    wanted = hidden_layers(record_hidden_layer)
    if not all(1 <= layer <= len(body.layers) for layer in wanted):
        raise ValueError(f"record_hidden_layer={record_hidden_layer}: the target has {len(body.layers)} decoder layers")
    if wanted and record_prompt:
        raise ValueError("record_hidden_layer records reply positions only: not with record_prompt")
    if len(body.layers) in wanted and not isinstance(getattr(body, "norm", None), torch.nn.Module):
        raise ValueError(f"record_hidden_layer={record_hidden_layer}: the last layer is read after the final norm, "
                         f"and this target has no `norm` module: ask for an earlier layer")
    captured: dict[int, torch.Tensor] = {}  # hook slot -> that layer's output in the last forward
    hooks = []
    for slot, layer in enumerate(wanted):
        module = body.norm if layer == len(body.layers) else body.layers[layer - 1]
        hooks.append(module.register_forward_hook(
            lambda _module, _args, output, slot=slot: captured.__setitem__(
                slot, output[0] if isinstance(output, tuple) else output)))
    try:
        yield from _generate_stream(target, batches, max_active_rows, max_new_tokens, eos_token_id, params, seed,
                                    stop_sequences, record_top_k, record_prompt, captured if hooks else None)
    finally:
        for hook in hooks:
            hook.remove()


def _hooked_state(captured: dict[int, torch.Tensor]) -> torch.Tensor:
    """The hooked layers' states of the last forward, side by side in the order asked for."""
    return captured[0] if len(captured) == 1 else torch.cat([captured[i] for i in range(len(captured))], dim=-1)


def _generate_stream(target, batches, max_active_rows, max_new_tokens, eos_token_id, params, seed, stop_sequences,
                     record_top_k, record_prompt, captured):
    """``target_generate_stream``'s loop; ``captured`` (or None) is where the hidden-state hook writes."""
    if max_active_rows < 1:
        raise ValueError("max_active_rows must be >= 1")
    source = iter(batches)
    widest = 0  # rows in the largest batch so far: a batch is pulled only when one that size would fit
    pool: _CachedModel | None = None
    last: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None  # with ``captured``: the hooked layer's state behind ``last``
    rows: list[tuple[int, int]] = []  # (batch index, row in batch) per pool row
    generators: list[torch.Generator | None] = []
    started: dict[int, float] = {}
    outputs: dict[int, list[GenerationOutput]] = {}
    unfinished: dict[int, int] = {}
    eos = set()
    stops: list[list[int]] = []
    exhausted = False
    while True:
        # Pulled only when it can start now, so a producer that stops on a time budget starts nothing after it.
        while not exhausted and (not rows or len(rows) + widest <= max_active_rows):
            pulled = next(source, None)
            if pulled is None:
                exhausted = True
                break
            index, prompts = pulled
            started[index] = time.perf_counter()
            widest = max(widest, len(prompts))
            eos, stops = _stop_rule(prompts, eos_token_id, stop_sequences)
            joining = _CachedModel(target.eval(), len(prompts), row_invariant=True)
            outputs[index] = [GenerationOutput([], {"target_calls": 0, "tau": 1.0}) for _ in prompts]
            unfinished[index] = len(prompts)
            if record_prompt:
                first = _prefill_recording(joining, prompts, record_top_k, outputs[index])
            else:
                first = joining.feed([list(p) for p in prompts], last_only=True)
            if captured is not None:  # each prompt's last position (rows are right-padded in the prefill)
                state = _hooked_state(captured)
                first_hidden = torch.stack([state[b, len(p) - 1] for b, p in enumerate(prompts)])
            joining.right_align()
            if pool is None:
                pool, last = joining, first
                pool.max_spare_slots, pool.compact_above = POOL_SPARE_SLOTS, 0
                last_hidden = first_hidden if captured is not None else None
            else:
                pool.absorb(joining)
                last = torch.cat([last, first])
                if captured is not None:
                    last_hidden = torch.cat([last_hidden, first_hidden])
            rows += [(index, r) for r in range(len(prompts))]
            generators += [None if seed is None else torch.Generator().manual_seed(
                (seed * 1_000_003 + index) * 65_537 + r) for r in range(len(prompts))]
        if not rows:
            return
        top = None
        if record_top_k:
            # One top-k pass serves the stored teacher (T=1 log-probs) and, when the sampler searches a top-p
            # nucleus, its candidates; greedy or top-k sampling needs no more than the teacher's k.
            scores = last.float()
            wide = NUCLEUS_CANDIDATES if not (params.greedy or params.top_k or params.top_p >= 1.0) else 0
            top = scores.topk(min(max(record_top_k, wide), scores.shape[-1]), dim=-1)
            top_ids = top.indices[:, :record_top_k].contiguous()  # rows are kept: not views of the wider top
            top_logp = top.values[:, :record_top_k] - scores.logsumexp(-1, keepdim=True)
            for s, (index, r) in enumerate(rows):
                outputs[index][r].teacher.append((top_ids[s], top_logp[s]))
        if captured is not None:
            for s, (index, r) in enumerate(rows):
                outputs[index][r].hidden.append(last_hidden[s].clone())
        feed, still = [], []
        tokens = sample_tokens(last, params, None if seed is None else generators, top=top)
        for s, ((index, r), token) in enumerate(zip(rows, tokens)):
            out = outputs[index][r]
            _, done = _finish(out.tokens, [token], eos, stops, max_new_tokens - len(out.tokens))
            out.tokens.append(token)
            out.stats["target_calls"] += 1
            out.stats.setdefault("ttft_s", time.perf_counter() - started[index])
            if done:
                seconds = time.perf_counter() - started[index]
                out.stats.update(new_tokens=len(out.tokens), seconds=seconds, tokens_per_s=len(out.tokens) / seconds)
                unfinished[index] -= 1
                if not unfinished[index]:
                    del unfinished[index], started[index]
                    yield index, outputs.pop(index)
            else:
                still.append(s)
                feed.append([token])
        if len(still) < len(rows):
            rows = [rows[s] for s in still]
            generators = [generators[s] for s in still]
            if not rows:
                pool, last = None, None
                continue
            pool.select(still)
        with kernels.pool_attention(POOL_ATTENTION_CHUNK):
            last = pool.feed(feed, last_only=True)
        if captured is not None:
            last_hidden = _hooked_state(captured)[:, 0]  # one new token per row


PREFILL_CHUNK = 64  # positions per prefill forward when prompt logits are kept: B × 64 × V floats at most


def _prefill_recording(model: _CachedModel, prompts: list[list[int]], top_k: int, outputs: list[GenerationOutput]
                       ) -> torch.Tensor:
    """Prefill in chunks of ``PREFILL_CHUNK`` positions (full-vocabulary logits for the whole prompt batch would
    take GBs), keeping each prompt position's top-k; returns the last position's logits (B, V), as
    ``feed(last_only=True)`` would."""
    last = [None] * len(prompts)
    for offset in range(0, max(map(len, prompts)), PREFILL_CHUNK):
        logits = model.feed([list(p[offset: offset + PREFILL_CHUNK]) for p in prompts])
        for r, (prompt, row_logits) in enumerate(zip(prompts, logits)):
            if not row_logits.shape[0]:
                continue
            if offset + row_logits.shape[0] == len(prompt):
                last[r] = row_logits[-1]
                row_logits = row_logits[:-1]  # the reply's first teacher entry: recorded with the reply
            if row_logits.shape[0]:
                ids, logp = teacher_topk(row_logits, top_k)
                outputs[r].prompt_teacher += list(zip(ids, logp))
    return torch.stack(last)


def target_only_generate(target, prompt_ids: list[int], max_new_tokens: int = 128, eos_token_id=None,
                         temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                         stop_sequences: list[list[int]] | None = None) -> GenerationOutput:
    return target_only_generate_batch(target, [list(prompt_ids)], max_new_tokens, eos_token_id, temperature,
                                      top_k, top_p, seed, stop_sequences)[0]
