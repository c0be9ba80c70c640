"""Target loading, draft construction, parameter accounting and the target/draft pair check."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .assets import resolve_model_path
from .config import DraftConfig
from .precision import resolve_dtype

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class PairMismatchError(ValueError):
    """Target and draft cannot be used together: their tokenizers or vocabularies differ."""


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str, dtype: str = "float32", trainable: bool = False):
    """``dtype``: float32, bfloat16, or auto (bfloat16 only where the hardware has native bf16 matmuls)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(path), dtype=DTYPES[resolve_dtype(dtype)])
    if not trainable:
        model.eval()
        model.requires_grad_(False)
    return model


DRAFT_VOCAB_FILE = "draft_vocab.json"  # written next to a trained draft: the tokens its decoding head keeps


class ReducedHeadDraft(nn.Module):
    """A draft whose LM head computes only ``token_ids``' logits; every other token's logit is -inf.

    Speculative decoding is lossless for any proposal distribution q: the target checks every drafted token,
    and the residual max(0, p − q) restores the mass that q leaves out. So the draft may propose from its
    frequent tokens only (EAGLE-3's reduced draft vocabulary, here at decode time only: the saved and exported
    draft keep their full head). At batch 1 the draft's step is bound by reading weights, and its fp32 head
    (49,152 × 384) is most of them. Logits come back full width, so every caller's sampling, verification and
    acceptance code stays unchanged.
    """

    def __init__(self, draft, token_ids):
        super().__init__()
        self.inner = draft
        weight = draft.get_output_embeddings().weight
        ids = torch.as_tensor(sorted({int(t) for t in token_ids}), dtype=torch.long)
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= weight.shape[0]:
            span = f"{int(ids[0])}..{int(ids[-1])}" if ids.numel() else "nothing"
            raise ValueError(f"draft vocabulary: needs token ids in [0, {weight.shape[0]}), got {span}")
        self.vocab_size = weight.shape[0]
        self.register_buffer("token_ids", ids.to(weight.device), persistent=False)
        self.head = nn.Linear(weight.shape[1], ids.numel(), bias=False, device=weight.device, dtype=weight.dtype)
        self.head.weight = nn.Parameter(weight.detach()[ids].clone(), requires_grad=False)

    @property
    def config(self):
        return self.inner.config

    @property
    def device(self):
        return self.inner.device

    def forward(self, input_ids=None, logits_to_keep=0, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast
        from transformers.modeling_utils import slice_logits_to_keep

        out = self.inner.base_model(input_ids=input_ids, **kwargs)
        kept = self.head(slice_logits_to_keep(out.last_hidden_state, logits_to_keep))
        logits = kept.new_full((*kept.shape[:-1], self.vocab_size), float("-inf"))
        logits[..., self.token_ids] = kept
        return CausalLMOutputWithPast(logits=logits, past_key_values=out.past_key_values)


def load_draft(path: str, dtype: str = "float32", full_vocab: bool = False):
    """A trained draft for decoding: with its ``draft_vocab.json`` (written by training) and not ``full_vocab``,
    wrapped so that its head computes only those tokens (``ReducedHeadDraft``)."""
    import json

    draft = load_model(path, dtype)
    vocab_file = Path(resolve_model_path(path)) / DRAFT_VOCAB_FILE
    if full_vocab or not vocab_file.is_file():
        return draft
    try:
        ids = json.loads(vocab_file.read_text())["token_ids"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{vocab_file}: unreadable draft vocabulary ({err}); delete it to decode with the full "
                         "head") from err
    if len(set(ids)) >= draft.config.vocab_size:  # a vocabulary no larger than the kept set: nothing to save
        return draft
    return ReducedHeadDraft(draft, ids)


def unwrap_draft(draft):
    """The plain HF model under a ``ReducedHeadDraft`` (for HF ``generate``, export and parameter counts)."""
    return draft.inner if isinstance(draft, ReducedHeadDraft) else draft


# ---------------------------------------------------------------- accounting


@dataclass
class ParamCount:
    total: int
    embedding: int

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def count_params(model: nn.Module) -> ParamCount:
    """Unique parameters (tied weights once); embedding = input embedding plus an untied LM head."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel()
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    embedding = emb.numel()
    if head is not None and head.weight.data_ptr() != emb.data_ptr():
        embedding += head.weight.numel()
    return ParamCount(total=total, embedding=embedding)


def size_report(draft: nn.Module, target: nn.Module) -> dict:
    d, t = count_params(unwrap_draft(draft)), count_params(target)
    return {
        "draft_params": d.total, "draft_non_embedding": d.non_embedding,
        "target_params": t.total, "target_non_embedding": t.non_embedding,
        "ratio_total": d.total / t.total,
        "ratio_non_embedding": d.non_embedding / max(t.non_embedding, 1),
    }


# ---------------------------------------------------------------- pair check


def _special_ids(tokenizer) -> dict:
    return {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}


def check_pair(target_tokenizer, draft_tokenizer, target_config=None, draft_config=None) -> None:
    """Fail before any compute if target and draft do not share one tokenizer and vocabulary."""
    if (target_config is not None and draft_config is not None
            and target_config.vocab_size != draft_config.vocab_size):
        raise PairMismatchError(
            f"vocab size mismatch: target config has vocab_size={target_config.vocab_size}, "
            f"draft config has vocab_size={draft_config.vocab_size}"
        )
    t_vocab, d_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if len(t_vocab) != len(d_vocab):
        raise PairMismatchError(f"tokenizer size mismatch: target has {len(t_vocab)} tokens, draft has {len(d_vocab)}")
    for token, index in sorted(t_vocab.items(), key=lambda kv: kv[1]):
        if d_vocab.get(token) != index:
            raise PairMismatchError(
                f"token->id mismatch: target maps {token!r} to {index}, draft maps it to {d_vocab.get(token)}"
            )
    t_special, d_special = _special_ids(target_tokenizer), _special_ids(draft_tokenizer)
    for name in t_special:
        if t_special[name] != d_special[name]:
            raise PairMismatchError(
                f"special token mismatch: target {name}_token_id={t_special[name]}, draft {name}_token_id={d_special[name]}"
            )


# ---------------------------------------------------------------- draft builder


def _embedding_basis(target, width: int) -> torch.Tensor:
    """Orthonormal d×r basis of the embedding's top-r right singular directions (residual subspace)."""
    weight = target.get_input_embeddings().weight.detach().float()
    _, _, vh = torch.linalg.svd(weight, full_matrices=False)
    return vh[:width].T.contiguous()


def _draft_config(target_config, cfg: DraftConfig, num_layers: int):
    config = copy.deepcopy(target_config)
    width = cfg.hidden_size or target_config.hidden_size
    head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
    config.num_hidden_layers = num_layers
    config.hidden_size = width
    if cfg.init == "target_layers":
        # Copied layers keep their heads and MLP; only the residual width may shrink.
        config.head_dim = head_dim
        config.intermediate_size = cfg.intermediate_size or target_config.intermediate_size
        return config
    heads = cfg.num_attention_heads or max(1, width // head_dim)
    gqa = max(1, target_config.num_attention_heads // target_config.num_key_value_heads)
    config.num_attention_heads = heads
    kv_heads = cfg.num_key_value_heads
    if kv_heads and heads % kv_heads:
        raise ValueError(f"draft.num_key_value_heads={kv_heads} must divide the draft's {heads} attention heads")
    if not kv_heads:
        # Keep the target's grouping where it divides; otherwise (width 448 → 7 heads with groups of 3) the
        # largest kv count that does, so grouped-query attention can share keys evenly.
        kv_heads = max(1, heads // gqa)
        while heads % kv_heads:
            kv_heads -= 1
    config.num_key_value_heads = kv_heads
    config.head_dim = head_dim
    ratio = target_config.intermediate_size / target_config.hidden_size
    config.intermediate_size = cfg.intermediate_size or int(round(width * ratio / 64) * 64)
    if hasattr(config, "layer_types") and config.layer_types is not None:
        config.layer_types = config.layer_types[:num_layers]
    return config


def build_draft(target, cfg: DraftConfig):
    """A draft model per ``cfg``: fresh, from target layers (optionally projected narrower), or pretrained.

    Narrow drafts project the residual stream onto the top singular directions P (d×r) of the target's
    embedding: embedding E·P (tied, so the LM head follows), input-side weights W·diag(g)·P with the
    RMSNorm gain g folded in, output-side weights Pᵀ·W.
    """
    from transformers import AutoModelForCausalLM

    if cfg.init == "pretrained":
        return AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg.path), dtype=torch.float32)
    tc = target.config
    if cfg.init == "target_layers":
        bad = [i for i in cfg.layers if not 0 <= i < tc.num_hidden_layers]
        if bad:
            raise ValueError(f"draft.layers {bad} out of range for a target with {tc.num_hidden_layers} layers")
    num_layers = len(cfg.layers) if cfg.init == "target_layers" else cfg.num_layers
    config = _draft_config(tc, cfg, num_layers)
    if hasattr(config, "layer_types") and getattr(config, "layer_types", None) is not None:
        config.layer_types = [tc.layer_types[i] for i in cfg.layers] if cfg.init == "target_layers" else config.layer_types
    torch.manual_seed(0)
    config.dtype = torch.float32  # the draft trains in fp32 (autocast does the rest) whatever the target's dtype
    draft = type(target)(config).to(torch.float32)
    width, full = config.hidden_size, tc.hidden_size
    narrow = width < full
    if width > full:
        raise ValueError(f"draft.hidden_size={width} exceeds the target's {full}")
    if narrow and cfg.embedding != "project":
        raise ValueError(f"draft.hidden_size={width} < target {full} needs draft.embedding=project")
    basis = _embedding_basis(target, width) if narrow else None

    with torch.no_grad():
        emb = target.get_input_embeddings().weight.detach().float()
        draft.get_input_embeddings().weight.copy_(emb @ basis if narrow else emb)
        if not config.tie_word_embeddings:
            head = target.get_output_embeddings().weight.detach().float()
            draft.get_output_embeddings().weight.copy_(head @ basis if narrow else head)
        final_gain = target.model.norm.weight.detach().float()
        # diag(Pᵀ diag(g) P): the best per-channel gain in the projected basis.
        draft.model.norm.weight.copy_(((basis * final_gain[:, None]) * basis).sum(0) if narrow else final_gain)
        if cfg.init == "target_layers":
            for new_layer, index in zip(draft.model.layers, cfg.layers):
                _copy_layer(target.model.layers[index], new_layer, basis)
    return draft


def _copy_layer(src, dst, basis: torch.Tensor | None) -> None:
    if basis is None:
        dst.load_state_dict({k: v.float() for k, v in src.state_dict().items()})
        return
    in_gain = src.input_layernorm.weight.detach().float()
    post_gain = src.post_attention_layernorm.weight.detach().float()
    attn_in = basis * in_gain[:, None]  # diag(g)·P, folded into the weights that read the residual
    mlp_in = basis * post_gain[:, None]
    s_attn, d_attn = src.self_attn, dst.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(d_attn, name).weight.copy_(getattr(s_attn, name).weight.float() @ attn_in)
    d_attn.o_proj.weight.copy_(basis.T @ s_attn.o_proj.weight.float())
    s_mlp, d_mlp = src.mlp, dst.mlp
    keep = _top_neurons(s_mlp, d_mlp.gate_proj.weight.shape[0])
    d_mlp.gate_proj.weight.copy_(s_mlp.gate_proj.weight.float()[keep] @ mlp_in)
    d_mlp.up_proj.weight.copy_(s_mlp.up_proj.weight.float()[keep] @ mlp_in)
    d_mlp.down_proj.weight.copy_(basis.T @ s_mlp.down_proj.weight.float()[:, keep])
    dst.input_layernorm.weight.fill_(1.0)
    dst.post_attention_layernorm.weight.fill_(1.0)
    for name in ("q_norm", "k_norm"):  # architectures with QK-norm keep theirs (head space is unchanged)
        if hasattr(s_attn, name):
            getattr(d_attn, name).load_state_dict(getattr(s_attn, name).state_dict())


def _top_neurons(src_mlp, count: int) -> torch.Tensor:
    """Indices of the ``count`` MLP neurons with the largest up×down weight norms, in original order."""
    total = src_mlp.gate_proj.weight.shape[0]
    if count >= total:
        return torch.arange(total)
    score = src_mlp.up_proj.weight.float().norm(dim=1) * src_mlp.down_proj.weight.float().norm(dim=0)
    return score.topk(count).indices.sort().values
