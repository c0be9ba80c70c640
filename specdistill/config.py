"""Stage configs: one dataclass per stage, loaded from YAML, overridden from the CLI.

``python distill.py --config configs/tiny.yaml train.lr=3e-4 draft.num_layers=2``

Unknown keys and out-of-range values are errors that name the key. Each run directory records the
resolved config (``config.yaml``) and its provenance (``run.json``: argv, git SHA, versions, seed).
"""

from __future__ import annotations

import dataclasses
import json
import platform
import subprocess
import sys
import types
import typing
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import yaml

from . import precision
from .precision import resolve_bf16, resolve_dtype


class ConfigError(ValueError):
    """A config key is unknown, mistyped or out of range."""


def _check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {message}")


@dataclass
class TargetConfig:
    path: str = "smollm2-135m"  # embedded alias, a local HF folder, or a hub id already cached
    # "auto": bfloat16 where the hardware multiplies it natively, else float32 (specdistill/precision.py).
    # Resolved here, so config.yaml, cache keys and every stage see the dtype that actually ran.
    dtype: str = "auto"

    def __post_init__(self):
        _check(self.dtype in ("auto", "float32", "bfloat16"), "target.dtype", "must be auto, float32 or bfloat16")
        self.dtype = resolve_dtype(self.dtype)


@dataclass
class DraftConfig:
    # "fresh": random init sized below; "target_layers": copy target layers; "pretrained": load `path`.
    init: str = "target_layers"
    path: str = ""
    layers: list[int] = field(default_factory=lambda: [0, 29])  # target layer indices ("target_layers")
    num_layers: int = 4  # "fresh" only
    hidden_size: int = 0  # 0 = the target's width; smaller projects the embedding (see models.py)
    intermediate_size: int = 0  # 0 = scale the target's MLP ratio to hidden_size
    num_attention_heads: int = 0  # 0 = hidden_size // target head_dim
    num_key_value_heads: int = 0  # 0 = keep the target's GQA ratio
    embedding: str = "copy"  # "copy" | "project" (narrower width via the top singular directions)

    def __post_init__(self):
        _check(self.init in ("fresh", "target_layers", "pretrained"), "draft.init",
               "must be fresh, target_layers or pretrained")
        _check(self.init != "pretrained" or bool(self.path), "draft.path", "required when draft.init=pretrained")
        _check(self.embedding in ("copy", "project"), "draft.embedding", "must be copy or project")
        _check(self.num_layers >= 1, "draft.num_layers", "must be >= 1")
        _check(self.init != "target_layers" or len(self.layers) >= 1, "draft.layers", "needs at least one index")
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
            _check(getattr(self, name) >= 0, f"draft.{name}", "must be >= 0")


@dataclass
class DataConfig:
    source: str = "sharegpt"  # "sharegpt" | "mtbench" | path to a .json/.jsonl of conversations
    max_records: int = 0  # 0 = all
    max_length: int = 512  # tokens per formatted conversation
    heldout_fraction: float = 0.02
    seed: int = 0

    def __post_init__(self):
        _check(self.max_records >= 0, "data.max_records", "must be >= 0")
        _check(16 <= self.max_length <= 1 << 16, "data.max_length", "must be in [16, 65536]")
        _check(0.0 <= self.heldout_fraction < 1.0, "data.heldout_fraction", "must be in [0, 1)")


def hidden_layers(value: int | list[int]) -> list[int]:
    """``generate.teacher_hidden_layer`` as a list: 0 = none, an int = that layer, a list = those layers."""
    return list(value) if isinstance(value, (list, tuple)) else [value] if value else []


