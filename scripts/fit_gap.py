"""Underfitting or memorising? A draft's greedy agreement with the target on replies it trained on vs unseen ones.

    python scripts/fit_gap.py --config configs/smollm2-135m-quick.yaml --draft runs/quick/draft --rows 48

Teacher-forced on the target's own replies, the share of reply positions where the draft's argmax equals the
target's (greedy acceptance, position by position): on the first ``--rows`` replies of the generated set the
config trains on, and on ``--rows`` replies the target samples now, with the config's sampling, for
first-turn prompts of the held-out conversations (``data.heldout_fraction``), which no training set draws from. Low on both: the draft underfits (more or better steps help); high on the
first, lower on the second: it memorises (more data helps). ``eval.py``'s MT-bench α adds the shift to other
prompts and greedy decoding. Pass the overrides the draft was trained with, so the same generated set is read.
Writes ``fit_gap.json`` to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdistill.acceptance import token_acceptance
from specdistill.config import DistillConfig, load_config, record_run
from specdistill.data import (
    eos_token_ids,
    generated_dir,
    generated_to_training,
    load_conversations,
    load_generated,
    sharegpt_prompts,
    split_records,
)
from specdistill.models import load_model, load_tokenizer
from specdistill.speculative import target_only_generate_batch
from specdistill.trainer import logits_at_targets


def agreement(draft, rows: list[dict], target_logits: list[torch.Tensor], pad_id: int) -> tuple[float, int]:
    """Share of the rows' reply positions where the draft's argmax is the target's, and how many positions."""
    agree = [token_acceptance(p, q, 0.0) for p, q in zip(target_logits, logits_at_targets(draft, rows, pad_id))]
    total = sum(a.numel() for a in agree)
    return sum(float(a.sum()) for a in agree) / max(total, 1), total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/smollm2-135m-quick.yaml")
    parser.add_argument("--draft", action="append", required=True, help="a draft folder (repeatable)")
    parser.add_argument("--rows", type=int, default=48,
                        help="replies on each side (the target's fp32 logits there are kept: ≈ 1 GB per side at 48)")
    parser.add_argument("--max-prompt-tokens", type=int, default=100)
    parser.add_argument("--seed", type=int, default=123, help="shuffles the held-out prompts drawn for unseen replies")
    parser.add_argument("--out", type=Path, default=Path("runs/fit-gap"))
    parser.add_argument("overrides", nargs="*", help="key=value config overrides, as for distill.py")
    args = parser.parse_args(argv)
    if args.rows < 1:
        parser.error("--rows must be >= 1")
    cfg = load_config(DistillConfig, args.config, args.overrides)
    folder = generated_dir(cfg.target.path, cfg.generate, cfg.data)
    if not list(folder.glob("shard-*")):
        parser.error(f"no generated set at {folder}: run `python distill.py --config {args.config}` once first")
    record_run(args.out, {**vars(args), "out": str(args.out)})

    tokenizer = load_tokenizer(cfg.target.path)
    target = load_model(cfg.target.path, "float32").eval()
    generated = load_generated(folder)
    seen = list(generated_to_training(generated.select(range(min(args.rows, len(generated))))))
    _, heldout = split_records(load_conversations(cfg.data), cfg.data.heldout_fraction, cfg.data.seed)
    prompts = []
    for _, messages in sharegpt_prompts(heldout, len(heldout), 4 * args.max_prompt_tokens, seed=args.seed):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        if len(ids) <= args.max_prompt_tokens:
            prompts.append(list(ids))
        if len(prompts) == args.rows:
            break
    if not prompts:
        parser.error(f"no held-out conversation has a first turn of <= {args.max_prompt_tokens} tokens "
                     "(raise --max-prompt-tokens or data.heldout_fraction)")
    outputs = target_only_generate_batch(target, prompts, cfg.generate.max_new_tokens,
                                         eos_token_id=eos_token_ids(target, tokenizer),
                                         temperature=cfg.generate.temperature, top_p=cfg.generate.top_p, seed=0)
    unseen = [{"input_ids": p + out.tokens, "loss_mask": [0] * len(p) + [1] * len(out.tokens)}
              for p, out in zip(prompts, outputs) if out.tokens]
    pad_id = tokenizer.pad_token_id
    # The target's side once, for every draft: one forward per row instead of one per row and draft.
    seen_target, unseen_target = logits_at_targets(target, seen, pad_id), logits_at_targets(target, unseen, pad_id)

    results = {}
    for path in args.draft:
        draft = load_model(path, "float32").eval()
        on_seen, n_seen = agreement(draft, seen, seen_target, pad_id)
        on_unseen, n_unseen = agreement(draft, unseen, unseen_target, pad_id)
        results[path] = {"trained_replies": on_seen, "trained_positions": n_seen,
                         "unseen_replies": on_unseen, "unseen_positions": n_unseen}
        print(f"{path}: greedy agreement {on_seen:.3f} on {len(seen)} trained replies ({n_seen:,} positions), "
              f"{on_unseen:.3f} on {len(unseen)} unseen ({n_unseen:,})")
    (args.out / "fit_gap.json").write_text(json.dumps({"generated_set": str(folder), "drafts": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
