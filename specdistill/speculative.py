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

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


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


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (the same function for target and draft)."""
    logits = logits.float() / max(params.temperature, 1e-8)
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
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


@dataclass
class GenerationOutput:
    tokens: list[int]
    stats: dict = field(default_factory=dict)


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def cache_kwarg(model) -> str:
    """transformers renamed ``past_key_values`` to ``cache``; use whichever this version's forward takes."""
    import inspect

    forward = getattr(model, "inner", model).forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


class _CachedModel:
    """A model plus its KV cache and the number of tokens that cache holds."""

    def __init__(self, model):
        self.model = model
        self.cache = _new_cache(model)
        self.length = 0
        self.cache_kwarg = cache_kwarg(model)

    @torch.inference_mode()
    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Run ``tokens`` on top of the cache; logits (len, V) for each fed position."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.model.device)
        out = self.model(input_ids=ids, use_cache=True, **{self.cache_kwarg: self.cache})
        self.length += len(tokens)
        return out.logits[0]

    def crop(self, length: int) -> None:
        if length < self.length:
            self.cache.crop(length - self.length)  # transformers ≥ 5.2x takes the number to drop, negated
            self.length = length


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

    def stream(self, prompt_ids: list[int], max_new_tokens: int = 128, eos_token_id: int | list[int] | None = None,
               params: SamplingParams | None = None, seed: int | None = None, stats: dict | None = None
               ) -> Iterator[list[int]]:
        """Yield the newly accepted tokens of every step; ``stats`` (if given) is filled as it runs."""
        params = params or SamplingParams()
        eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        stats = stats if stats is not None else {}
        stats.update(accepted=[], drafted=[], target_calls=0, draft_calls=0)
        target, draft = _CachedModel(self.target), _CachedModel(self.draft)
        tokens = list(prompt_ids)
        if not tokens:
            raise ValueError("empty prompt")
        start = time.perf_counter()
        # Prefill all but the last prompt token; each step feeds the last emitted token first.
        if len(tokens) > 1:
            target.feed(tokens[:-1])
            draft.feed(tokens[:-1])
        produced, gamma = 0, self.gamma
        while produced < max_new_tokens:
            budget = max_new_tokens - produced
            block = min(gamma, max(budget - 1, 0))
            proposal, q_rows = [], []
            draft.crop(min(draft.length, len(tokens) - 1))
            pending = tokens[draft.length:]
            for i in range(block):
                logits = draft.feed(pending)[-1]
                stats["draft_calls"] += 1
                if params.greedy:
                    token = int(logits.argmax())
                    confident = torch.softmax(logits.float(), -1).max() if self.schedule == "confidence" else 1.0
                else:
                    q = warp(logits, params)
                    token = int(torch.multinomial(q, 1, generator=generator))
                    q_rows.append(q)
                    confident = q.max() if self.schedule == "confidence" else 1.0
                proposal.append(token)
                pending = [token]
                if self.schedule == "confidence" and confident < self.confidence:
                    break
            logits = target.feed([tokens[-1]] + proposal)
            stats["target_calls"] += 1
            if params.greedy:
                choice = logits.argmax(-1).tolist()
                n = 0
                while n < len(proposal) and proposal[n] == choice[n]:
                    n += 1
                new = proposal[:n] + [choice[n]]
            else:
                p = warp(logits, params)
                q = torch.stack(q_rows) if q_rows else p.new_zeros((0, p.shape[-1]))
                n, nxt = verify(p, q, torch.tensor(proposal, dtype=torch.long), generator)
                new = proposal[:n] + [nxt]
            # Target cache holds the context through the accepted drafts; the new last token is fed next step.
            target.crop(len(tokens) + n)
            stats["accepted"].append(n)
            stats["drafted"].append(len(proposal))
            if self.schedule == "heuristic":  # HF assisted generation's schedule
                gamma = min(self.max_gamma, gamma + 2) if n == len(proposal) else max(1, gamma - 1)
            for j, token in enumerate(new):
                if token in eos:
                    new = new[: j + 1]
                    break
            new = new[:budget]
            tokens += new
            produced += len(new)
            if "ttft_s" not in stats:
                stats["ttft_s"] = time.perf_counter() - start
            yield new
            if new and new[-1] in eos:
                break
        seconds = time.perf_counter() - start
        stats.update(new_tokens=produced, seconds=seconds, tokens_per_s=produced / seconds if seconds else 0.0,
                     tau=produced / max(stats["target_calls"], 1))

    def generate(self, prompt_ids: list[int], max_new_tokens: int = 128, eos_token_id=None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None
                 ) -> GenerationOutput:
        stats: dict = {}
        tokens = []
        for chunk in self.stream(prompt_ids, max_new_tokens, eos_token_id, SamplingParams(temperature, top_k, top_p),
                                 seed, stats):
            tokens += chunk
        return GenerationOutput(tokens, stats)


def target_only_generate(target, prompt_ids: list[int], max_new_tokens: int = 128, eos_token_id=None,
                         temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None
                         ) -> GenerationOutput:
    """The fair baseline: the same model, dtype, cache and sampling code, one target call per token."""
    params = SamplingParams(temperature, top_k, top_p)
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    model = _CachedModel(target.eval())
    start = time.perf_counter()
    logits = model.feed(list(prompt_ids))[-1]
    tokens, ttft = [], None
    while len(tokens) < max_new_tokens:
        token = int(logits.argmax()) if params.greedy else int(torch.multinomial(warp(logits, params), 1,
                                                                                  generator=generator))
        tokens.append(token)
        ttft = ttft or time.perf_counter() - start
        if token in eos or len(tokens) == max_new_tokens:
            break
        logits = model.feed([token])[-1]
    seconds = time.perf_counter() - start
    return GenerationOutput(tokens, {"new_tokens": len(tokens), "seconds": seconds, "ttft_s": ttft,
                                     "tokens_per_s": len(tokens) / seconds, "target_calls": len(tokens), "tau": 1.0})
