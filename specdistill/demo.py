"""What ``make demo`` runs: the foundation check of the embedded default."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import torch

from .config import DemoConfig, cli_args, load_config, record_run
from .data import load_mtbench, load_sharegpt, split_records
from .models import build_draft, check_pair, load_model, load_tokenizer, size_report


def main(argv: list[str] | None = None) -> int:
    args = cli_args(argv, description=__doc__)
    cfg = load_config(DemoConfig, args.config, args.overrides)
    out = record_run(cfg.output_dir, cfg, seed=cfg.data.seed)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharegpt = load_sharegpt(max_records=cfg.data.max_records)
    for w in caught:
        print(f"warning: {w.message}")
    train, heldout = split_records(sharegpt.records, cfg.data.heldout_fraction, cfg.data.seed)
    print(f"ShareGPT: {sharegpt.summary()}")
    print(f"  split by conversation: {len(train):,} train / {len(heldout):,} held out")

    questions = load_mtbench()
    question = questions[cfg.question_index]
    print(f"MT-bench: {len(questions)} questions, {len({q['category'] for q in questions})} categories")

    t0 = time.perf_counter()
    tokenizer = load_tokenizer(cfg.target.path)
    target = load_model(cfg.target.path, cfg.target.dtype)
    print(f"target {cfg.target.path} loaded in {time.perf_counter() - t0:.1f} s ({cfg.target.dtype})")

    draft = build_draft(target.float() if cfg.target.dtype == "float32" else target, cfg.draft)
    check_pair(tokenizer, tokenizer, target.config, draft.config)
    sizes = size_report(draft, target)
    print(f"default draft: {draft.config.num_hidden_layers} layers, width {draft.config.hidden_size}, "
          f"{sizes['draft_params'] / 1e6:.1f}M params = {sizes['ratio_total']:.1%} of the target "
          f"({sizes['ratio_non_embedding']:.1%} without embeddings)")

    messages = [{"role": "user", "content": question["turns"][0]}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    t0 = time.perf_counter()
    with torch.inference_mode():
        output = target.generate(**inputs, max_new_tokens=cfg.max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
    new_tokens = output[0, inputs["input_ids"].shape[1]:]
    seconds = time.perf_counter() - t0
    reply = tokenizer.decode(new_tokens, skip_special_tokens=True)
    print(f"\nMT-bench #{question['question_id']} ({question['category']}): {question['turns'][0]}\n")
    print(f"target reply ({len(new_tokens)} tokens, {len(new_tokens) / seconds:.1f} tok/s):\n{reply}\n")
    (Path(out) / "demo.json").write_text(json.dumps({
        "sharegpt_complete_records": sharegpt.complete, "sharegpt_usable": len(sharegpt.records),
        "sharegpt_truncated_at": sharegpt.truncated_at, "draft_size": sizes,
        "question_id": question["question_id"], "reply": reply,
        "reply_tokens_per_s": len(new_tokens) / seconds,
    }, indent=2))
    print("This is all the demo does so far: the foundation (assets, data, draft builder) works;\n"
          "distillation, acceptance evaluation, speculative decoding and export are still to come.")
    print(f"run folder: {out}")
    return 0
