"""Target-generated data: HF ``generate`` vs our batched loop, same prompts, same sampling, one run.

    python scripts/bench_generate.py --target smollm2-135m --batch 64 --max-new-tokens 64 --repeats 3

Both sample the target's warped distribution (temperature, top-p) from the same left-aligned batch of
ShareGPT first-turn prompts; every row generates exactly ``--max-new-tokens`` tokens (EOS ignored) so both
do the same work. Reports median tokens/s over ``--repeats`` and the ratio; ``--record-top-k`` (default 64)
adds our loop keeping the target's top-k log-probs per token, the cost of ``generate.teacher_top_k``.

    python scripts/bench_generate.py --compare-batches 64,128,256 --max-new-tokens 64 --repeats 2

instead times our loop alone (with the top-k capture) over one set of as many prompts as the largest batch
(``--prompts`` for more), sorted by length and cut into batches of each size as ``data.generate_responses``
does: which ``generate.batch_size`` makes data fastest on this machine. ``--eos`` stops rows at EOS, as real
data generation does, so short replies leave their batch early and tokens/s counts the tokens made.

    python scripts/bench_generate.py --compare-batches 64,32 --prompts 128 --eos --max-new-tokens 128 --repeats 2

``--compare-mid-rows`` does the same at one batch size (``--compare-batches``' first) for each given rule
of ``kernels.MID_ROWS``, the row counts at which a mid-sized weight takes ``W @ xᵀ`` instead of ``F.linear``
(``;`` between rules, ``-`` for ranges): the end-to-end effect of a kernel rule on data generation.

    python scripts/bench_generate.py --compare-batches 32 --compare-mid-rows "2-4;2-4,16-64" --prompts 128 \
        --eos --max-new-tokens 128 --repeats 2

``--compare-active-rows`` does it at one batch size for each ``generate.max_active_rows`` (0: one batch at a
time; else batches join a running pool of up to that many rows as finished rows leave), as
``data.generate_responses`` streams them:

    python scripts/bench_generate.py --compare-batches 32 --compare-active-rows 0,64,128 --prompts 256 \
        --eos --max-new-tokens 128 --repeats 1

``--compare-attention-chunks`` does it for each ``speculative.POOL_ATTENTION_CHUNK`` (rows per attention call in a
pool's decode step, each call over only its rows' slots; 0: one call over the whole cache, holes included):

    python scripts/bench_generate.py --compare-batches 32 --compare-active-rows 128 --compare-attention-chunks \
        0,8,16,32 --prompts 192 --eos --max-new-tokens 128 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdistill import kernels, speculative
from specdistill.config import record_run
from specdistill.data import eos_token_ids, load_sharegpt, sharegpt_prompts
from specdistill.models import load_model, load_tokenizer
from specdistill.precision import resolve_dtype
from specdistill.speculative import target_generate_stream, target_only_generate_batch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="auto: bfloat16 where the hardware has native bf16 matmuls, else float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--record-top-k", type=int, default=64,
                        help="also time our loop while it keeps the target's top-k log-probs "
                             "(generate.teacher_top_k); 0 skips it")
    parser.add_argument("--compare-batches", default="",
                        help="comma-separated batch sizes: time our loop at each on the same prompts instead")
    parser.add_argument("--prompts", type=int, default=0,
                        help="--compare-batches: how many prompts (default: the largest batch size)")
    parser.add_argument("--eos", action="store_true",
                        help="--compare-batches: stop rows at EOS as data generation does (default: every row "
                             "makes --max-new-tokens)")
    parser.add_argument("--compare-mid-rows", default="",
                        help="--compare-batches: kernels.MID_ROWS rules to time at its first batch size, e.g. "
                             "'2-4;2-4,16-64'")
    parser.add_argument("--compare-active-rows", default="",
                        help="--compare-batches: generate.max_active_rows values to time at its first batch size, "
                             "e.g. '0,64,128'")
    parser.add_argument("--compare-attention-chunks", default="",
                        help="--compare-batches: speculative.POOL_ATTENTION_CHUNK values (rows per attention call "
                             "in a decode step; 0 = one call over the whole cache) to time at its first batch size "
                             "and the first --compare-active-rows value (default 128), e.g. '0,16'")
    parser.add_argument("--out", default=None, help="folder for bench_generate.json")
    args = parser.parse_args()
    args.dtype = resolve_dtype(args.dtype)  # the report names the dtype that ran
    if args.compare_batches:
        return compare_batches(args)

    tokenizer = load_tokenizer(args.target)
    model = load_model(args.target, args.dtype)
    prompts = load_prompts(tokenizer, args.batch, args.max_prompt_tokens)
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    new = args.max_new_tokens
    sampling = {"temperature": args.temperature, "top_p": args.top_p}

    def hf():
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           pad_token_id=pad, do_sample=True, top_k=0, **sampling)

    def ours(record_top_k: int = 0):
        target_only_generate_batch(model, prompts, new, eos_token_id=None, seed=0, record_top_k=record_top_k,
                                   **sampling)

    capture = f"ours + top-{args.record_top_k}"
    runs = [("HF generate", hf), ("ours", ours)]
    if args.record_top_k:
        runs.append((capture, lambda: ours(args.record_top_k)))
    rates = {name: [] for name, _ in runs}
    for _ in range(args.repeats):  # interleaved, so drift hits all alike
        for name, fn in runs:
            start = time.perf_counter()
            fn()
            rates[name].append(len(prompts) * new / (time.perf_counter() - start))
    medians = {name: statistics.median(r) for name, r in rates.items()}
    result = {"batch": len(prompts), "prompt_tokens_max": width, "max_new_tokens": new, "dtype": args.dtype,
              **sampling, "tokens_per_s": medians, "runs": rates,
              "ratio_ours_vs_hf": medians["ours"] / medians["HF generate"]}
    if args.record_top_k:
        result["ratio_teacher_capture_vs_ours"] = medians[capture] / medians["ours"]
    print(f"batch {len(prompts)} (prompts ≤ {width} tokens), {new} new tokens, {args.dtype}, "
          f"T={args.temperature} top-p={args.top_p}, median of {args.repeats}:")
    for name, rate in medians.items():
        print(f"  {name:12s} {rate:7.1f} tok/s")
    print(f"  ours / HF generate: {result['ratio_ours_vs_hf']:.2f}×")
    if args.record_top_k:
        print(f"  with top-{args.record_top_k} capture / without: {result['ratio_teacher_capture_vs_ours']:.2f}×")
    if args.out:
        out = record_run(Path(args.out), vars(args))
        (out / "bench_generate.json").write_text(json.dumps(result, indent=2))
    return 0


def load_prompts(tokenizer, n: int, max_prompt_tokens: int) -> list[list[int]]:
    prompts = []
    for _, messages in sharegpt_prompts(load_sharegpt().records, 4 * n, max_prompt_tokens * 3):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        if len(ids) <= max_prompt_tokens:
            prompts.append(list(ids))
    return sorted(prompts[:n], key=len)  # as data.generate_responses batches them


def parse_rows(spec: str) -> frozenset[int]:
    """'2-4,16-64' -> {2, 3, 4, 16, ..., 64}."""
    rows = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        low, _, high = part.partition("-")
        rows.update(range(int(low), int(high or low) + 1))
    return frozenset(rows)


def compare_batches(args) -> int:
    sizes = [int(b) for b in args.compare_batches.split(",")]
    rules = [r.strip() for r in args.compare_mid_rows.split(";") if r.strip()]
    active = [int(a) for a in args.compare_active_rows.split(",") if a.strip()]
    chunks = [int(c) for c in args.compare_attention_chunks.split(",") if c.strip()]
    default_rows, default_chunk = kernels.MID_ROWS, speculative.POOL_ATTENTION_CHUNK
    # (label, batch size, kernels.MID_ROWS while it runs, max_active_rows, POOL_ATTENTION_CHUNK)
    if rules:
        variants = [(f"batch {sizes[0]}, mid rows {rule}", sizes[0], parse_rows(rule), 0, default_chunk)
                    for rule in rules]
    elif chunks:
        pool = active[0] if active else 128
        variants = [(f"batch {sizes[0]}, pool {pool}, attention chunk {c}", sizes[0], kernels.MID_ROWS, pool, c)
                    for c in chunks]
    elif active:
        variants = [(f"batch {sizes[0]}, active rows {rows or sizes[0]}", sizes[0], kernels.MID_ROWS, rows,
                     default_chunk) for rows in active]
    else:
        variants = [(f"batch {size}", size, kernels.MID_ROWS, 0, default_chunk) for size in sizes]
    tokenizer = load_tokenizer(args.target)
    model = load_model(args.target, args.dtype)
    prompts = load_prompts(tokenizer, args.prompts or max(sizes), args.max_prompt_tokens)
    new = args.max_new_tokens
    eos = eos_token_ids(model, tokenizer) if args.eos else None
    # Warm-up, so the first variant timed does not pay for the first call's one-off costs.
    target_only_generate_batch(model, prompts[: min(sizes)], 4, eos_token_id=None, seed=0,
                               temperature=args.temperature, top_p=args.top_p, record_top_k=args.record_top_k)
    rates = {label: [] for label, *_ in variants}
    try:
        for _ in range(args.repeats):  # interleaved, so drift hits all variants alike
            for label, size, mid_rows, active_rows, chunk in variants:
                kernels.MID_ROWS, speculative.POOL_ATTENTION_CHUNK = mid_rows, chunk
                start, made = time.perf_counter(), 0
                batches = [(i, prompts[i: i + size]) for i in range(0, len(prompts), size)]
                random.Random(0).shuffle(batches)  # as data.generate_responses orders them
                for _, outputs in target_generate_stream(model, batches, max(active_rows, size), new,
                                                         eos_token_id=eos, temperature=args.temperature,
                                                         top_p=args.top_p, record_top_k=args.record_top_k):
                    made += sum(len(out.tokens) for out in outputs)
                rates[label].append(made / (time.perf_counter() - start))
    finally:
        kernels.MID_ROWS, speculative.POOL_ATTENTION_CHUNK = default_rows, default_chunk
    medians = {label: statistics.median(r) for label, r in rates.items()}
    first = variants[0][0]
    result = {"prompts": len(prompts), "max_new_tokens": new, "eos": args.eos, "dtype": args.dtype,
              "record_top_k": args.record_top_k,
              "tokens_per_s": medians, "runs": rates,
              "ratio_vs_first": {label: medians[label] / medians[first] for label in medians}}
    stop = " (EOS stops a row)" if args.eos else ""
    print(f"{len(prompts)} prompts, {new} new tokens{stop}, {args.dtype}, top-{args.record_top_k} capture, "
          f"median of {args.repeats}:")
    for label, rate in medians.items():
        print(f"  {label:30s}: {rate:7.1f} tok/s ({result['ratio_vs_first'][label]:.2f}× {first})")
    if args.out:
        out = record_run(Path(args.out), vars(args))
        (out / "bench_generate.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
