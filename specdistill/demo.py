"""What ``make demo`` runs: the embedded default end to end.

Train the draft with the quick preset (JSD logit distillation on the target's own replies, from the teacher top-k
stored at generation: the best measured recipe per CPU-minute; the generated set is cached after the first
run) → acceptance of the draft at init vs trained on MT-bench → a speculative decode of one MT-bench prompt
against target-only decoding → export for serving.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from . import evaluation
from .config import ConfigError, DemoConfig, DistillConfig, cli_args, load_config, record_run
from .data import load_mtbench, target_generated_dataset
from .export import export
from .models import build_draft, load_draft, load_model, load_tokenizer
from .speculative import SpeculativeGenerator, target_only_generate
from .trainer import eval_set
from .trainer import run as distill_run


def training_minutes(preset_minutes: float, elapsed_minutes: float, cfg: DemoConfig) -> float:
    """Training minutes that keep the demo inside ``max_total_minutes`` on a slower machine."""
    if not cfg.max_total_minutes:
        return preset_minutes
    left = cfg.max_total_minutes - elapsed_minutes - cfg.reserve_minutes
    capped = min(preset_minutes, left) if preset_minutes else left
    return max(cfg.min_train_minutes, capped)


def generation_minutes(preset_minutes: float, elapsed_minutes: float, cfg: DemoConfig) -> float:
    """Generation minutes that leave the reserve and the shortest training inside ``max_total_minutes``
    (a slow setup eats into data first, not into the evaluation). 0 = no limit, as in the preset."""
    if not cfg.max_total_minutes:
        return preset_minutes
    left = cfg.max_total_minutes - elapsed_minutes - cfg.reserve_minutes - cfg.min_train_minutes
    return max(0.5, min(preset_minutes, left) if preset_minutes else left)


def main(argv: list[str] | None = None) -> int:
    args = cli_args(argv, description=__doc__)
    cfg = load_config(DemoConfig, args.config, args.overrides)
    started = cfg.started_at or time.time()  # wall clock: `make demo`'s own start when it passes one
    if time.time() - started > 3600 * 24:
        raise ConfigError(f"started_at={cfg.started_at:.0f} is more than a day ago: pass a Unix time from this run")
    out = record_run(cfg.output_dir, cfg)
    dcfg = load_config(DistillConfig, cfg.distill_config, [f"output_dir={out / 'distill'}", *cfg.distill_overrides])

    if cfg.max_total_minutes and dcfg.train.data_mode != "fixed":
        # Generate (or load the cached) data first, so the training budget is what the clock has left.
        print("== 0/4 target-generated data (cached after the first run)")
        minutes = generation_minutes(dcfg.generate.max_minutes, (time.time() - started) / 60, cfg)
        if minutes != dcfg.generate.max_minutes:
            print(f"   generating for at most {minutes:.1f} min (preset {dcfg.generate.max_minutes:g}) "
                  f"to finish within max_total_minutes={cfg.max_total_minutes:g}")
            dcfg.generate.max_minutes = minutes
        target = load_model(dcfg.target.path, dcfg.target.dtype)
        tokenizer = load_tokenizer(dcfg.target.path)
        target_generated_dataset(target, tokenizer, dcfg.target.path, dcfg.data, dcfg.generate)
        eval_set(target, tokenizer, dcfg)
        del target
        elapsed = (time.time() - started) / 60
        minutes = training_minutes(dcfg.train.max_minutes, elapsed, cfg)
        if minutes != dcfg.train.max_minutes:
            print(f"   {elapsed:.1f} min so far: training for {minutes:.1f} min (preset {dcfg.train.max_minutes:g}) "
                  f"to finish within max_total_minutes={cfg.max_total_minutes:g}")
            dcfg.train.max_minutes = minutes
    what = ("CE on target-generated replies" if dcfg.train.objective == "ce"
            else f"{dcfg.train.loss} distillation (train.data_mode={dcfg.train.data_mode})")
    print(f"== 1/4 train the draft: {what} ({cfg.distill_config})")
    trained = distill_run(dcfg)
    draft_dir = Path(dcfg.output_dir) / "draft"

    print("== 2/4 acceptance on MT-bench: draft at init vs trained")
    # The same draft the preset trains, before training: built from the preset's own draft config.
    tokenizer = load_tokenizer(dcfg.target.path)
    init_dir = out / "draft-init"
    init_draft = build_draft(load_model(dcfg.target.path, "float32"), dcfg.draft)
    init_draft.save_pretrained(init_dir)
    tokenizer.save_pretrained(init_dir)
    del init_draft
    eval_dir = out / "eval"
    evaluation.main(["--target", dcfg.target.path, "--draft", str(init_dir), "--name", "init",
                     "--draft", str(draft_dir), "--name", "trained", "--prompts", "mtbench",
                     "--num-prompts", str(cfg.eval_prompts), "--max-new-tokens", str(cfg.eval_new_tokens),
                     "--gamma", cfg.gammas, "--output-dir", str(eval_dir)])
    report = json.loads((eval_dir / "metrics.json").read_text())
    best = report["drafts"]["trained"]["best_gamma"]["0"]

    print(f"== 3/4 speculative decode of an MT-bench prompt (γ={best}, greedy, fp32)")
    target = load_model(dcfg.target.path, "float32")
    draft = load_draft(str(draft_dir), "float32")
    question = load_mtbench()[cfg.question_index]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question["turns"][0]}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    gen = SpeculativeGenerator(target, draft, gamma=best)
    with torch.inference_mode():
        ref = target_only_generate(target, prompt, cfg.decode_new_tokens, tokenizer.eos_token_id)
        spec = gen.generate(prompt, cfg.decode_new_tokens, tokenizer.eos_token_id)
    print(f"\n{question['turns'][0]}\n\n{tokenizer.decode(spec.tokens, skip_special_tokens=True)}\n")
    speedup = spec.stats["tokens_per_s"] / ref.stats["tokens_per_s"]
    rows = report["drafts"]
    summary = {
        "draft_ratio": rows["trained"]["sizes"]["ratio_total"],
        "alpha_greedy": {k: rows[k]["alpha"]["0"] for k in ("init", "trained")},
        "alpha_t1": {k: rows[k]["alpha"]["1"] for k in ("init", "trained")},
        "best_gamma": best, "tau_best_gamma": rows["trained"]["tau"][f"0/{best}"],
        "decode_tau": spec.stats["tau"], "measured_speedup": speedup,
        "greedy_identical": spec.tokens == ref.tokens, "distill_steps": trained["steps"],
        "distill_minutes": trained["elapsed_s"] / 60,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("== 4/4 export for serving (HF folder + GGUF f16)")
    exported = export(str(draft_dir), dcfg.target.path, out / "export", str(eval_dir / "metrics.json"), force=True,
                      gguf_dtype="f16")
    for engine, (ok, why) in exported["checks"].items():
        print(f"  {'OK' if ok else 'NO'} {engine}: {why}")
    summary["total_minutes"] = (time.time() - started) / 60  # from started_at: `make demo` includes its setup
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n| | init | trained |\n|---|---|---|")
    print(f"| draft size (of target params) | {summary['draft_ratio']:.1%} | {summary['draft_ratio']:.1%} |")
    print(f"| α greedy | {summary['alpha_greedy']['init']:.3f} | {summary['alpha_greedy']['trained']:.3f} |")
    print(f"| α T=1 | {summary['alpha_t1']['init']:.3f} | {summary['alpha_t1']['trained']:.3f} |")
    print(f"\nτ at best γ={best}: {summary['tau_best_gamma']:.2f}; measured decode speedup vs target-only "
          f"(1 prompt, fp32): {speedup:.2f}× (greedy identical: {summary['greedy_identical']})")
    print(f"demo wall time {summary['total_minutes']:.1f} min ({trained['steps']} training steps in "
          f"{summary['distill_minutes']:.1f} min)")
    print(f"report: {eval_dir}/report.md  plots: {eval_dir}/*.png  curves: {dcfg.output_dir}/curves.png  "
          f"exported: {exported['out']} (serving commands: docs/serving.md)")
    return 0
