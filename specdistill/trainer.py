"""The training loop behind ``distill.py`` (logit distillation) and ``train.py`` (next-token CE).

    accelerate launch distill.py --config configs/smollm2-135m-quick.yaml [key=value ...]

One explicit loop on ``accelerate``: gradient accumulation with the loss normalised by the token count
of the whole accumulation window across processes, bf16 autocast, warmup + cosine schedule, clipping,
held-out acceptance every ``eval_every`` steps, atomic checkpoints (also on SIGTERM), non-finite-loss
skipping, and a final HF folder for the draft.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import itertools
import json
import math
import os
import random
import shutil
import signal
import time
from pathlib import Path

import torch
from torch import nn

from .acceptance import expected_tau, greedy_block_acceptance, token_acceptance
from .assets import atomic_write_dir, cache_dir
from .config import DistillConfig, GenerateConfig, hidden_layers, record_run, to_dict
from .data import (
    GENERATOR_TAG,
    build_chat_dataset,
    cut_teacher,
    generate_responses,
    generated_to_teacher_rows,
    generated_to_training,
    load_conversations,
    load_mtbench,
    sharegpt_conversations,
    split_records,
    target_generated_dataset,
    teacher_pass,
    teacher_pass_dir,
)
from .losses import distill_loss, hidden_state_loss, teacher_topk
from .models import DRAFT_VOCAB_FILE, build_draft, check_pair, load_model, load_tokenizer, size_report


class NonFiniteLossError(RuntimeError):
    """Too many consecutive non-finite losses: the run is diverging."""


class DraftLoss(nn.Module):
    """Wraps the draft so that the whole loss is computed inside ``forward`` (what DDP needs).

    Only the selected positions go through the LM head, in chunks: the vocab-sized tensors exist for
    one chunk at a time, never for the whole B×L batch.
    """

    def __init__(self, draft: nn.Module, hidden_match: dict | None = None):
        super().__init__()
        self.draft = draft
        # train.hidden_weight: per stored target layer, a linear map from the draft's state after layer
        # ``draft_layers[j]`` to the target's stored state (standardised by the training set's per-channel mean /
        # std; the stored layers sit side by side). Trained, never saved with the draft.
        self.draft_layers: list[int] = []
        if hidden_match is not None:
            self.draft_layers = hidden_match["draft_layers"]
            width = hidden_match["mean"].numel() // len(self.draft_layers)
            self.hidden_maps = nn.ModuleList(nn.Linear(draft.config.hidden_size, width) for _ in self.draft_layers)
            self.register_buffer("hidden_mean", hidden_match["mean"].float())
            self.register_buffer("hidden_std", hidden_match["std"].float())

    def base(self):
        return self.draft.get_base_model() if hasattr(self.draft, "get_base_model") else self.draft

    def hidden_term(self, hidden_states, select, teacher_hidden):
        """The unweighted hidden-state loss, summed over the selected positions and the matched layers."""
        # hidden_states[j] is the output of layer j (1-based) for j below the last; the last entry is normed.
        total = 0.0
        for j, (layer, hidden_map) in enumerate(zip(self.draft_layers, self.hidden_maps)):
            part = slice(j * hidden_map.out_features, (j + 1) * hidden_map.out_features)
            state = hidden_states[layer][:, :-1][select]
            total = total + hidden_state_loss(hidden_map(state), teacher_hidden[:, part], self.hidden_mean[part],
                                              self.hidden_std[part])
        return total

    def forward(self, input_ids, attention_mask, select, teacher, labels, kind, beta, temperature, ce_weight,
                chunk_size, vocab_ids=None, teacher_hidden=None, hidden_weight=0.0):
        base = self.base()
        body = getattr(base, base.base_model_prefix)
        out = body(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=teacher_hidden is not None)
        head = base.get_output_embeddings().weight
        loss = distill_loss(out.last_hidden_state[:, :-1][select], head, teacher, labels, kind, beta, temperature,
                            ce_weight, chunk_size, vocab_ids)
        hidden = torch.zeros((), device=loss.device)
        if teacher_hidden is not None:
            hidden = self.hidden_term(out.hidden_states, select, teacher_hidden)
            loss = loss + hidden_weight * hidden
        # The unweighted hidden-state sum rides along detached, so the log can show the two terms apart.
        return loss, hidden.detach()


# ---------------------------------------------------------------- data


def pad_batch(rows: list[dict], seq_len: int, pad_id: int) -> dict:
    """Right-padded tensors; ``select`` marks positions t whose next token t+1 is a loss token."""
    rows = [{k: list(v)[:seq_len] for k, v in r.items() if k in ("input_ids", "loss_mask")} for r in rows]
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        attention[i, :n] = 1
        mask[i, :n] = torch.tensor(r["loss_mask"], dtype=torch.bool)
    return {"input_ids": ids, "attention_mask": attention, "select": mask[:, 1:], "labels": ids[:, 1:][mask[:, 1:]]}


def stored_teacher(rows: list[dict], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' stored top-k teacher as (ids (N, k), log-probs (N, k)), N = their loss positions in order."""
    return (torch.cat([torch.tensor(r["topk_ids"], dtype=torch.long).reshape(-1, top_k) for r in rows]),
            torch.cat([torch.tensor(r["topk_logp"], dtype=torch.float32).reshape(-1, top_k) for r in rows]))


