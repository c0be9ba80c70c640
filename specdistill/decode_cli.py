"""``decode.py``: speculative generation from the command line, streaming text, then its stats.

    python decode.py --target smollm2-135m --draft runs/quick/draft --prompt "Write a haiku about the sea."
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from .models import check_pair, load_draft, load_model, load_tokenizer
from .speculative import SamplingParams, SpeculativeGenerator, target_only_generate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--schedule", default="fixed", choices=["fixed", "heuristic", "confidence"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[],
                        help="stop once the text contains this string (repeatable); the output ends before it")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="both exact: in bfloat16 the target's verify rows are computed bit for bit as its one-token "
                             "steps (specdistill/kernels.py); faster than float32 on CPUs with AVX512-BF16, not on all "
                             "AMX ones (scripts/bench_decode.py --dtype both says which, docs/results.md)")
    parser.add_argument("--full-draft-vocab", action="store_true",
                        help="decode with the draft's full LM head, ignoring its draft_vocab.json")
    parser.add_argument("--compare", action="store_true", help="also run target-only decoding and report the ratio")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    tokenizer = load_tokenizer(args.target)
    target = load_model(args.target, args.dtype)
    draft = load_draft(args.draft, args.dtype, args.full_draft_vocab)
    check_pair(tokenizer, load_tokenizer(args.draft), target.config, draft.config)
    if args.raw:
        prompt_ids = tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
    else:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    gen = SpeculativeGenerator(target, draft, gamma=args.gamma, schedule=args.schedule)
    stats: dict = {}
    tokens: list[int] = []
    printed = ""
    params = SamplingParams(args.temperature, args.top_k, args.top_p)
    stopped = False
    start = time.perf_counter()
    for chunk in gen.stream(list(prompt_ids), args.max_new_tokens, tokenizer.eos_token_id, params, args.seed, stats):
        tokens += chunk
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        hits = [text.find(s, max(len(printed) - len(s), 0)) for s in args.stop]
        hits = [h for h in hits if h >= 0]
        if hits:
            text, stopped = text[: min(hits)], True
        sys.stdout.write(text[len(printed):])
        sys.stdout.flush()
        printed = text
        if stopped:  # the stream is abandoned mid-way, so its stats are those of the steps taken
            break
    seconds = time.perf_counter() - start
    accepted = stats["accepted"]
    summary = {"new_tokens": len(tokens), "target_calls": stats["target_calls"],
               "tau": round(len(tokens) / max(stats["target_calls"], 1), 3),
               "acceptance": round(sum(accepted) / max(sum(stats["drafted"]), 1), 3),
               "ttft_s": round(stats.get("ttft_s", 0.0), 4), "tokens_per_s": round(len(tokens) / seconds, 2),
               "stopped_at": "stop string" if stopped else ("EOS" if len(tokens) < args.max_new_tokens
                                                           else "max_new_tokens")}
    if args.compare:
        ref = target_only_generate(target, list(prompt_ids), args.max_new_tokens, tokenizer.eos_token_id,
                                   args.temperature, args.top_k, args.top_p, args.seed)
        summary["target_only_tokens_per_s"] = round(ref.stats["tokens_per_s"], 2)
        summary["speedup"] = round(summary["tokens_per_s"] / ref.stats["tokens_per_s"], 3)
        if params.greedy:  # compare the same text span: a stop string cuts ours short
            summary["greedy_identical"] = ref.tokens[: len(tokens)] == tokens
    print("\n\n" + json.dumps(summary, indent=2))
    return 0
