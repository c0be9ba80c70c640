"""Side-by-side decode benchmark on the same prompts in one run (medians of tokens/s, and ratios).

    python scripts/bench_decode.py --target smollm2-135m --draft runs/quick/draft --prompts 8 --max-new-tokens 96

Rows: HF generate (target only), our target-only loop, HF generate(assistant_model=draft) (batch 1 only),
ours greedy with each draft-length schedule, ours T=1. Greedy rows are checked token for token against our
target-only loop. ``--batch 8`` decodes 8 prompts together (per-row acceptance). A draft with a
``draft_vocab.json`` runs our rows with its reduced head (``models.ReducedHeadDraft``); one more greedy row runs
it with the full head, side by side (``--full-draft-vocab``: full head everywhere). HF assisted always gets the
plain draft.

``--dtype both`` runs every row in fp32 and in bf16, one target and draft per dtype, interleaved per batch, and
reports each row against the fastest target-only loop of the run (HF's or ours, either dtype): on a CPU with
native bf16 that is HF ``generate`` in bf16, the baseline a speedup claim has to beat. Each dtype's greedy rows
are checked against that dtype's target-only loop: bf16 is exact too (``specdistill.kernels``, row-invariant).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdistill.config import record_run
from specdistill.data import load_mtbench
from specdistill.models import ReducedHeadDraft, load_draft, load_model, load_tokenizer, unwrap_draft
from specdistill.speculative import SpeculativeGenerator, target_only_generate_batch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1, help="rows decoded together (HF assisted needs 1)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "both"])
    parser.add_argument("--full-draft-vocab", action="store_true", help="ignore the draft's draft_vocab.json")
    parser.add_argument("--out", default=None, help="folder for bench.json / bench.md (scripts/results.py reads it)")
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.target)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in load_mtbench()[: args.prompts]]
    groups = [prompts[i: i + args.batch] for i in range(0, len(prompts), args.batch)]
    eos = tokenizer.eos_token_id
    new = args.max_new_tokens
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    methods, references = {}, {}
    for dtype in dtypes:
        label = {"float32": "fp32 ", "bfloat16": "bf16 "}[dtype] if len(dtypes) > 1 else ""
        dtype_methods, references[label] = _methods(args, load_model(args.target, dtype),
                                                    load_draft(args.draft, dtype, args.full_draft_vocab), eos, new)
        methods.update({label + name: (label, method) for name, method in dtype_methods.items()})
    for label in references:  # warm-up, each dtype
        methods[label + "HF generate (target only)"][1](groups[0][:1])
    rates = {name: [] for name in methods}
    identical = {name: True for name in methods}
    for group in tqdm(groups, desc="bench", unit="batch"):
        reference = {label: decode(group) for label, decode in references.items()}
        for name, (label, method) in methods.items():  # interleaved: drift in machine speed hits every row alike
            tokens, rate = method(group)
            rates[name].append(rate)
            if "T=1" not in name:
                identical[name] &= tokens == reference[label]
    median = {name: statistics.median(r) for name, r in rates.items()}
    hf_name = f"HF assisted (γ={args.gamma})" if args.batch == 1 else "HF generate (target only)"
    best = max((name for name in methods if "target only" in name or name.endswith("ours target-only")),
               key=median.get)
    title = (f"{len(prompts)} MT-bench prompts, {new} new tokens, {args.dtype}, batch {args.batch} "
             f"(tok/s = new tokens of a batch / its wall time; medians over {len(groups)} batches; "
             f"fastest target-only loop: {best})")
    lines = [f"| method | median tok/s | vs ours target-only | vs {hf_name} | vs fastest target-only | greedy identical |",
             "|---|---|---|---|---|---|"]
    rows = []
    for name, (label, _) in methods.items():
        med = median[name]
        base, hf_base = median[label + "ours target-only"], median[label + hf_name]
        same = "—" if "T=1" in name else ("yes" if identical[name] else "NO")
        rows.append({"method": name, "median_tokens_per_s": med, "vs_target_only": med / base,
                     "vs_hf": med / hf_base, "vs_best_target_only": med / median[best],
                     "greedy_identical": None if "T=1" in name else identical[name]})
        lines.append(f"| {name} | {med:.1f} | {med / base:.2f}× | {med / hf_base:.2f}× | {med / median[best]:.2f}× | "
                     f"{same} |")
    print(f"\n{title}\n\n" + "\n".join(lines))
    if args.out:
        out = record_run(args.out, vars(args))
        command = "python scripts/bench_decode.py " + " ".join(sys.argv[1:])
        (out / "bench.json").write_text(json.dumps({"title": title, "command": command, "hf_baseline": hf_name,
                                                    "args": vars(args), "rows": rows}, indent=2))
        (out / "bench.md").write_text(f"{title}\n\n`{command}`\n\n" + "\n".join(lines) + "\n")
    return 0


def _methods(args, target, draft, eos: int, new: int) -> tuple[dict, object]:
    """This dtype's rows (name → batch → (tokens, tok/s)) and its target-only reference decoder."""
    reduced = isinstance(draft, ReducedHeadDraft)
    gen = SpeculativeGenerator(target, draft, gamma=args.gamma)
    heuristic = SpeculativeGenerator(target, draft, gamma=args.gamma, schedule="heuristic")
    confident = SpeculativeGenerator(target, draft, gamma=args.gamma, schedule="confidence", confidence=0.4)

    def hf(group, assistant=None):
        width = max(len(p) for p in group)
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        kwargs = {"assistant_model": assistant} if assistant is not None else {}
        if assistant is not None:
            assistant.generation_config.num_assistant_tokens = args.gamma
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                  pad_token_id=eos, eos_token_id=eos, **kwargs)
        rows = [_until_eos(row[width:].tolist(), eos) for row in out]
        return rows, sum(map(len, rows)) / (time.perf_counter() - t0)

    def timed(fn):
        def run(group):
            t0 = time.perf_counter()
            rows = [o.tokens for o in fn(group)]
            return rows, sum(map(len, rows)) / (time.perf_counter() - t0)
        return run

    methods = {
        "HF generate (target only)": hf,
        "ours target-only": timed(lambda g: target_only_generate_batch(target, g, new, eos)),
    }
    if args.batch == 1:  # transformers' assisted generation only supports one row
        methods[f"HF assisted (γ={args.gamma})"] = lambda g: hf(g, unwrap_draft(draft))
    head = f", draft head of {draft.token_ids.numel():,} tokens" if reduced else ""
    methods[f"ours speculative greedy (γ={args.gamma}){head}"] = timed(lambda g: gen.generate_batch(g, new, eos))
    if reduced:
        full = SpeculativeGenerator(target, unwrap_draft(draft), gamma=args.gamma)
        methods[f"ours speculative greedy (γ={args.gamma}), full draft head"] = timed(
            lambda g: full.generate_batch(g, new, eos))
    methods.update({
        f"ours speculative greedy, heuristic schedule (γ₀={args.gamma})":
            timed(lambda g: heuristic.generate_batch(g, new, eos)),
        f"ours speculative greedy, confidence stop 0.4 (γ≤{args.gamma})":
            timed(lambda g: confident.generate_batch(g, new, eos)),
        f"ours speculative T=1 (γ={args.gamma})": timed(lambda g: gen.generate_batch(g, new, eos, temperature=1.0,
                                                                                     seed=0)),
    })
    return methods, lambda group: [o.tokens for o in target_only_generate_batch(target, group, new, eos)]


def _until_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


if __name__ == "__main__":
    sys.exit(main())