def on_device(batch: dict, device) -> dict:
    """The batch's tensors (and the teacher's tensor pair) on the training device: a no-op on CPU."""
    return {k: tuple(t.to(device) for t in v) if isinstance(v, tuple) else v.to(device) for k, v in batch.items()}


def frequent_tokens(rows, count: int) -> tuple[torch.Tensor, float]:
    """The ``count`` most frequent loss tokens of ``rows`` (ties by id) and the share of loss tokens they cover."""
    from collections import Counter

    counts = Counter()
    for ids, mask in zip(rows["input_ids"], rows["loss_mask"]):
        counts.update(token for token, m in zip(ids, mask) if m)
    kept = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:count]
    total = sum(counts.values())
    return torch.tensor(sorted(t for t, _ in kept), dtype=torch.long), sum(c for _, c in kept) / max(total, 1)


def step_vocab(frequent: torch.Tensor, labels: torch.Tensor, negatives: int, vocab_size: int, seed: int
               ) -> torch.Tensor:
    """``train.head_vocab``'s softmax support for one micro-batch: the frequent tokens, the batch's labels (so
    no CE target and no sampled teacher token is ever outside it) and ``negatives`` uniform draws, which keep
    the rare tokens' logits trained down, so the full head the draft is saved with stays usable."""
    generator = torch.Generator().manual_seed(seed)
    drawn = torch.randint(0, vocab_size, (negatives,), generator=generator)
    return torch.unique(torch.cat([frequent, labels.long(), drawn]))


LENGTH_WINDOW = 16  # batches per window whose rows are sorted by length (train.group_by_length)


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, num_rows: int, lengths: tuple[int, ...] | None = None,
                 batch: int = 1) -> tuple[int, ...]:
    """A fixed permutation of the rows per epoch. With ``lengths``, rows are sorted by length inside windows
    of ``LENGTH_WINDOW`` batches and cut into batches of ``batch`` similar-length rows, whose order is then
    shuffled: a batch pads to its longest row, and random batches waste ≈ ¼ of their positions on padding."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(num_rows))
    rng.shuffle(order)
    if lengths is None:
        return tuple(order)
    window = batch * LENGTH_WINDOW
    full, partial = [], []
    for start in range(0, num_rows, window):
        ranked = sorted(order[start: start + window], key=lengths.__getitem__)
        for b in range(0, len(ranked), batch):
            (full if len(ranked[b: b + batch]) == batch else partial).append(ranked[b: b + batch])
    rng.shuffle(full)
    return tuple(i for chunk in full + partial for i in chunk)  # a short chunk last keeps batches aligned


def row_lengths(rows, cfg) -> tuple[int, ...] | None:
    """What ``micro_batch_rows`` groups by under ``train.group_by_length``: each row's length as padded (≤ seq_len)."""
    return tuple(min(len(ids), cfg.seq_len) for ids in rows["input_ids"]) if cfg.group_by_length else None


def micro_batch_rows(step: int, micro: int, cfg, world: int, rank: int, num_rows: int,
                     lengths: tuple[int, ...] | None = None) -> list[int]:
    """Row indices for one process's micro-batch: a fixed permutation per epoch, so order survives resume.
    ``lengths`` (``train.group_by_length``) groups rows of similar length into each step's batch."""
    start = (step * cfg.grad_accum + micro) * cfg.batch_size * world
    rows = []
    for offset in range(start + rank, start + cfg.batch_size * world, world):
        epoch, position = divmod(offset, num_rows)
        rows.append(_epoch_order(cfg.seed, epoch, num_rows, lengths, cfg.batch_size * world)[position])
    return rows


def training_rows(cfg: DistillConfig, target, tokenizer, accelerator):
    """The training set per ``train.data_mode`` (fixed ShareGPT replies or the target's own)."""
    if cfg.train.data_mode == "fixed":
        records = load_conversations(cfg.data)
        train, _ = split_records(records, cfg.data.heldout_fraction, cfg.data.seed)
        with accelerator.main_process_first():
            return build_chat_dataset(tokenizer, train, cfg.train.seq_len)
    if cfg.train.data_mode == "fixed-cache":
        # generate.num_prompts conversations (a seeded sample of the training split), the target's teacher
        # stored by one teacher-forced pass over them under generate.max_minutes.
        records = load_conversations(cfg.data)
        train, _ = split_records(records, cfg.data.heldout_fraction, cfg.data.seed)
        gen = cfg.generate
        with accelerator.main_process_first():
            chats = build_chat_dataset(tokenizer, sharegpt_conversations(train, gen.num_prompts, gen.seed),
                                       cfg.train.seq_len, name="fixed-cache")
            dtype = str(target.dtype)
            rows = teacher_pass(target, chats, teacher_pass_dir(cfg.target.path, dtype, chats, gen.teacher_top_k,
                                                                gen.teacher_hidden_layer, gen.seed),
                                gen.teacher_top_k, gen.teacher_hidden_layer, max_minutes=gen.max_minutes,
                                seed=gen.seed)
        rows = cut_teacher(rows, cfg.train.cache_top_k)
        return rows if cfg.train.hidden_weight > 0 or "hidden" not in rows.column_names else rows.remove_columns("hidden")
    with accelerator.main_process_first():
        generated = target_generated_dataset(target, tokenizer, cfg.target.path, cfg.data, cfg.generate)
    if cfg.train.data_mode == "cache" and cfg.generate.teacher_top_k:
        return generated_to_teacher_rows(generated, cfg.train.seq_len, cfg.train.cache_top_k, cfg.train.prompt_loss,
                                         hidden=cfg.train.hidden_weight > 0)
    return generated_to_training(generated)


