"""fp32 vs bf16 on this machine, side by side in one run: the evidence behind ``dtype: auto`` / ``train.bf16: auto``.

    python scripts/bench_precision.py --config configs/smollm2-135m-quick.yaml --batch 64 --new-tokens 32

Times, alternately (so machine drift hits both alike), medians over ``--repeats``:
  * target generation: our batched loop (``target_only_generate_batch``, top-k teacher capture on, as
    ``data.generate_responses`` runs it) with the target loaded in float32 and in bfloat16;
  * one distillation step of the preset's draft (forward, FKL on a stored-style top-k teacher, backward,
    AdamW) in float32 and under bf16 autocast, on a fixed batch of ShareGPT-length random tokens.
Prints tokens/s and steps/s, the bf16/fp32 ratios, the hardware flags and what ``auto`` picks here.
Writes ``bench_precision.json`` to --out.
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
from specdistill.data import load_sharegpt, sharegpt_prompts
from specdistill.losses import distill_loss
from specdistill.models import build_draft, load_model, load_tokenizer
from specdistill.precision import bf16_is_fast, hardware, resolve_dtype
from specdistill.speculative import target_only_generate_batch

DTYPES = ("float32", "bfloat16")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/smollm2-135m-quick.yaml")
    parser.add_argument("--batch", type=int, default=64, help="generation batch (the presets' generate.batch_size)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=0, help="training rows' length (0 = the preset's train.seq_len)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-precision"))
    args = parser.parse_args()
    cfg = load_config(DistillConfig, args.config)
    tc, gen = cfg.train, cfg.generate
    record_run(args.out, {**vars(args), "out": str(args.out)})

    tokenizer = load_tokenizer(cfg.target.path)
    prompts = []
    for _, messages in sharegpt_prompts(load_sharegpt(max_records=4000).records, 4 * args.batch,
                                        gen.max_prompt_tokens * 3):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        if len(ids) <= gen.max_prompt_tokens:
            prompts.append(list(ids))
    prompts = sorted(prompts[: args.batch], key=len)
    targets = {name: load_model(cfg.target.path, name) for name in DTYPES}

    def generate(name: str) -> float:
        start = time.perf_counter()
        target_only_generate_batch(targets[name], prompts, args.new_tokens, eos_token_id=None, seed=0,
                                   temperature=gen.temperature, top_p=gen.top_p,
                                   record_top_k=gen.teacher_top_k or 64)
        return len(prompts) * args.new_tokens / (time.perf_counter() - start)

    draft = build_draft(targets["float32"], cfg.draft).train()
    head = draft.get_output_embeddings().weight
    body = getattr(draft, draft.base_model_prefix)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=tc.lr, betas=(0.9, 0.95))
    gen_rng = torch.Generator().manual_seed(0)
    vocab, k = head.shape[0], tc.cache_top_k
    ids = torch.randint(0, vocab, (tc.batch_size, args.seq_len or tc.seq_len), generator=gen_rng)
    labels = ids[:, 1:].reshape(-1)
    teacher_ids = torch.randint(0, vocab, (labels.numel(), k), generator=gen_rng)
    teacher_logp = torch.log_softmax(torch.randn(labels.numel(), k, generator=gen_rng), -1)

    def train_step(name: str) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name == "bfloat16"):
            hidden = body(input_ids=ids).last_hidden_state[:, :-1].reshape(-1, head.shape[1])
            loss = distill_loss(hidden, head, (teacher_ids, teacher_logp), labels, "fkl", tc.beta, 1.0, 0.0,
                                tc.chunk_size) / labels.numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return 1.0 / (time.perf_counter() - start)

    for name in DTYPES:  # warm-up: first calls pay one-off costs
        target_only_generate_batch(targets[name], prompts[:4], 2, eos_token_id=None, seed=0)
        print(f"  warm-up train step {name}: {1 / train_step(name):.1f} s", flush=True)
    rates = {f"{what} {name}": [] for what in ("generate", "train") for name in DTYPES}
    for _ in range(args.repeats):
        for name in DTYPES:
            for what, fn in (("generate", generate), ("train", train_step)):
                rates[f"{what} {name}"].append(fn(name))
                print(f"  {what} {name}: {rates[f'{what} {name}'][-1]:.3g}/s", flush=True)
    medians = {key: statistics.median(values) for key, values in rates.items()}
    ratios = {what: medians[f"{what} bfloat16"] / medians[f"{what} float32"] for what in ("generate", "train")}
    result = {"hardware": hardware(), "bf16_is_fast": bf16_is_fast(), "auto_picks": resolve_dtype("auto"),
              "batch": len(prompts), "new_tokens": args.new_tokens, "train_batch": list(ids.shape),
              "medians": medians, "bf16_over_fp32": ratios, "runs": rates}
    print(f"hardware {hardware()}; auto picks {result['auto_picks']}. Medians of {args.repeats}:")
    print(f"  generation, batch {len(prompts)} × {args.new_tokens} new tokens: fp32 {medians['generate float32']:.1f} "
          f"tok/s, bf16 {medians['generate bfloat16']:.1f} tok/s → bf16/fp32 {ratios['generate']:.2f}×")
    print(f"  distillation step, {ids.shape[0]} × {ids.shape[1]} tokens: fp32 {1 / medians['train float32']:.2f} s, "
          f"bf16 autocast {1 / medians['train bfloat16']:.2f} s → bf16/fp32 {ratios['train']:.2f}× steps/s")
    (args.out / "bench_precision.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