@dataclass
class GenerateConfig:
    """Target-generated responses ("same distribution" data) for distillation.

    With train.data_mode=fixed-cache nothing is generated: num_prompts ShareGPT conversations keep their own
    replies, and one teacher-forced target pass stores teacher_top_k (and teacher_hidden_layer) at their reply
    tokens under the max_minutes budget (data.teacher_pass)."""

    num_prompts: int = 64
    max_prompt_tokens: int = 256
    max_new_tokens: int = 128
    batch_size: int = 16  # prompts per batch (one shard), similar in length
    # Rows decoded together: a new batch joins as finished rows leave (0 = one batch at a time). The setting
    # does not change what is sampled, so it is not part of the cache key.
    max_active_rows: int = 0
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    # > 0: also keep the target's top-k log-probs behind each reply token, the teacher for
    # train.data_mode=cache at no extra target pass (else the cache costs one forward over the set).
    teacher_top_k: int = 0
    # > 0: the set's generation budget in minutes, summed over every run that generates into its folder (a
    # resumed run does not start a fresh clock). Once spent, training uses what exists (a random sample of the
    # prompts); a run with a larger value, or 0 = no limit, fills in the rest. Bounds a demo on a slow machine.
    max_minutes: float = 0.0
    # Also store the teacher's top-k at every prompt position (for train.prompt_loss): the prefill forward
    # already ran there, only its LM head covers all positions instead of the last.
    prompt_teacher: bool = False
    # > 0: also store the target's residual stream after this many decoder layers at every reply token's position
    # (fp16, the target's hidden size per token: ≈ 1.2 KB for SmolLM2), the intermediate teacher of
    # train.hidden_weight, captured by the forward that sampled the token (no extra target pass). A list stores
    # several layers side by side, each matched by its own draft layer; the target's last layer means its state
    # after the final norm (what its LM head reads), matched by the draft's normed last state.
    teacher_hidden_layer: int | list[int] = 0

    def __post_init__(self):
        _check(self.num_prompts >= 1, "generate.num_prompts", "must be >= 1")
        if isinstance(self.teacher_hidden_layer, list):
            layers = self.teacher_hidden_layer
            _check(len(layers) > 0 and all(x >= 1 for x in layers) and layers == sorted(set(layers)),
                   "generate.teacher_hidden_layer", "a list must hold increasing layer numbers >= 1")
            if len(layers) == 1:  # one layer, one form: [15] and 15 name the same generated set
                self.teacher_hidden_layer = layers[0]
        _check(isinstance(self.teacher_hidden_layer, list) or self.teacher_hidden_layer >= 0,
               "generate.teacher_hidden_layer", "must be >= 0 (0 = do not store)")
        _check(not self.teacher_hidden_layer or self.teacher_top_k > 0, "generate.teacher_hidden_layer",
               "needs generate.teacher_top_k > 0 (it is read by train.data_mode=cache, with the stored teacher)")
        _check(not (self.teacher_hidden_layer and self.prompt_teacher), "generate.teacher_hidden_layer",
               "is stored at reply positions only: not with generate.prompt_teacher")
        _check(not self.prompt_teacher or self.teacher_top_k > 0, "generate.prompt_teacher",
               "needs generate.teacher_top_k > 0")
        _check(self.max_minutes >= 0.0, "generate.max_minutes", "must be >= 0 (0 = no limit)")
        _check(self.teacher_top_k >= 0, "generate.teacher_top_k", "must be >= 0 (0 = do not store the teacher)")
        _check(self.max_new_tokens >= 1, "generate.max_new_tokens", "must be >= 1")
        _check(self.max_prompt_tokens >= 1, "generate.max_prompt_tokens", "must be >= 1")
        _check(self.batch_size >= 1, "generate.batch_size", "must be >= 1")
        _check(self.max_active_rows >= 0, "generate.max_active_rows", "must be >= 0 (0 = one batch at a time)")
        _check(self.temperature >= 0.0, "generate.temperature", "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "generate.top_p", "must be in (0, 1]")


@dataclass
class TrainConfig:
    objective: str = "distill"  # "distill" (target logits) | "ce" (next-token CE on the same data: the SFT baseline)
    loss: str = "fkl"  # fkl | rkl | jsd | tvd
    beta: float = 0.5  # jsd interpolation: 0 = FKL, 1 = RKL
    temperature: float = 1.0
    ce_weight: float = 0.0  # mix of next-token CE into the distillation loss
    # fixed (ShareGPT's replies, live teacher) | generated (the target's own) | onpolicy | cache (the target's own
    # replies, teacher stored at generation) | fixed-cache (ShareGPT's replies, teacher stored by one pass over them)
    data_mode: str = "generated"
    max_train_rows: int = 0  # 0 = the whole training set; otherwise its first N rows
    onpolicy_fraction: float = 0.25  # share of batches whose replies are sampled from the current draft
    onpolicy_new_tokens: int = 64
    teacher_top_k: int = 0  # 0 = full vocabulary; k keeps the teacher's top-k plus one tail bucket
    cache_top_k: int = 64  # top-k stored by the offline teacher cache (data_mode=cache)
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.0
    max_steps: int = 200
    max_minutes: float = 0.0  # 0 = no time limit; otherwise stop (and save) after this many minutes, LR annealed by then
    stop_at_step: int = 0  # >0: stop and save here while keeping max_steps' schedule (staged runs)
    batch_size: int = 8
    # Batch rows of similar length (sorted inside windows of 16 batches, batch order shuffled): 27 % → 3 %
    # padding, but it lost 11 % greedy α at 6.5 min (docs/results.md). Off: the plain per-epoch shuffle.
    group_by_length: bool = False
    grad_accum: int = 1
    seq_len: int = 256
    grad_clip: float = 1.0
    # Autocast the draft's forward in bf16. "auto" (resolved to true/false here): only where bf16 matmuls are
    # native (AMX, AVX512-BF16, a bf16 GPU); on an AVX2-only CPU bf16 is emulated and ≈ 6× slower than fp32.
    bf16: bool | str = "auto"
    freeze_embedding: bool = False
    lora_r: int = 0  # >0 trains LoRA adapters (peft) instead of all weights, merged on save
    lora_alpha: int = 16
    eval_every: int = 50
    eval_prompts: int = 40  # MT-bench turn-1 prompts held out for acceptance during training
    eval_new_tokens: int = 96
    save_every: int = 100
    keep_last: int = 2
    max_nonfinite: int = 5  # consecutive non-finite losses before aborting
    inject_nan_steps: list[int] = field(default_factory=list)  # test hook: poison the loss at these steps
    chunk_size: int = 1024
    # > 0: the loss's softmax covers only the head_vocab tokens most frequent in the training replies, the
    # step's labels and head_negatives random others drawn afresh each step (a sampled softmax: the LM head
    # is most of a small draft's training FLOPs). The saved draft keeps its full head, so export is unchanged.
    head_vocab: int = 0
    head_negatives: int = 1024
    # The tokens the saved draft's decoding head keeps (draft/draft_vocab.json, models.ReducedHeadDraft): the
    # draft_vocab most frequent training-reply tokens. 0 writes no file: decoding uses the full head.
    draft_vocab: int = 8192
    # data_mode=cache: prompt tokens are loss tokens too, against the teacher stored there by
    # generate.prompt_teacher (user text, not the target's own replies, but ≈ 5× cheaper per token).
    prompt_loss: bool = False
    # > 0: add this weight × the mean squared error between a linear map of the draft's hidden state at the
    # target's relative depth and the target's stored state there (generate.teacher_hidden_layer; each channel
    # standardised over the training set) to every loss token: a denser signal per token than the top-k
    # log-probs. The map is trained with the draft and not saved with it.
    hidden_weight: float = 0.0
    seed: int = 0

    def __post_init__(self):
        _check(self.objective in ("distill", "ce"), "train.objective", "must be distill or ce")
        _check(self.loss in ("fkl", "rkl", "jsd", "tvd"), "train.loss", "must be fkl, rkl, jsd or tvd")
        _check(0.0 <= self.beta <= 1.0, "train.beta", "must be in [0, 1]")
        _check(self.temperature > 0, "train.temperature", "must be > 0")
        _check(0.0 <= self.ce_weight <= 1.0, "train.ce_weight", "must be in [0, 1]")
        _check(self.data_mode in ("fixed", "generated", "onpolicy", "cache", "fixed-cache"), "train.data_mode",
               "must be fixed, generated, onpolicy, cache or fixed-cache")
        _check(0.0 <= self.onpolicy_fraction <= 1.0, "train.onpolicy_fraction", "must be in [0, 1]")
        _check(self.lr > 0, "train.lr", "must be > 0")
        _check(0.0 <= self.min_lr_ratio <= 1.0, "train.min_lr_ratio", "must be in [0, 1]")
        for name in ("max_steps", "batch_size", "grad_accum", "seq_len", "eval_every", "save_every", "keep_last",
                     "max_nonfinite", "chunk_size"):
            _check(getattr(self, name) >= 1, f"train.{name}", "must be >= 1")
        for name in ("warmup_steps", "stop_at_step", "max_train_rows", "teacher_top_k", "lora_r", "eval_prompts", "max_minutes",
                     "head_vocab", "head_negatives", "draft_vocab"):
            _check(getattr(self, name) >= 0, f"train.{name}", "must be >= 0")
        _check(self.cache_top_k >= 1, "train.cache_top_k", "must be >= 1")
        _check(self.hidden_weight >= 0.0, "train.hidden_weight", "must be >= 0 (0 = off)")
        _check(self.bf16 in (True, False, "auto"), "train.bf16", "must be true, false or auto")
        self.bf16 = resolve_bf16(self.bf16)
        _check(self.data_mode not in ("cache", "fixed-cache") or self.temperature == 1.0, "train.temperature",
               "the offline cache stores T=1 log-probabilities: use temperature 1")


@dataclass
class DistillConfig:
    """``distill.py`` / ``train.py``: one training loop, two objectives."""

    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output_dir: str = "runs/distill"

    def __post_init__(self):
        stored = self.generate.teacher_top_k
        stored_mode = self.train.data_mode in ("cache", "fixed-cache")
        _check(not (stored_mode and stored) or self.train.cache_top_k <= stored,
               "train.cache_top_k", f"must be <= generate.teacher_top_k ({stored}), the entries stored per token")
        _check(not self.train.prompt_loss or (self.train.data_mode == "cache" and self.generate.prompt_teacher),
               "train.prompt_loss", "needs train.data_mode=cache and generate.prompt_teacher=true")
        _check(self.train.data_mode != "fixed-cache" or stored > 0, "generate.teacher_top_k",
               "must be > 0 with train.data_mode=fixed-cache: the teacher pass stores that many entries per token")
        _check(not self.train.hidden_weight or (stored_mode and self.generate.teacher_hidden_layer),
               "train.hidden_weight", "needs train.data_mode=cache or fixed-cache and generate.teacher_hidden_layer > 0 "
               "(the target's states stored at generation or by the teacher pass)")


@dataclass
class DemoConfig:
    """``make demo``: distil with a preset, evaluate init vs distilled, decode one MT-bench prompt."""

    distill_config: str = "configs/smollm2-135m-quick.yaml"
    distill_overrides: list[str] = field(default_factory=list)
    eval_prompts: int = 80
    eval_new_tokens: int = 128
    gammas: str = "1..8"
    question_index: int = 0
    decode_new_tokens: int = 128
    # Wall-clock budget for the whole demo (0 = off): the training gets what is left after the data is
    # generated, less `reserve_minutes` for eval/decode/export, capped by the preset and floored below.
    max_total_minutes: float = 0.0
    reserve_minutes: float = 6.0
    min_train_minutes: float = 3.0
    # Unix time the budget counts from. `make demo` passes the moment it started, so a fresh machine's venv and
    # package setup counts against max_total_minutes too; 0 = demo.py's own start.
    started_at: float = 0.0
    output_dir: str = "runs/demo"

    def __post_init__(self):
        _check(self.eval_prompts >= 1, "eval_prompts", "must be >= 1")
        _check(self.max_total_minutes >= 0, "max_total_minutes", "must be >= 0 (0 = no budget)")
        _check(self.reserve_minutes >= 0 and self.min_train_minutes > 0, "min_train_minutes",
               "must be > 0 (and reserve_minutes >= 0)")
        _check(self.decode_new_tokens >= 1, "decode_new_tokens", "must be >= 1")
        _check(self.started_at >= 0, "started_at", "must be a Unix time (0 = now)")


# Entry script -> its config class; a preset's header comment names the script that runs it.
STAGES = {"demo.py": DemoConfig, "make demo": DemoConfig, "distill.py": DistillConfig, "train.py": DistillConfig}

# ---------------------------------------------------------------- loading


def _is_dataclass_type(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value, tp, key: str):
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is list:
        (item_type,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            # YAML turns `path=123` into an int; a string field wants the text back.
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return str(value)
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported field type {tp!r}")


def from_dict(cls, data: dict, prefix: str = ""):
    """Build dataclass ``cls`` from a nested dict; unknown keys are errors naming the full key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config key '{prefix}{unknown[0]}' (known keys: {', '.join(sorted(fields))})"
        )
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        key = f"{prefix}{name}"
        kwargs[name] = from_dict(tp, value, f"{key}.") if _is_dataclass_type(tp) else _coerce(value, tp, key)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{prefix}{e}" if prefix and not str(e).startswith(prefix) else str(e)) from None


def _set_nested(data: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict:
    """``["train.lr=1e-3", "draft.layers=[0,29]"]`` -> nested dict; values parsed as YAML."""
    data: dict = {}
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' must look like key=value (e.g. train.lr=1e-3)")
        key, raw = item.split("=", 1)
        key = key.lstrip("-")
        value = yaml.safe_load(raw) if raw != "" else ""
        _set_nested(data, key, value)
    return data


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(cls, path: str | Path | None = None, overrides: list[str] | None = None):
    data: dict = {}
    if path:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    data = _merge(data, parse_overrides(overrides or []))
    return from_dict(cls, data)


def to_dict(config) -> dict:
    return dict(config) if isinstance(config, dict) else dataclasses.asdict(config)


# ---------------------------------------------------------------- provenance

PROVENANCE_PACKAGES = ("torch", "transformers", "datasets", "accelerate", "peft", "evaluate", "specdistill")


def git_sha() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5, check=False)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=5, check=False)
        if sha.returncode != 0:
            return "unknown"
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def package_versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in PROVENANCE_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def record_run(output_dir: str | Path, config, seed: int | None = None, extra: dict | None = None) -> Path:
    """Write ``config.yaml`` and ``run.json`` into ``output_dir`` (created if needed)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    run = {"argv": sys.argv, "git_sha": git_sha(), "versions": package_versions(), "seed": seed,
           "hardware": precision.hardware()}
    run.update(extra or {})
    (out / "run.json").write_text(json.dumps(run, indent=2))
    return out


def cli_args(argv: list[str] | None = None, description: str = ""):
    """``--config PATH`` plus free ``key=value`` overrides."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=None, help="YAML preset (see configs/)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.lr=1e-3")
    return parser.parse_args(argv)
