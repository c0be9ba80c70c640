"""Equal-budget recipe comparison: each divergence, each data mode and the CE baseline, same draft, same clock.

    python scripts/recipes.py --config configs/smollm2-135m-quick.yaml --minutes 5 --out runs/recipes

Every recipe trains the config's draft from the same init for ``--minutes`` of training-loop time (the
cosine LR anneals on that clock, so no run is cut mid-schedule), then one ``eval.py`` run measures all of
them, plus the untrained init, on the same MT-bench prompts: α greedy / T=1 by category, τ(γ), the cost
ratio c and the expected speedup. Writes ``recipes.json``, ``recipes.md`` (one table, τ relative to CE) and
``recipes.png``. Wall time per recipe is recorded too: the offline teacher cache is built before the
training clock starts, and a fair reading counts it.

Resumable: a recipe whose run folder holds ``draft/`` is not retrained (an interrupted one resumes from its
newest checkpoint), and acceptance is re-evaluated only when the set of drafts changed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from accelerate.utils import set_seed

from specdistill import evaluation
from specdistill.config import DistillConfig, load_config, record_run
from specdistill.models import build_draft, load_model, load_tokenizer
from specdistill.trainer import run as train_run

# name -> overrides on top of the config. CE is the SFT / sequence-level KD baseline on the same replies.
# Each names its data mode, so a preset's own choice never changes what a recipe means.
FKL_CACHE_HV16K = ["train.objective=distill", "train.loss=fkl", "train.data_mode=cache", "train.head_vocab=16384"]
FKL_CACHE_HV16K_HIDDEN = [*FKL_CACHE_HV16K, "generate.teacher_hidden_layer=15"]  # + a train.hidden_weight
RECIPES = {
    "ce": ["train.objective=ce", "train.data_mode=generated"],
    "fkl": ["train.objective=distill", "train.loss=fkl", "train.data_mode=generated"],
    "rkl": ["train.objective=distill", "train.loss=rkl", "train.data_mode=generated"],
    "jsd": ["train.objective=distill", "train.loss=jsd", "train.data_mode=generated"],
    "tvd": ["train.objective=distill", "train.loss=tvd", "train.data_mode=generated"],
    "fkl-fixed": ["train.objective=distill", "train.loss=fkl", "train.data_mode=fixed"],
    "fkl-onpolicy": ["train.objective=distill", "train.loss=fkl", "train.data_mode=onpolicy"],
    # The teacher's top-k: stored at generation when generate.teacher_top_k > 0, else one offline pass.
    "fkl-cache": ["train.objective=distill", "train.loss=fkl", "train.data_mode=cache"],
    "fkl-cache-ce": ["train.objective=distill", "train.loss=fkl", "train.data_mode=cache", "train.ce_weight=0.5"],
    # A sampled softmax over ≈ 16k tokens: 2.2× the steps per second (docs/results.md, step profile).
    "fkl-cache-hv16k": FKL_CACHE_HV16K,
    # The same with a smaller head (more steps per minute, more of the teacher's mass left out), and with twice
    # the learning rate (the sampled-softmax steps are cheaper, so the run takes more of them).
    "fkl-cache-hv8k": ["train.objective=distill", "train.loss=fkl", "train.data_mode=cache", "train.head_vocab=8192"],
    "fkl-cache-hv16k-lr2x": [*FKL_CACHE_HV16K, "train.lr=2e-3"],
    # Draft sizes, named so that a recipe means the same draft whatever the preset says (the quick preset's is
    # 2 x 256 since 2026-12-06, 4 x 384 before): 10.4 %, 16.3 % and 18.7 % of the target. Fewer layers cut the
    # draft's batch-1 step (c), which lowers the α a draft needs to pay; the sampled softmax keeps the head cheap
    # to train.
    "fkl-cache-hv16k-2x256": [*FKL_CACHE_HV16K, "draft.num_layers=2", "draft.hidden_size=256"],
    "fkl-cache-hv16k-4x384": [*FKL_CACHE_HV16K, "draft.num_layers=4", "draft.hidden_size=384"],
    "fkl-cache-hv16k-2x384": [*FKL_CACHE_HV16K, "draft.num_layers=2", "draft.hidden_size=384"],
    # The target's greedy replies as the data (its own set; the stored teacher is still the T=1 softmax): the
    # trajectories a greedy decode visits, where the headline's greedy acceptance is measured.
    "fkl-cache-hv16k-greedydata": [*FKL_CACHE_HV16K, "generate.temperature=0"],
    # The other end: replies sampled from the target's plain T=1 distribution, the one the stored teacher is.
    "fkl-cache-hv16k-t1data": [*FKL_CACHE_HV16K, "generate.temperature=1.0", "generate.top_p=1.0"],
    # The embedding (and so the tied head: the target's own, projected) frozen: 75 % of the draft's weights
    # leave the backward and the optimiser, and the rare tokens' rows cannot drift on a small set.
    "fkl-cache-hv16k-frozenemb": [*FKL_CACHE_HV16K, "train.freeze_embedding=true"],
    # Batches of similar-length rows: the same rows per epoch with less padding, so more steps per minute.
    "fkl-cache-hv16k-bylength": [*FKL_CACHE_HV16K, "train.group_by_length=true"],
    # Fewer replies, more training at the same total time: 400 of the 640 replies (the 240 left out took
    # ≈ 3.3 min to generate at the demo's 136 tok/s), trained 3.3 min longer. Run with --minutes 6.5.
    "fkl-cache-hv16k-400rows-longer": [*FKL_CACHE_HV16K, "train.max_train_rows=400", "train.max_minutes=9.8"],
    # The same recipe with another seed (draft init and batch order): how far apart two equal recipes land.
    "fkl-cache-hv16k-seed1": [*FKL_CACHE_HV16K, "train.seed=1"],
    # Prompt tokens as loss tokens too, against the teacher stored during the prefill. Pass
    # generate.prompt_teacher=true to every recipe so that they all share one generated set.
    "fkl-cache-prompt": ["train.objective=distill", "train.loss=fkl", "train.data_mode=cache",
                         "generate.prompt_teacher=true", "train.prompt_loss=true"],
    # The same with the sampled softmax: the full 49k head made each extra loss token cost head time (106 steps
    # against 144); with a 16k head a step's cost barely grows with its loss tokens.
    "fkl-cache-hv16k-prompt": [*FKL_CACHE_HV16K, "generate.prompt_teacher=true", "train.prompt_loss=true"],
    # The CE baseline with the same sampled softmax: the fair equal-budget comparison for fkl-cache-hv16k (plain
    # `ce` pays for the full 49k head on every step, which the sampled softmax made the FKL recipe skip).
    "ce-hv16k": ["train.objective=ce", "train.data_mode=generated", "train.head_vocab=16384"],
    # The target's residual stream after layer 15 of 30, stored at generation, matched by the draft's state at the
    # same relative depth through a trained linear map (standardised MSE, weight 1) on top of the stored top-64.
    # Pass generate.teacher_hidden_layer=15 to every recipe so that they all share one generated set.
    "fkl-cache-hv16k-hidden": [*FKL_CACHE_HV16K_HIDDEN, "train.hidden_weight=1.0"],
    # The same at a third and at three times the weight.
    "fkl-cache-hv16k-hidden-w0.3": [*FKL_CACHE_HV16K_HIDDEN, "train.hidden_weight=0.3"],
    "fkl-cache-hv16k-hidden-w3": [*FKL_CACHE_HV16K_HIDDEN, "train.hidden_weight=3.0"],
    # One stored target layer per draft layer: layer 15 for the draft's first, and the target's last layer after
    # its final norm (what its LM head reads) for the draft's normed last state, on top of the stored top-64. Its
    # own generated set (the same prompts and sampling seeds; run it without a generate.teacher_hidden_layer
    # override, which would replace the recipe's).
    "fkl-cache-hv16k-hidden-l15l30": [*FKL_CACHE_HV16K, "generate.teacher_hidden_layer=[15,30]",
                                      "train.hidden_weight=1.0"],
    "jsd-cache-hv16k-hidden-l15l30": [*FKL_CACHE_HV16K, "generate.teacher_hidden_layer=[15,30]", "train.loss=jsd",
                                      "train.hidden_weight=1.0"],
    # ShareGPT's own replies instead of the target's, the teacher's top-64 and layer-15 state stored by one
    # teacher-forced pass (1.86× the loss tokens per minute of generating replies on the Zen 4 machine; contexts
    # the target did not write: 17 % less greedy α at an equal budget). generate.max_minutes bounds the pass.
    "fkl-fixedcache-hv16k-hidden": [*FKL_CACHE_HV16K_HIDDEN, "train.data_mode=fixed-cache", "train.hidden_weight=1.0"],
    # The other divergences on the same stored top-64 (each over the teacher's top-k plus one tail bucket) with the
    # same layer-15 term: the divergence comparison at a budget where drafts are far from init (the 3-minute
    # comparison with the live teacher left all of them within 0.1 of it).
    "rkl-cache-hv16k-hidden": [*FKL_CACHE_HV16K_HIDDEN, "train.loss=rkl", "train.hidden_weight=1.0"],
    "jsd-cache-hv16k-hidden": [*FKL_CACHE_HV16K_HIDDEN, "train.loss=jsd", "train.hidden_weight=1.0"],
    "tvd-cache-hv16k-hidden": [*FKL_CACHE_HV16K_HIDDEN, "train.loss=tvd", "train.hidden_weight=1.0"],
    # JSD's interpolation: β 0 is FKL, 1 is RKL; the quick preset's 0.5 was the only one run at first.
    "jsd-b0.25-cache-hv16k-hidden": [*FKL_CACHE_HV16K_HIDDEN, "train.loss=jsd", "train.beta=0.25",
                                     "train.hidden_weight=1.0"],
    "jsd-b0.75-cache-hv16k-hidden": [*FKL_CACHE_HV16K_HIDDEN, "train.loss=jsd", "train.beta=0.75",
                                     "train.hidden_weight=1.0"],
    # The full preset's 4 x 384 draft with the term (its layer 2 of 4 matched to the target's 15 of 30).
    "fkl-cache-hv16k-hidden-4x384": [*FKL_CACHE_HV16K_HIDDEN, "train.hidden_weight=1.0", "draft.num_layers=4",
                                     "draft.hidden_size=384"],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated subset of {list(RECIPES)}")
    parser.add_argument("--minutes", type=float, default=5.0, help="training-loop minutes per recipe")
    parser.add_argument("--prompts", default="mtbench")
    parser.add_argument("--num-prompts", type=int, default=80)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gammas", default="1..8")
    parser.add_argument("--out", default="runs/recipes")
    parser.add_argument("overrides", nargs="*", help="key=value overrides applied to every recipe, last")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise SystemExit(f"--recipes: unknown {unknown}; choose from {list(RECIPES)}")
    gammas = evaluation.parse_gammas(args.gammas)
    out = Path(args.out)
    record_run(out, vars(args))

    state_path = out / "recipes.json"
    state = json.loads(state_path.read_text()) if state_path.is_file() else {"runs": {}}
    # A huge step cap makes the clock the only budget, so every recipe anneals over the same minutes;
    # trailing overrides come last, so they can still cap steps (the tests do).
    # hidden_weight=0 first: a recipe that does not name the hidden-state term trains without it, whatever the
    # preset says (the quick preset has it on since 2026-12-07, and CE / live-teacher recipes cannot use it).
    budget = [f"train.max_minutes={args.minutes}", "train.max_steps=1000000", "train.eval_prompts=0",
              "train.save_every=100000", "train.hidden_weight=0"]
    drafts = {}
    for name in names:
        run_dir = out / name
        cfg = load_config(DistillConfig, args.config, [*budget, *RECIPES[name], *args.overrides,
                                                       f"output_dir={run_dir}"])
        if not (run_dir / "draft").is_dir():
            print(f"== train {name}: {' '.join(RECIPES[name])}")
            started = time.perf_counter()
            result = train_run(cfg, resume=(run_dir / "checkpoints").is_dir())
            if result["interrupted"]:
                return 1
            state["runs"][name] = {"steps": result["steps"], "loss_tokens": result["loss_tokens"],
                                   "train_minutes": result["elapsed_s"] / 60,
                                   "wall_minutes": (time.perf_counter() - started) / 60,
                                   "overrides": RECIPES[name]}
            state_path.write_text(json.dumps(state, indent=2))
        drafts[name] = str(run_dir / "draft")
    # The init is the config's own draft (with the trailing overrides), not the last recipe's: a recipe may
    # change the draft's layout.
    base_cfg = load_config(DistillConfig, args.config, [*budget, *args.overrides])
    target_path = base_cfg.target.path

    eval_dir = out / "eval"
    metrics = eval_dir / "metrics.json"
    wanted = {"init", *drafts}
    if not metrics.is_file() or set(json.loads(metrics.read_text())["drafts"]) != wanted:
        print("== acceptance of every recipe (and the untrained init) on the same prompts")
        eval_args = ["--target", target_path, "--prompts", args.prompts, "--num-prompts", str(args.num_prompts),
                     "--max-new-tokens", str(args.max_new_tokens), "--gamma", args.gammas, "--temperatures", "0,1",
                     "--output-dir", str(eval_dir), "--draft", save_init(base_cfg, out / "draft-init"), "--name", "init"]
        for name, path in drafts.items():
            eval_args += ["--draft", path, "--name", name]
        evaluation.main(eval_args)
    report = json.loads(metrics.read_text())["drafts"]

    rows = []
    tau_gamma = 5 if 5 in gammas else max(gammas)  # the τ(γ=5) when the grid has it
    # τ relative to the CE baseline: plain `ce`, else `ce-hv16k` (CE with the sampled softmax) when only that ran.
    ce_name = next((n for n in ("ce", "ce-hv16k") if n in report), None)
    ce_tau = report[ce_name]["tau"][f"0/{tau_gamma}"] if ce_name else None
    for name in ["init", *drafts]:
        d, run = report[name], state["runs"].get(name, {})
        best_gamma = max(gammas, key=lambda g: d["expected_speedup"][f"0/{g}"])
        rows.append({"recipe": name, "steps": run.get("steps", 0), "train_minutes": run.get("train_minutes", 0.0),
                     "wall_minutes": run.get("wall_minutes", 0.0), "loss_tokens": run.get("loss_tokens", 0),
                     "alpha": d["alpha"]["0"], "alpha_t1": d["alpha"].get("1"), "tau": d["tau"][f"0/{tau_gamma}"],
                     "tau_vs_ce": d["tau"][f"0/{tau_gamma}"] / ce_tau - 1 if ce_tau else None, "c": d["cost_ratio"],
                     "best_gamma": best_gamma, "best_expected": d["expected_speedup"][f"0/{best_gamma}"]})
    state["rows"] = rows
    state_path.write_text(json.dumps(state, indent=2))
    table = [(f"| recipe | steps | train min | wall min | loss tokens | α greedy | α T=1 | τ(γ={tau_gamma}) | τ vs CE | c "
             "| best γ (expected) |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs_ce = f"{r['tau_vs_ce']:+.1%}" if r["tau_vs_ce"] is not None else "—"
        table.append(f"| {r['recipe']} | {r['steps']} | {r['train_minutes']:.1f} | {r['wall_minutes']:.1f} "
                     f"| {r['loss_tokens']:,} | {r['alpha']:.3f} | {r['alpha_t1']:.3f} | {r['tau']:.2f} | {vs_ce} "
                     f"| {r['c']:.3f} | {r['best_gamma']} ({r['best_expected']:.2f}×) |")
    trained = [r for r in rows if r["recipe"] != "init"]
    winner = max(trained, key=lambda r: r["tau"])
    verdict = (f"best at equal budget ({args.minutes:g} min): {winner['recipe']}, τ(γ={tau_gamma}) "
               f"{winner['tau']:.2f}" + (f"; τ vs CE is against `{ce_name}`" if ce_name else ""))
    (out / "recipes.md").write_text("\n".join(table) + f"\n\n{verdict}\n")
    plot(rows, out / "recipes.png", args.minutes)
    print("\n".join(table) + f"\n\n{verdict}\nwrote {out}/recipes.md, {out}/recipes.png")
    return 0


def save_init(cfg: DistillConfig, path: Path) -> str:
    """The config's draft layout at init (same seed as the runs; built from the fp32 target)."""
    if not (path / "config.json").is_file():
        set_seed(cfg.train.seed)
        build_draft(load_model(cfg.target.path, "float32"), cfg.draft).save_pretrained(path)
        load_tokenizer(cfg.target.path).save_pretrained(path)
    return str(path)


def plot(rows: list[dict], path: Path, minutes: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["recipe"] for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(rows), 3.6))
    ax.bar([i - 0.2 for i in x], [r["alpha"] for r in rows], width=0.4, label="α greedy")
    ax.bar([i + 0.2 for i in x], [r["alpha_t1"] for r in rows], width=0.4, label="α T=1")
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("token acceptance on MT-bench")
    ax.set_title(f"recipes at an equal budget of {minutes:g} training minutes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