def stored_hidden_states(rows) -> tuple[torch.Tensor, list[int]]:
    """The rows' stored target states (``hidden``) as one (N, d) fp16 tensor, read straight from Arrow (a
    Python list per token would take minutes for a full preset), and the row bounds into it: row i's states are
    ``states[bounds[i]: bounds[i + 1]]``."""
    import numpy as np

    outer = rows.with_format("arrow")[:]["hidden"].combine_chunks()
    per_row = np.diff(outer.offsets.to_numpy())
    tokens = outer.flatten()
    width = tokens.value_lengths().to_numpy()
    if len(width) and (width != width[0]).any():
        raise ValueError("the stored hidden states differ in width between tokens: the generated set is corrupt")
    values = tokens.flatten().to_numpy(zero_copy_only=False)
    states = torch.from_numpy(values.reshape(len(width), int(width[0]) if len(width) else 0).copy())
    for i, row in enumerate(rows.select_columns(["loss_mask"])):
        if sum(row["loss_mask"]) != per_row[i]:
            raise ValueError(f"row {i}: {per_row[i]} stored hidden states for {sum(row['loss_mask'])} loss tokens")
    return states, [0, *np.cumsum(per_row).tolist()]


def draft_match_layer(draft_layers: int, target_layer: int, target_layers: int) -> int:
    """The draft layer at the target layer's relative depth (1-based), for ``train.hidden_weight``. The target's
    last layer is stored after its final norm and matched by the draft's last state, which ``hidden_states``
    also reports after the norm; any other layer by one of the draft's un-normed states (at most the second to
    last)."""
    if target_layer == target_layers:
        return draft_layers
    return max(1, min(round(draft_layers * target_layer / target_layers), max(draft_layers - 1, 1)))


def hidden_matching(rows, draft_depth: int, target_layer: int | list[int], target_depth: int):
    """``rows`` without their stored target states, those states as one (N, d) tensor with each row's bounds, and
    what ``DraftLoss`` needs to match them: per stored layer the draft layer at the same relative depth, and the
    states' per-channel mean / std (from up to 65,536 of them, a fixed sample)."""
    layers = hidden_layers(target_layer)
    states, bounds = stored_hidden_states(rows)
    if not layers or states.shape[1] % len(layers):
        raise ValueError(f"the stored states are {states.shape[1]} wide: not {len(layers)} layers side by side "
                         f"(generate.teacher_hidden_layer={target_layer})")
    rows = rows.remove_columns("hidden")  # read from the tensor: a batch never builds them as lists
    sample = states[torch.randperm(len(states), generator=torch.Generator().manual_seed(0))[:65536]].float()
    match = {"draft_layers": [draft_match_layer(draft_depth, layer, target_depth) for layer in layers],
             "mean": sample.mean(0), "std": sample.std(0).clamp_min(1e-3)}
    return rows, states, bounds, match


def build_teacher_cache(target, rows, cfg, pad_id: int, out_dir: Path):
    """Offline teacher: the target's top-k log-probs at every loss position, computed once, stored as Arrow."""
    import datasets
    from tqdm.auto import tqdm

    if (out_dir / "dataset_info.json").is_file():
        return datasets.load_from_disk(str(out_dir))
    k = cfg.train.cache_top_k
    records = []
    for start in tqdm(range(0, len(rows), 16), desc="teacher cache", unit="batch"):
        chunk = [rows[i] for i in range(start, min(start + 16, len(rows)))]
        batch = pad_batch(chunk, cfg.train.seq_len, pad_id)
        with torch.inference_mode():
            logits = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        for i, row in enumerate(chunk):
            ids, logp = teacher_topk(logits[i][batch["select"][i]], k)
            records.append({"input_ids": list(row["input_ids"])[: cfg.train.seq_len],
                             "loss_mask": list(row["loss_mask"])[: cfg.train.seq_len],
                             "topk_ids": ids.int().tolist(), "topk_logp": logp.half().float().tolist()})
    features = datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "topk_ids": datasets.Sequence(datasets.Sequence(datasets.Value("int32"))),
        "topk_logp": datasets.Sequence(datasets.Sequence(datasets.Value("float16"))),
    })
    ds = datasets.Dataset.from_list(records, features=features)
    atomic_write_dir(out_dir, lambda tmp: ds.save_to_disk(str(tmp)))
    return datasets.load_from_disk(str(out_dir))


