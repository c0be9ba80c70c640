"""Draft-size × γ grid search: choose the draft's size and the draft length by experiment.

    python scripts/sweep.py --config configs/smollm2-135m-quick-ce.yaml --sizes 2x256,4x384,6x448,8x512 \
        --gammas 1..10 --out runs/sweep train.max_minutes=5

Each size (layers × width) is trained with the same recipe and budget (the config plus the trailing
overrides), then measured on the same prompts: α, τ(γ) and the cost ratio c from ``eval.py``, the expected
speedup τ/(γc + v(γ)), and the measured greedy speedup of our speculative decoder over our target-only loop
(median over ``--measure-prompts`` prompts). Writes ``sweep.json``, ``sweep.md`` (one table) and
``sweep.png`` (heatmaps of expected and measured speedup) and names the best setting.

Resumable: a size whose run folder holds ``draft/`` is not retrained (an interrupted one resumes from its
newest checkpoint), acceptance is re-evaluated only when the set of drafts changed, and every measured cell
already in ``sweep.json`` is kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdistill import evaluation
from specdistill.config import DistillConfig, load_config, record_run
from specdistill.models import load_draft, load_model, load_tokenizer
from specdistill.speculative import SpeculativeGenerator, target_only_generate
from specdistill.trainer import run as train_run


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for item in text.split(","):
        try:
            layers, width = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--sizes: '{item}' is not LAYERSxWIDTH (e.g. 4x384)") from None
        sizes.append((layers, width))
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--sizes", default="2x256,4x384,6x448,8x512", help="LAYERSxWIDTH, comma-separated")
    parser.add_argument("--gammas", default="1..10")
    parser.add_argument("--prompts", default="mtbench")
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--measure-prompts", type=int, default=3, help="prompts per cell for measured speedup")
    parser.add_argument("--measure-tokens", type=int, default=64)
    parser.add_argument("--out", default="runs/sweep")
    parser.add_argument("overrides", nargs="*", help="key=value overrides applied to every size's run")
    args = parser.parse_args(argv)
    out = Path(args.out)
    record_run(out, vars(args))
    gammas = evaluation.parse_gammas(args.gammas)

    drafts = {}
    for layers, width in parse_sizes(args.sizes):
        tag = f"{layers}x{width}"
        run_dir = out / f"size-{tag}"
        cfg = load_config(DistillConfig, args.config, [*args.overrides, f"draft.num_layers={layers}",
                                                       f"draft.hidden_size={width}", f"output_dir={run_dir}"])
        if not (run_dir / "draft").is_dir():
            print(f"== train {tag}")
            train_run(cfg, resume=(run_dir / "checkpoints").is_dir())
        drafts[tag] = str(run_dir / "draft")
    target_path, dtype = cfg.target.path, "float32"

    eval_dir = out / "eval"
    metrics = eval_dir / "metrics.json"
    if not metrics.is_file() or set(json.loads(metrics.read_text())["drafts"]) != set(drafts):
        print("== acceptance of every size on the same prompts")
        eval_args = ["--target", target_path, "--prompts", args.prompts, "--num-prompts", str(args.num_prompts),
                     "--max-new-tokens", str(args.max_new_tokens), "--gamma", args.gammas, "--temperatures", "0,1",
                     "--output-dir", str(eval_dir)]
        for tag, path in drafts.items():
            eval_args += ["--draft", path, "--name", tag]
        evaluation.main(eval_args)
    report = json.loads(metrics.read_text())

    state_path = out / "sweep.json"
    state = json.loads(state_path.read_text()) if state_path.is_file() else {"measured": {}}
    tokenizer = load_tokenizer(target_path)
    target = load_model(target_path, dtype)
    prompts = [tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
               for _, _, messages in evaluation.load_prompts(args.prompts, args.measure_prompts)]
    eos = tokenizer.eos_token_id
    references = None
    for tag, path in drafts.items():
        todo = [g for g in gammas if f"{tag}/{g}" not in state["measured"]]
        if not todo:
            continue
        draft = load_draft(path, dtype)
        if references is None:  # target-only runs once per prompt, next to the first cells measured
            references = [target_only_generate(target, p, args.measure_tokens, eos) for p in prompts]
        for g in todo:
            gen = SpeculativeGenerator(target, draft, gamma=g)
            ratios, identical = [], True
            for prompt, ref in zip(prompts, references):
                spec = gen.generate(prompt, args.measure_tokens, eos)
                ratios.append(spec.stats["tokens_per_s"] / ref.stats["tokens_per_s"])
                identical &= spec.tokens == ref.tokens
            state["measured"][f"{tag}/{g}"] = {"speedup": statistics.median(ratios), "greedy_identical": identical}
            state_path.write_text(json.dumps(state, indent=2))  # after every cell: a killed sweep loses one
            print(f"{tag} γ={g}: measured {statistics.median(ratios):.2f}× (identical: {identical})")

    rows = []
    for tag in drafts:
        d = report["drafts"][tag]
        for g in gammas:
            rows.append({"size": tag, "ratio": d["sizes"]["ratio_total"], "gamma": g, "alpha": d["alpha"]["0"],
                         "alpha_t1": d["alpha"].get("1"), "tau": d["tau"][f"0/{g}"], "c": d["cost_ratio"],
                         "expected": d["expected_speedup"][f"0/{g}"],
                         "measured": state["measured"][f"{tag}/{g}"]["speedup"],
                         "greedy_identical": state["measured"][f"{tag}/{g}"]["greedy_identical"]})
    best = max(rows, key=lambda r: r["measured"])
    state.update(rows=rows, best=best)
    state_path.write_text(json.dumps(state, indent=2))
    table = ["| size | % of target | α greedy | α T=1 | c | γ | τ | expected | measured | identical |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['size']} | {r['ratio']:.1%} | {r['alpha']:.3f} | {r['alpha_t1']:.3f} | {r['c']:.3f} | {r['gamma']} "
              f"| {r['tau']:.2f} | {r['expected']:.2f}× | {r['measured']:.2f}× | "
              f"{'yes' if r['greedy_identical'] else 'NO'} |" for r in rows]
    verdict = (f"best: {best['size']} ({best['ratio']:.1%}) at γ={best['gamma']}: measured {best['measured']:.2f}×, "
               f"expected {best['expected']:.2f}×")
    (out / "sweep.md").write_text("\n".join(table) + f"\n\n{verdict}\n")
    plot(rows, list(drafts), gammas, out / "sweep.png")
    print("\n".join(table) + f"\n\n{verdict}\nwrote {out}/sweep.md, {out}/sweep.png")
    return 0


def plot(rows: list[dict], sizes: list[str], gammas: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(2.5 + 0.7 * len(gammas) * 2, 1.5 + 0.6 * len(sizes)), squeeze=False)
    for ax, key in zip(axes[0], ("expected", "measured")):
        grid = [[next(r[key] for r in rows if r["size"] == s and r["gamma"] == g) for g in gammas] for s in sizes]
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0.5, vmax=1.5, aspect="auto")
        for i, line in enumerate(grid):
            for j, value in enumerate(line):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(gammas)), [str(g) for g in gammas])
        ax.set_yticks(range(len(sizes)), sizes)
        ax.set_xlabel("γ (draft length)")
        ax.set_ylabel("draft layers × width")
        ax.set_title(f"{key} greedy speedup vs target-only")
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
