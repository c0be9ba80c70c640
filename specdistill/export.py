"""Export a draft for serving: a self-describing HF folder that HF, vLLM and SGLang load as is.

    python -m specdistill.export --draft runs/quick/draft --target smollm2-135m --out exports/smollm2-draft \
        [--eval runs/eval-quick/metrics.json] [--force]

Writes atomically (a killed export never leaves a folder that looks complete), merges LoRA adapters,
copies the target's tokenizer files unchanged, reloads the result and compares logits, and prints what
each serving engine's own pair check will say.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import torch

from .assets import atomic_write_dir, resolve_model_path
from .config import git_sha, package_versions
from .models import DRAFT_VOCAB_FILE, count_params, load_model, load_tokenizer, size_report

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model")


class ExportError(RuntimeError):
    """The export would not be usable (exists, mismatched tokenizer, logits changed on reload)."""


def engine_checks(target_config, draft_config, target_tok, draft_tok) -> dict[str, tuple[bool, str]]:
    """The rules each engine applies to a (target, draft) pair, evaluated here before anyone serves it."""
    checks = {}
    same_vocab = target_config.vocab_size == draft_config.vocab_size
    checks["vLLM draft_model"] = (same_vocab, (f"vocab_size target {target_config.vocab_size} vs draft "
                                              f"{draft_config.vocab_size} (must be equal)"))
    checks["HF assisted generation"] = (same_vocab, "shared-tokenizer mode (equal vocab_size)" if same_vocab else
                                        "vocab sizes differ: HF falls back to universal assisted decoding")
    checks["SGLang STANDALONE"] = (same_vocab, "same vocabulary required")
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    t_by_id = {i: t for t, i in t_vocab.items()}
    d_by_id = {i: t for t, i in d_vocab.items()}
    mismatch = next((i for i in sorted(t_by_id) if i >= 5 and t_by_id[i] != d_by_id.get(i)), None)
    problems = []
    if abs(len(t_vocab) - len(d_vocab)) > 128:
        problems.append(f"vocab sizes differ by {abs(len(t_vocab) - len(d_vocab))} (> 128)")
    if mismatch is not None:
        problems.append(f"token {mismatch} differs: {t_by_id[mismatch]!r} vs {d_by_id.get(mismatch)!r}")
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(target_tok, name) != getattr(draft_tok, name):
            problems.append(f"{name} {getattr(target_tok, name)} vs {getattr(draft_tok, name)}")
    for flag in ("add_bos_token", "add_eos_token"):
        if getattr(target_tok, flag, None) != getattr(draft_tok, flag, None):
            problems.append(f"{flag} differs")
    checks["llama.cpp -md"] = (not problems, "; ".join(problems) or "vocab type, BOS/EOS, flags and token text match")
    return checks


def _config_hash(config) -> str:
    return hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_card(meta: dict) -> str:
    sizes, acc = meta["sizes"], meta.get("acceptance") or {}
    gamma = meta["num_assistant_tokens"]
    lines = [f"# Draft model for `{meta['target']}`", "",
             "Distilled with specdistill for speculative decoding.", "",
             (f"- parameters: {sizes['draft_params']:,} ({sizes['ratio_total']:.1%} of the target; "
             f"{sizes['ratio_non_embedding']:.1%} without embeddings)"),
             f"- suggested draft length γ: {gamma}"]
    if acc:
        lines.append("- measured acceptance: " + ", ".join(f"α(T={t})={v:.3f}" for t, v in acc.get("alpha", {}).items()))
    lines += ["", "## Serving", "", "```python",
              "target.generate(**inputs, assistant_model=AutoModelForCausalLM.from_pretrained(\"<this folder>\"))",
              "```", "```bash",
              (f"vllm serve <target> --speculative-config '{{\"method\": \"draft_model\", \"model\": \"<this folder>\", "
              f"\"num_speculative_tokens\": {gamma}}}'"),
              (f"python -m sglang.launch_server --model-path <target> --speculative-algorithm STANDALONE "
              f"--speculative-draft-model-path <this folder> --speculative-num-steps {gamma}"),
              "```", "", "See docs/serving.md in specdistill for the checks each engine applies."]
    return "\n".join(lines) + "\n"


def export(draft_path: str, target_path: str, out: str | Path, eval_metrics: str | None = None,
           gamma: int | None = None, force: bool = False, gguf_dtype: str | None = None) -> dict:
    out = Path(out)
    if out.exists() and not force:
        raise ExportError(f"{out} exists; pass --force to overwrite it")
    target_dir = Path(resolve_model_path(target_path))
    target_tok = load_tokenizer(target_path)
    draft = load_model(draft_path, "float32")
    if hasattr(draft, "merge_and_unload"):
        draft = draft.merge_and_unload()
    target = load_model(target_path, "float32")
    draft_tok = load_tokenizer(draft_path)
    checks = engine_checks(target.config, draft.config, target_tok, draft_tok)
    if not checks["vLLM draft_model"][0]:
        raise ExportError(f"draft and target vocabularies differ: {checks['vLLM draft_model'][1]}")
    acceptance, name = None, None
    if eval_metrics:
        report = json.loads(Path(eval_metrics).read_text())
        drafts = report["drafts"]
        name = next((n for n in drafts if Path(draft_path).name in n or n in str(draft_path)), next(iter(drafts)))
        acceptance = {"alpha": drafts[name]["alpha"], "tau": drafts[name]["tau"], "report": str(eval_metrics)}
        gamma = gamma or drafts[name]["best_gamma"].get("0")
    gamma = int(gamma or 5)
    sizes = size_report(draft, target)
    provenance_file = Path(draft_path) / "specdistill.json"
    meta = {"target": target_path, "target_config_hash": _config_hash(target.config), "sizes": sizes,
            "num_assistant_tokens": gamma, "acceptance": acceptance,
            "training": json.loads(provenance_file.read_text()) if provenance_file.is_file() else None,
            "git_sha": git_sha(), "versions": package_versions()}
    probe = torch.randint(0, draft.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = draft(probe).logits

    def write(tmp: Path):
        draft.generation_config.num_assistant_tokens = gamma
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.save_pretrained(tmp)
        for name in TOKENIZER_FILES:  # unchanged bytes: engines compare tokenizers, not just vocab sizes
            if (target_dir / name).is_file():
                shutil.copy2(target_dir / name, tmp / name)
        (tmp / "specdistill.json").write_text(json.dumps(meta, indent=2, default=str))
        if (Path(draft_path) / DRAFT_VOCAB_FILE).is_file():  # our decoder's reduced head; engines ignore the file
            shutil.copy2(Path(draft_path) / DRAFT_VOCAB_FILE, tmp / DRAFT_VOCAB_FILE)
        (tmp / "README.md").write_text(model_card(meta))
        reloaded = load_model(str(tmp), "float32")
        with torch.no_grad():
            got = reloaded(probe).logits
        if not torch.allclose(got, expected, atol=1e-5):
            raise ExportError(f"reloaded logits differ from the in-memory draft (max {(got - expected).abs().max():.2e})")
        if gguf_dtype:
            from .assets import TARGET_ALIASES, smollm2_gguf_path

            # The embedded target ships as GGUF: copy its tokenizer metadata verbatim (llama.cpp compares it).
            source = smollm2_gguf_path() if target_path.lower() in TARGET_ALIASES else None
            gguf_file = write_gguf(tmp, tmp / f"draft-{gguf_dtype}.gguf", gguf_dtype, tokenizer_gguf=source)
            from transformers import AutoModelForCausalLM

            from_gguf = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf_file.name, dtype=torch.float32)
            with torch.no_grad():
                gguf_logits = from_gguf(probe).logits
            tolerance = 5e-2 if gguf_dtype == "f16" else 1e-4
            if not torch.allclose(gguf_logits, expected, atol=tolerance):
                raise ExportError(f"GGUF reload differs from the draft (max {(gguf_logits - expected).abs().max():.2e})")
        exported_checks = engine_checks(target.config, reloaded.config, target_tok, load_tokenizer(str(tmp)))
        failed = [k for k, (ok, _) in exported_checks.items() if not ok]
        if failed:
            raise ExportError(f"exported folder fails {failed}: {exported_checks}")

    atomic_write_dir(out, write)
    return {"out": str(out), "checks": checks, "gamma": gamma, "params": count_params(draft).total}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--out", required=True)
    parser.add_argument("--eval", default=None, help="eval.py metrics.json, for γ and the model card's numbers")
    parser.add_argument("--gamma", type=int, default=None)
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--gguf", choices=["f16", "f32"], default=None, help="also write draft-<type>.gguf for llama.cpp")
    args = parser.parse_args(argv)
    result = export(args.draft, args.target, args.out, args.eval, args.gamma, args.force, args.gguf)
    for engine, (ok, why) in result["checks"].items():
        print(f"{'OK ' if ok else 'NO '} {engine}: {why}")
    print(f"exported {result['params']:,} params to {result['out']} (num_assistant_tokens={result['gamma']})")
    return 0



# ---------------------------------------------------------------- GGUF for llama.cpp -md


def _permute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF rotary layout -> llama.cpp's interleaved layout (what convert_hf_to_gguf.py does for Llama)."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _tokenizer_fields(tokenizer, hf_dir: Path) -> list[tuple[str, object, object, object]]:
    """llama.cpp tokenizer metadata for a byte-level BPE tokenizer, built from its HF files."""
    import gguf

    data = json.loads((hf_dir / "tokenizer.json").read_text())
    if data.get("model", {}).get("type") != "BPE":
        raise ExportError("GGUF export builds tokenizer metadata for byte-level BPE tokenizers only; "
                          "pass tokenizer_gguf= (the target's GGUF) for other tokenizers")
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    special = set(tokenizer.all_special_ids) | {t["id"] for t in data.get("added_tokens", []) if t.get("special")}
    tokens = [by_id[i] for i in range(len(by_id))]
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"].get("merges", [])]
    T = gguf.GGUFValueType
    fields = [("tokenizer.ggml.model", "gpt2", T.STRING, None), ("tokenizer.ggml.pre", "default", T.STRING, None),
              ("tokenizer.ggml.tokens", tokens, T.ARRAY, T.STRING),
              ("tokenizer.ggml.token_type", [int(t) for t in types], T.ARRAY, T.INT32),
              ("tokenizer.ggml.merges", merges, T.ARRAY, T.STRING),
              ("tokenizer.ggml.add_bos_token", False, T.BOOL, None)]
    for key, value in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                       ("padding", tokenizer.pad_token_id), ("unknown", tokenizer.unk_token_id)):
        if value is not None:
            fields.append((f"tokenizer.ggml.{key}_token_id", int(value), T.UINT32, None))
    if tokenizer.chat_template:
        fields.append(("tokenizer.chat_template", tokenizer.chat_template, T.STRING, None))
    return fields


def _fields_from_gguf(path: Path) -> list[tuple[str, object, object, object]]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = []
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            out.append((name, field.contents(), field.types[0], sub))
    return out


def write_gguf(hf_dir: str | Path, out_file: str | Path, dtype: str = "f16", tokenizer_gguf: str | Path | None = None
               ) -> Path:
    """Write an HF Llama-architecture draft folder as GGUF (f16/f32) with the target's tokenizer metadata."""
    import gguf

    hf_dir, out_file = Path(hf_dir), Path(out_file)
    model = load_model(str(hf_dir), "float32")
    cfg = model.config
    if cfg.model_type != "llama":
        raise ExportError(f"GGUF export supports the llama architecture, not {cfg.model_type}")
    np_dtype = {"f16": "float16", "f32": "float32"}[dtype]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    tmp = out_file.with_name(f".tmp-{out_file.name}")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(hf_dir.name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
    fields = _fields_from_gguf(Path(tokenizer_gguf)) if tokenizer_gguf else _tokenizer_fields(load_tokenizer(str(hf_dir)), hf_dir)
    for name, value, vtype, sub in fields:
        writer.add_key_value(name, value, vtype, sub)

    def add(name: str, tensor: torch.Tensor, keep_f32: bool = False):
        array = tensor.detach().float().numpy()
        writer.add_tensor(name, array if keep_f32 or array.ndim == 1 else array.astype(np_dtype))

    sd = model.state_dict()
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"], keep_f32=True)
        add(f"blk.{i}.attn_q.weight", _permute_qk(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads))
        add(f"blk.{i}.attn_k.weight", _permute_qk(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads))
        add(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        add(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], keep_f32=True)
        add(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        add(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        add(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    add("output_norm.weight", sd["model.norm.weight"], keep_f32=True)
    if not cfg.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out_file)  # a killed write leaves only the .tmp- file
    return out_file


if __name__ == "__main__":
    raise SystemExit(main())