def sample_onpolicy(draft, batch_rows: list[dict], tokenizer, new_tokens: int, seq_len: int) -> list[dict]:
    """Replace each row's reply by one sampled from the current draft (the target scores it later)."""
    prompts = []
    for r in batch_rows:
        mask = list(r["loss_mask"])
        first = mask.index(1) if 1 in mask else len(mask)
        prompts.append(list(r["input_ids"])[: min(first, seq_len - new_tokens)])
    pad_id = tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        attention[i, width - len(p):] = 1
    was_training = draft.training
    draft.eval()
    with torch.no_grad():
        out = draft.generate(input_ids=ids, attention_mask=attention, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=new_tokens, pad_token_id=pad_id,
                             eos_token_id=tokenizer.eos_token_id)
    draft.train(was_training)
    rows = []
    for i, p in enumerate(prompts):
        reply = out[i, width:].tolist()
        if tokenizer.eos_token_id in reply:
            reply = reply[: reply.index(tokenizer.eos_token_id) + 1]
        rows.append({"input_ids": p + reply, "loss_mask": [0] * len(p) + [1] * len(reply)})
    return rows


# ---------------------------------------------------------------- held-out acceptance


def eval_set(target, tokenizer, cfg: DistillConfig) -> dict | None:
    """MT-bench turn-1 prompts with the target's greedy continuations and its logits there (kept in bf16)."""
    n = cfg.train.eval_prompts
    if n == 0:
        return None
    questions = load_mtbench()[:n]
    prompts = [(f"mtbench-{q['question_id']}", [{"role": "user", "content": q["turns"][0]}]) for q in questions]
    # MT-bench prompts are long in small vocabularies; keep them whole rather than drop them.
    gen = GenerateConfig(num_prompts=n, max_new_tokens=cfg.train.eval_new_tokens, batch_size=8,
                         max_prompt_tokens=384)
    key = f"{Path(cfg.target.path).name}-mtbench{n}-{gen.max_new_tokens}-{cfg.target.dtype}-L{gen.max_prompt_tokens}-{GENERATOR_TAG}"
    ds = generate_responses(target, tokenizer, prompts, cache_dir() / "eval" / key, gen.max_prompt_tokens,
                            gen.max_new_tokens, gen.batch_size, max_active_rows=64)
    rows = list(generated_to_training(ds))
    return {"rows": rows, "pad_id": tokenizer.pad_token_id,
            "target_logits": logits_at_targets(target, rows, tokenizer.pad_token_id, dtype=torch.bfloat16)}


@torch.no_grad()
def logits_at_targets(model, rows, pad_id: int, batch_size: int = 8, dtype=torch.float32) -> list[torch.Tensor]:
    """Per row: the model's logits at every position that predicts a loss token, in eval mode."""
    was_training = model.training
    model.eval()
    out = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i: i + batch_size]
        batch = pad_batch(chunk, 1 << 16, pad_id)  # padded per chunk, never cut
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        out += [logits[j][batch["select"][j]].to(dtype) for j in range(len(chunk))]
    model.train(was_training)
    return out


def evaluate_acceptance(draft, evalset: dict, gamma: int = 5, keep_ids: list[int] | None = None) -> dict:
    """α and τ on the held-out set. ``keep_ids``: the tokens of the decoding head the draft will be saved with
    (``draft_vocab.json``); the others get −inf, as ``models.ReducedHeadDraft`` gives them, so the curve measures
    the draft that decoding will run."""
    draft_logits = logits_at_targets(draft, evalset["rows"], evalset["pad_id"])
    if keep_ids is not None:
        dropped = torch.ones(draft_logits[0].shape[-1], dtype=torch.bool)
        dropped[torch.as_tensor(keep_ids, dtype=torch.long)] = False
        draft_logits = [q.masked_fill(dropped, float("-inf")) for q in draft_logits]
    greedy, sampled, counts = [], [], []
    for p, q in zip(evalset["target_logits"], draft_logits):
        agree = token_acceptance(p.float(), q, 0.0)
        greedy.append(agree)
        sampled.append(token_acceptance(p.float(), q, 1.0))
        counts += greedy_block_acceptance(agree, gamma)
    greedy = torch.cat(greedy)
    alpha = greedy.mean().item()
    return {"alpha_greedy": alpha, "alpha_t1": torch.cat(sampled).mean().item(),
            f"tau_greedy_g{gamma}": sum(c + 1 for c in counts) / max(len(counts), 1),
            f"tau_iid_g{gamma}": expected_tau(alpha, gamma), "eval_tokens": int(greedy.numel())}


# ---------------------------------------------------------------- checkpoints


def latest_checkpoint(output_dir: Path) -> Path | None:
    pointer = output_dir / "checkpoints" / "latest"
    if pointer.is_file():
        path = output_dir / "checkpoints" / pointer.read_text().strip()
        if (path / "trainer_state.json").is_file():
            return path
    complete = sorted(p for p in (output_dir / "checkpoints").glob("step-*") if (p / "trainer_state.json").is_file())
    return complete[-1] if complete else None


