"""Side-by-side decode benchmark on the same prompts in one run (medians of tokens/s, and ratios).

    python scripts/bench_decode.py --target smollm2-135m --draft runs/quick/draft --prompts 8 --max-new-tokens 96

Rows: HF generate (target only), our target-only loop, HF generate(assistant_model=draft), ours greedy,
ours T=1. Greedy rows are checked token for token against the target-only loop.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdistill.data import load_mtbench
from specdistill.models import load_model, load_tokenizer
from specdistill.speculative import SpeculativeGenerator, target_only_generate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.target)
    target = load_model(args.target, args.dtype)
    draft = load_model(args.draft, args.dtype)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in load_mtbench()[: args.prompts]]
    eos = tokenizer.eos_token_id
    gen = SpeculativeGenerator(target, draft, gamma=args.gamma)
    confident = SpeculativeGenerator(target, draft, gamma=args.gamma, schedule="confidence", confidence=0.4)

    def hf(prompt, assistant=None):
        ids = torch.tensor([prompt])
        kwargs = {"assistant_model": assistant} if assistant is not None else {}
        if assistant is not None:
            assistant.generation_config.num_assistant_tokens = args.gamma
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                  do_sample=False, pad_token_id=eos, eos_token_id=eos, **kwargs)
        new = out[0, len(prompt):].tolist()
        return new, len(new) / (time.perf_counter() - t0)

    methods = {
        "HF generate (target only)": lambda p: hf(p),
        "ours target-only": lambda p: _run(target_only_generate(target, p, args.max_new_tokens, eos)),
        f"HF assisted (γ={args.gamma})": lambda p: hf(p, draft),
        f"ours speculative greedy (γ={args.gamma})": lambda p: _run(gen.generate(p, args.max_new_tokens, eos)),
        f"ours speculative greedy, confidence stop 0.4 (γ≤{args.gamma})":
            lambda p: _run(confident.generate(p, args.max_new_tokens, eos)),
        f"ours speculative T=1 (γ={args.gamma})": lambda p: _run(gen.generate(p, args.max_new_tokens, eos,
                                                                              temperature=1.0, seed=0)),
    }
    hf(prompts[0])  # warm-up
    rates = {name: [] for name in methods}
    identical = {name: True for name in methods}
    for prompt in prompts:
        reference, _ = _run(target_only_generate(target, prompt, args.max_new_tokens, eos))
        for name, method in methods.items():  # interleaved, so drift in machine speed hits every row alike
            tokens, rate = method(prompt)
            rates[name].append(rate)
            if "T=1" not in name:
                identical[name] &= tokens == reference
    base = statistics.median(rates["ours target-only"])
    hf_assisted = statistics.median(rates[f"HF assisted (γ={args.gamma})"])
    print(f"\n{len(prompts)} MT-bench prompts, {args.max_new_tokens} new tokens, {args.dtype}, batch 1\n")
    print("| method | median tok/s | vs ours target-only | vs HF assisted | greedy identical |")
    print("|---|---|---|---|---|")
    for name in methods:
        med = statistics.median(rates[name])
        same = "—" if "T=1" in name else ("yes" if identical[name] else "NO")
        print(f"| {name} | {med:.1f} | {med / base:.2f}× | {med / hf_assisted:.2f}× | {same} |")
    return 0


def _run(output):
    return output.tokens, output.stats["tokens_per_s"]


if __name__ == "__main__":
    sys.exit(main())
