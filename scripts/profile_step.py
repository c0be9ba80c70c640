"""Where one distillation step's time goes: the real draft, the stored teacher, the trainer's own functions.

    python scripts/profile_step.py --config configs/smollm2-135m-quick.yaml --steps 12 --vocab 16384,8192

Per step, medians after 2 warm-up steps: collation (Arrow rows -> tensors), the draft body's forward, the
LM head + loss forward, the backward, the optimiser step (AdamW, as in training) — with the softmax over the
full vocabulary, then for each ``--vocab N`` over ``train.head_vocab=N``'s support (the N most frequent reply
tokens, the step's labels and ``train.head_negatives`` random ones), exactly as the trainer builds it.
With ``train.hidden_weight`` (the quick preset) the step includes the hidden-state term as the trainer computes it:
the stored states are gathered in collation, the map and its MSE count in the head + loss phase.
Needs the generated set the preset trains on
(``train.data_mode=cache``): run the preset or ``make demo`` once first. Writes ``profile.json`` to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdistill.config import DistillConfig, load_config, record_run
from specdistill.data import generated_dir, generated_to_teacher_rows, load_generated
from specdistill.losses import distill_loss
from specdistill.models import build_draft, load_model, load_tokenizer
from specdistill.trainer import (
    DraftLoss,
    frequent_tokens,
    hidden_matching,
    micro_batch_rows,
    pad_batch,
    row_lengths,
    step_vocab,
    stored_teacher,
)

PHASES = ("collate", "body_forward", "head_loss_forward", "backward", "optimizer")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/smollm2-135m-quick.yaml")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--vocab", default="16384,8192", help="train.head_vocab values to time after the full softmax")
    parser.add_argument("--out", type=Path, default=Path("runs/profile-step"))
    parser.add_argument("overrides", nargs="*", help="key=value config overrides, as for distill.py")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be >= 3 (2 are warm-up)")
    cfg = load_config(DistillConfig, args.config, args.overrides)
    tc = cfg.train
    if tc.data_mode != "cache" or not cfg.generate.teacher_top_k:
        parser.error("profiles the stored-teacher recipe: needs train.data_mode=cache and generate.teacher_top_k > 0")
    folder = generated_dir(cfg.target.path, cfg.generate, cfg.data)
    if not list(folder.glob("shard-*")):
        parser.error(f"no generated set at {folder}: run `python distill.py --config {args.config}` once first")
    record_run(args.out, {**vars(args), "out": str(args.out)})

    target = load_model(cfg.target.path, cfg.target.dtype)
    draft = build_draft(target, cfg.draft)
    target_depth = target.config.num_hidden_layers
    del target
    rows = generated_to_teacher_rows(load_generated(folder), tc.seq_len, tc.cache_top_k, tc.prompt_loss,
                                     hidden=bool(tc.hidden_weight))
    match = states = None
    if tc.hidden_weight:
        rows, states, bounds, match = hidden_matching(rows, draft.config.num_hidden_layers,
                                                      cfg.generate.teacher_hidden_layer, target_depth)
    module = DraftLoss(draft, match).train()
    body = getattr(draft, draft.base_model_prefix)
    head = draft.get_output_embeddings().weight
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=tc.lr,
                                  weight_decay=tc.weight_decay, betas=(0.9, 0.95))
    full_vocab = head.shape[0]
    vocabs = [0] + [int(v) for v in args.vocab.split(",") if v and int(v) < full_vocab]  # 0: the full softmax
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=tc.bf16)
    report = {"config": args.config, "overrides": args.overrides, "steps": args.steps, "rows": len(rows),
              "batch_size": tc.batch_size, "bf16": tc.bf16, "hidden_weight": tc.hidden_weight, "results": []}
    pad_id = load_tokenizer(cfg.target.path).pad_token_id
    lengths = row_lengths(rows, tc)
    for vocab in vocabs:
        frequent = frequent_tokens(rows, vocab)[0] if vocab else None
        times = {phase: [] for phase in PHASES}
        loss_tokens, support = [], []
        for step in range(args.steps):  # the same batches for every head size
            t0 = time.perf_counter()
            indices = micro_batch_rows(step, 0, tc, 1, 0, len(rows), lengths)
            batch_rows = [rows[i] for i in indices]
            batch = pad_batch(batch_rows, tc.seq_len, pad_id)
            ids, logp = stored_teacher(batch_rows, tc.cache_top_k)
            if match is not None:
                teacher_hidden = torch.cat([states[bounds[i]: bounds[i + 1]] for i in indices])
            vocab_ids = None if frequent is None else step_vocab(frequent, batch["labels"], tc.head_negatives,
                                                                 full_vocab, step)
            t1 = time.perf_counter()
            with autocast:
                out = body(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           output_hidden_states=match is not None)
                t2 = time.perf_counter()
                selected = out.last_hidden_state[:, :-1][batch["select"]]
                loss = distill_loss(selected, head, (ids, logp), batch["labels"], tc.loss, tc.beta,
                                    tc.temperature, tc.ce_weight, tc.chunk_size, vocab_ids)
                if match is not None:  # as DraftLoss.forward adds it
                    loss = loss + tc.hidden_weight * module.hidden_term(out.hidden_states, batch["select"],
                                                                        teacher_hidden)
                loss = loss / max(int(batch["select"].sum()), 1)
            t3 = time.perf_counter()
            loss.backward()
            t4 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(module.parameters(), tc.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t5 = time.perf_counter()
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                times[phase].append(seconds)
            loss_tokens.append(int(batch["select"].sum()))
            support.append(full_vocab if vocab_ids is None else vocab_ids.numel())
        medians = {phase: statistics.median(values[2:]) for phase, values in times.items()}
        total = sum(medians.values())
        report["results"].append({"head_vocab": vocab, "median_softmax_size": statistics.median(support),
                                  "median_s": medians, "step_s": total,
                                  "median_loss_tokens": statistics.median(loss_tokens)})
        print(f"train.head_vocab={vocab:>5} (softmax over {statistics.median(support):>6.0f} tokens): "
              f"step {total:.3f} s = " +
              ", ".join(f"{phase} {medians[phase]:.3f}" for phase in PHASES))
    base = report["results"][0]["step_s"]
    for row in report["results"][1:]:
        print(f"train.head_vocab={row['head_vocab']}: {base / row['step_s']:.2f}× the full softmax's steps per second")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