def save_checkpoint(accelerator, output_dir: Path, state: dict, keep_last: int) -> Path:
    """save_state into a temp folder, then rename: a killed save never looks complete."""
    root = output_dir / "checkpoints"
    name = f"step-{state['step']:07d}"
    tmp = root / f".tmp-{name}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    final = root / name
    if accelerator.is_main_process:
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer_tmp = root / ".latest.tmp"
        pointer_tmp.write_text(name)
        os.replace(pointer_tmp, root / "latest")
        complete = sorted(p for p in root.glob("step-*") if (p / "trainer_state.json").is_file())
        for old in complete[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def draft_vocabulary(rows, tokenizer, size: int) -> dict:
    """The tokens the draft's decoding head keeps (``models.ReducedHeadDraft``): the ``size`` most frequent
    loss tokens of its training rows and the special tokens (EOS ends every reply). A small set holds fewer
    distinct tokens (704 replies: 7,634), so the rest are the lowest ids: BPE's earliest merges, the tokenizer's
    own frequency order."""
    frequent, coverage = frequent_tokens(rows, size)
    chosen = set(frequent.tolist()) | set(tokenizer.all_special_ids)
    fill = (t for t in range(len(tokenizer)) if t not in chosen)
    chosen |= set(itertools.islice(fill, max(0, size - len(chosen))))
    return {"token_ids": sorted(chosen), "training_coverage": round(coverage, 4),
            "rule": f"the {size} most frequent training loss tokens, the special tokens, then the lowest ids"}


def save_draft(draft, tokenizer, out: Path, extra: dict, vocabulary: dict | None = None) -> Path:
    """The trained draft as a plain HF folder (LoRA merged), with the target's tokenizer and, given
    ``vocabulary``, the ``draft_vocab.json`` that decoding reads."""
    import copy

    model = draft
    if hasattr(model, "merge_and_unload"):
        model = copy.deepcopy(model).merge_and_unload()

    def write(tmp: Path):
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "specdistill.json").write_text(json.dumps(extra, indent=2))
        if vocabulary is not None:
            (tmp / DRAFT_VOCAB_FILE).write_text(json.dumps(vocabulary))

    return atomic_write_dir(out, write)


# ---------------------------------------------------------------- the loop


def lr_lambda(cfg, elapsed_s=lambda: 0.0):
    """Linear warmup, then cosine to min_lr_ratio over whichever budget ends first: max_steps or
    max_minutes. Budgeted runs stop on the clock long before max_steps, and a step-only cosine would leave
    them at near-peak LR, never annealed."""
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        if cfg.max_minutes:
            progress = max(progress, elapsed_s() / (cfg.max_minutes * 60))
        progress = min(1.0, progress)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def run(cfg: DistillConfig, resume: bool = False) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    tc = cfg.train
    out = Path(cfg.output_dir)
    mixed = "bf16" if tc.bf16 else "no"
    accelerator = Accelerator(mixed_precision=mixed, log_with="tensorboard", project_dir=str(out))
    set_seed(tc.seed)
    if accelerator.is_main_process:
        record_run(out, cfg, seed=tc.seed, extra={"num_processes": accelerator.num_processes})

    tokenizer = load_tokenizer(cfg.target.path)
    target = load_model(cfg.target.path, cfg.target.dtype).to(accelerator.device)
    draft = build_draft(target, cfg.draft)  # reads fp32 copies of the weights; the teacher keeps its dtype
    check_pair(tokenizer, load_tokenizer(cfg.draft.path) if cfg.draft.init == "pretrained" else tokenizer,
               target.config, draft.config)
    sizes = size_report(draft, target)
    if tc.freeze_embedding:
        draft.get_input_embeddings().requires_grad_(False)
    if tc.lora_r:
        from peft import LoraConfig, get_peft_model

        draft = get_peft_model(draft, LoraConfig(r=tc.lora_r, lora_alpha=tc.lora_alpha, lora_dropout=0.0,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                 "gate_proj", "up_proj", "down_proj"]))
    accelerator.print(f"draft: {sizes['draft_params'] / 1e6:.1f}M params = {sizes['ratio_total']:.1%} of the target "
                      f"({sizes['ratio_non_embedding']:.1%} without embeddings)")

    rows = training_rows(cfg, target, tokenizer, accelerator)
    if tc.max_train_rows:
        rows = rows.select(range(min(tc.max_train_rows, len(rows))))
    hidden_match, target_states = None, None
    if tc.hidden_weight:
        rows, target_states, state_bounds, hidden_match = hidden_matching(
            rows, draft.config.num_hidden_layers, cfg.generate.teacher_hidden_layer, target.config.num_hidden_layers)
        pairs = ", ".join(f"draft layer {d} to target layer {t}" for d, t in
                          zip(hidden_match["draft_layers"], hidden_layers(cfg.generate.teacher_hidden_layer)))
        accelerator.print(f"train.hidden_weight={tc.hidden_weight}: {pairs}, on {len(target_states):,} stored states")
    evalset = eval_set(target, tokenizer, cfg) if accelerator.is_main_process else None
    if tc.data_mode in ("cache", "fixed-cache"):
        if "topk_ids" not in rows.column_names:  # no teacher stored at generation: one target pass over the set
            cache_key = f"teacher-{rows._fingerprint}-k{tc.cache_top_k}-L{tc.seq_len}-{cfg.target.dtype}"
            with accelerator.main_process_first():
                rows = build_teacher_cache(target, rows, cfg, tokenizer.pad_token_id,
                                           cache_dir() / "teacher" / cache_key)
        del target  # the cache replaces the teacher: train without it in memory
        target = None
    num_rows = len(rows)
    if num_rows == 0:
        raise ValueError("the training set is empty")
    lengths = row_lengths(rows, tc)
    # The decoding head's tokens, chosen now so that the held-out evals measure the draft that will be saved.
    vocabulary = (draft_vocabulary(rows, tokenizer, tc.draft_vocab)
                  if 0 < tc.draft_vocab < len(tokenizer) else None)  # a cut that keeps every token is no cut
    frequent, vocab_size = None, draft.get_output_embeddings().weight.shape[0]
    if tc.head_vocab:
        frequent, coverage = frequent_tokens(rows, tc.head_vocab)
        accelerator.print(f"train.head_vocab={tc.head_vocab}: the {len(frequent):,} most frequent reply tokens cover "
                          f"{coverage:.1%} of the loss tokens; each step adds its labels and {tc.head_negatives} "
                          f"random tokens (of {vocab_size:,})")

    module = DraftLoss(draft, hidden_match)
    trainable = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.95))
    state = {"step": 0, "tokens": 0, "nonfinite_total": 0, "nonfinite_run": 0, "elapsed_s": 0.0}
    # Reads `state` at call time, so the resumed state below is what the schedule sees.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tc, lambda: state["elapsed_s"]))
    module, optimizer, scheduler = accelerator.prepare(module, optimizer, scheduler)

    if resume:
        ckpt = latest_checkpoint(out)
        if ckpt is None:
            accelerator.print(f"--resume: no complete checkpoint under {out}/checkpoints, starting fresh")
        else:
            accelerator.load_state(str(ckpt))
            state = json.loads((ckpt / "trainer_state.json").read_text())
            accelerator.print(f"resumed from {ckpt} (step {state['step']})")
    # Opened after the resume so that TensorBoard, like the CSVs (restore_history), drops what the killed run logged
    # after its checkpoint, or all of an earlier run's events in this folder when this run starts fresh.
    accelerator.init_trackers("tb", config={k: str(v) for k, v in to_dict(cfg).items()},
                              init_kwargs={"tensorboard": {"purge_step": state["step"] + 1 if state["step"] else 0}})

    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum  # saved at the next step boundary, never mid-update

    previous = signal.signal(signal.SIGTERM, on_signal)
    kind = tc.loss if tc.objective == "distill" else "fkl"
    ce_weight = 1.0 if tc.objective == "ce" else tc.ce_weight
    history = restore_history(out, state["step"]) if accelerator.is_main_process else []
    base_draft = accelerator.unwrap_model(module).draft

    def log(row: dict):
        history.append(row)
        accelerator.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=row["step"])
        if accelerator.is_main_process:
            metrics_path = out / f"{row['kind']}_metrics.csv"  # train and eval rows have different columns
            new = not metrics_path.exists()
            with metrics_path.open("a", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=sorted(row), extrasaction="ignore")
                if new:
                    writer.writeheader()
                writer.writerow(row)

    def evaluate(step: int):
        if evalset is None:
            return {}
        result = evaluate_acceptance(base_draft, evalset, keep_ids=vocabulary and vocabulary["token_ids"])
        log({"step": step, "kind": "eval", **result})
        return result

    last_eval = evaluate(state["step"]) if state["step"] == 0 else {}
    started = time.perf_counter() - state["elapsed_s"]
    bar = tqdm(total=tc.max_steps, initial=state["step"], desc="ce" if tc.objective == "ce" else f"distill:{kind}", unit="step",
               disable=not accelerator.is_main_process)
    world, rank = accelerator.num_processes, accelerator.process_index
    saved_at = state["step"] if resume else -1
    interrupted = False
    first_step, first_elapsed = state["step"], state["elapsed_s"]
    try:
        while state["step"] < tc.max_steps:
            step = state["step"]
            t0 = time.perf_counter()
            micro_batches = []
            for micro in range(tc.grad_accum):
                indices = micro_batch_rows(step, micro, tc, world, rank, num_rows, lengths)
                batch_rows = [rows[i] for i in indices]
                if tc.data_mode == "onpolicy" and random.Random(tc.seed * 7919 + step).random() < tc.onpolicy_fraction:
                    batch_rows = sample_onpolicy(base_draft, batch_rows, tokenizer, tc.onpolicy_new_tokens, tc.seq_len)
                batch = pad_batch(batch_rows, tc.seq_len, tokenizer.pad_token_id)
                if frequent is not None:  # seeded by step and rank: a resumed run draws the same negatives
                    batch["vocab_ids"] = step_vocab(frequent, batch["labels"], tc.head_negatives, vocab_size,
                                                    ((tc.seed * 1_000_003 + step) * 64 + micro) * world + rank)
                if tc.data_mode in ("cache", "fixed-cache"):
                    batch["teacher"] = stored_teacher(batch_rows, tc.cache_top_k)
                if target_states is not None:  # rows are cut at seq_len already (generated_to_teacher_rows)
                    batch["teacher_hidden"] = torch.cat([target_states[state_bounds[i]: state_bounds[i + 1]]
                                                         for i in indices])
                micro_batches.append(on_device(batch, accelerator.device))
            # Normalise by the loss tokens of the whole window on all processes (not per micro-batch mean).
            local_tokens = torch.tensor(sum(int(b["select"].sum()) for b in micro_batches), dtype=torch.float64)
            window_tokens = accelerator.reduce(local_tokens.to(accelerator.device), reduction="sum").item()
            step_loss = step_hidden = 0.0
            for i, batch in enumerate(micro_batches):
                if "teacher" in batch:
                    teacher = batch["teacher"]
                elif ce_weight < 1.0:
                    with torch.inference_mode():
                        hidden = getattr(target, target.base_model_prefix)(
                            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
                    teacher = (hidden[:, :-1][batch["select"]].clone(), target.get_output_embeddings().weight)
                else:
                    teacher = (torch.zeros(0, 1), torch.zeros(1, 1))  # CE only: the teacher is never read
                if tc.teacher_top_k and "teacher" not in batch and ce_weight < 1.0:
                    with torch.inference_mode():
                        teacher = teacher_topk(teacher[0].float() @ teacher[1].float().T, tc.teacher_top_k)
                    teacher = (teacher[0].clone(), teacher[1].clone())
                sync = accelerator.no_sync(module) if i < len(micro_batches) - 1 else contextlib.nullcontext()
                with sync:
                    loss_sum, hidden_sum = module(batch["input_ids"], batch["attention_mask"], batch["select"],
                                                  teacher, batch["labels"], kind, tc.beta, tc.temperature, ce_weight,
                                                  tc.chunk_size, batch.get("vocab_ids"), batch.get("teacher_hidden"),
                                                  tc.hidden_weight)
                    loss = loss_sum * world / max(window_tokens, 1.0)
                    if step in tc.inject_nan_steps:
                        loss = loss * float("nan")
                    accelerator.backward(loss)
                step_loss += loss.detach().float().item() / world
                step_hidden += hidden_sum.float().item() / max(window_tokens, 1.0)
            # Each rank holds its share of the window's normalised loss: their sum is the step's loss.
            step_loss, step_hidden = accelerator.reduce(
                torch.tensor([step_loss, step_hidden], dtype=torch.float64, device=accelerator.device),
                reduction="sum").tolist()
            finite = math.isfinite(step_loss)
            grad_norm = float("nan")
            if finite:
                grad_norm = float(accelerator.clip_grad_norm_(trainable, tc.grad_clip))
                optimizer.step()
                state["nonfinite_run"] = 0
            else:
                state["nonfinite_total"] += 1
                state["nonfinite_run"] += 1
                accelerator.print(f"step {step}: non-finite loss, update skipped "
                                  f"({state['nonfinite_run']} in a row, {state['nonfinite_total']} in total)")
                if state["nonfinite_run"] >= tc.max_nonfinite:
                    raise NonFiniteLossError(
                        f"{state['nonfinite_run']} consecutive non-finite losses at step {step}: the run diverged "
                        f"(lower train.lr, check the data, or raise train.max_nonfinite)")
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            seq_tokens = int(sum(int(b["attention_mask"].sum()) for b in micro_batches)) * world
            state["tokens"] += int(window_tokens)
            state["step"] = step + 1
            seconds = time.perf_counter() - t0
            # Rank 0's clock and any rank's SIGTERM for everyone: the time-based LR, the time limit and the
            # stop must agree across ranks, or their weights drift apart, or one rank stops (and saves) while
            # the others wait in a collective. A scheduler usually signals every rank, a user's kill only one.
            # One snapshot per step: a signal landing after it is acted on at the next step, on all ranks.
            elapsed, stopping = time.perf_counter() - started, stop["signal"]
            if world > 1:
                shared = torch.tensor([elapsed if rank == 0 else 0.0, float(stopping or 0)],
                                      dtype=torch.float64, device=accelerator.device)
                torch.distributed.all_reduce(shared, op=torch.distributed.ReduceOp.MAX)
                elapsed, stopping = float(shared[0].item()), int(shared[1].item()) or None
            state["elapsed_s"] = elapsed
            record = {"step": state["step"], "kind": "train", "loss": step_loss if finite else float("nan"),
                      "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm, "loss_tokens": int(window_tokens),
                      "tokens_per_s": seq_tokens / seconds, "elapsed_s": state["elapsed_s"]}
            if target_states is not None:
                # `loss` is the divergence plus hidden_weight × this, per loss token.
                record["hidden_mse"] = step_hidden if finite else float("nan")
            log(record)
            if state["step"] % tc.eval_every == 0 or state["step"] == tc.max_steps:
                last_eval = evaluate(state["step"])
            clock = {}
            if tc.max_minutes:
                # A clock-bound run's max_steps is only a cap (recipes set 1e6): the bar's total is the steps
                # the clock leaves room for at this run's pace, so its ETA is the real one.
                left_s = max(0.0, tc.max_minutes * 60 - state["elapsed_s"])
                pace = (state["step"] - first_step) / max(state["elapsed_s"] - first_elapsed, 1e-9)
                bar.total = min(tc.max_steps, state["step"] + math.ceil(pace * left_s))
                clock = {"min_left": f"{left_s / 60:.1f}"}
            bar.update(1)
            bar.set_postfix(loss=f"{step_loss:.3f}", tok_s=f"{seq_tokens / seconds:.0f}",
                            alpha=f"{last_eval.get('alpha_greedy', float('nan')):.3f}", **clock)
            out_of_time = bool(tc.max_minutes and state["elapsed_s"] > tc.max_minutes * 60)
            out_of_time = out_of_time or state["step"] == tc.stop_at_step
            if state["step"] % tc.save_every == 0 or stopping or out_of_time:
                save_checkpoint(accelerator, out, state, tc.keep_last)
                saved_at = state["step"]
            if stopping:
                interrupted = True  # on every rank, also those that were not signalled
                accelerator.print(f"stopped by signal {stopping} at step {state['step']}; checkpoint saved, "
                                  f"continue with --resume")
                break
            if out_of_time:
                accelerator.print(f"stopping at step {state['step']} (train.max_minutes / train.stop_at_step)")
                if not last_eval or history[-1].get("kind") != "eval":
                    last_eval = evaluate(state["step"])
                break
    finally:
        signal.signal(signal.SIGTERM, previous)
        bar.close()

    result = {"steps": state["step"], "loss_tokens": state["tokens"], "elapsed_s": state["elapsed_s"],
              "nonfinite_total": state["nonfinite_total"], "sizes": sizes, "final_eval": last_eval,
              "interrupted": interrupted}
    if not interrupted and saved_at != state["step"]:
        save_checkpoint(accelerator, out, state, tc.keep_last)  # the final state, unless just saved
    if accelerator.is_main_process and not interrupted:
        save_draft(base_draft, tokenizer, out / "draft", {"target": cfg.target.path, "sizes": sizes,
                                                          "final_eval": last_eval, "config": to_dict(cfg)},
                   vocabulary)
        (out / "metrics.json").write_text(json.dumps(result, indent=2))
        plot_curves(history, out / "curves.png", title=f"{tc.objective} ({kind}), {cfg.output_dir}")
    accelerator.end_training()
    return result


def restore_history(out: Path, step: int) -> list[dict]:
    """The metrics rows of ``out``'s CSVs up to ``step`` (the checkpoint a run resumes from; 0 when it starts
    fresh), which the CSVs are cut back to: rows logged after that checkpoint, or by an earlier run in the same
    folder, would otherwise appear twice in the CSVs and in curves.png."""
    history = []
    for kind in ("train", "eval"):
        path = out / f"{kind}_metrics.csv"
        if not path.is_file():
            continue
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            kept = [row for row in reader if step and row.get("step", "").isdigit() and int(row["step"]) <= step]
            fields = reader.fieldnames
        if not kept:
            path.unlink()
            continue
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(kept)
        for row in kept:
            history.append({key: value if key == "kind" else int(value) if key == "step" else _number(value)
                            for key, value in row.items()})
    return sorted(history, key=lambda row: (row["step"], row["kind"] == "train"))


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def plot_curves(history: list[dict], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in history if r["kind"] == "train"]
    evals = [r for r in history if r["kind"] == "eval"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, label="loss")
        if any("hidden_mse" in r for r in train):
            axes[0].plot([r["step"] for r in train], [r.get("hidden_mse", float("nan")) for r in train], lw=1,
                         label="hidden-state MSE (inside the loss, × train.hidden_weight)")
            axes[0].legend()
    axes[0].set(xlabel="step", ylabel="loss", title="training loss")
    if evals:
        steps = [r["step"] for r in evals]
        axes[1].plot(steps, [r["alpha_greedy"] for r in evals], "o-", label="α greedy")
        axes[1].plot(steps, [r["alpha_t1"] for r in evals], "s-", label="α T=1")
        axes[1].legend()
    axes[1].set(xlabel="step", ylabel="acceptance", title="held-out MT-bench acceptance", ylim=(0, 1))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None, objective: str | None = None) -> int:
    import argparse

    from .config import load_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None)
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. train.lr=3e-4 draft.layers=[0,29]")
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if objective:
        overrides.append(f"train.objective={objective}")
    cfg = load_config(DistillConfig, args.config, overrides)
    result = run(cfg, resume=args.resume)
    print(json.dumps({k: v for k, v in result.items() if k != "sizes"}, indent=2))
    return 0
