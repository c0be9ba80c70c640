import json

import pytest
import torch
from conftest import make_llama, make_tokenizer
from transformers import AutoModelForCausalLM

from specdistill import export as export_module
from specdistill.export import ExportError, export


def test_export_reload_identical_and_self_describing(tiny_pair_dir, tmp_path):
    out = tmp_path / "exported"
    result = export(str(tiny_pair_dir / "draft"), str(tiny_pair_dir / "target"), out, gamma=4)
    assert all(ok for ok, _ in result["checks"].values()), result["checks"]
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "specdistill.json", "README.md"):
        assert (out / name).is_file(), name
    assert (out / "tokenizer.json").read_bytes() == (tiny_pair_dir / "target" / "tokenizer.json").read_bytes()
    assert json.loads((out / "generation_config.json").read_text())["num_assistant_tokens"] == 4
    meta = json.loads((out / "specdistill.json").read_text())
    assert meta["num_assistant_tokens"] == 4 and 0 < meta["sizes"]["ratio_total"] < 1
    original = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "draft")
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    x = torch.randint(0, original.config.vocab_size, (2, 11))
    with torch.no_grad():
        assert torch.equal(original(x).logits, reloaded(x).logits)
    with pytest.raises(ExportError, match="--force"):
        export(str(tiny_pair_dir / "draft"), str(tiny_pair_dir / "target"), out)
    export(str(tiny_pair_dir / "draft"), str(tiny_pair_dir / "target"), out, force=True)


def test_exported_draft_as_hf_assistant_gives_target_greedy(tiny_pair_dir, tmp_path):
    out = tmp_path / "exported"
    export(str(tiny_pair_dir / "draft"), str(tiny_pair_dir / "target"), out)
    target = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "target")
    assistant = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    kwargs = {"max_new_tokens": 20, "min_new_tokens": 20, "do_sample": False, "pad_token_id": 2, "eos_token_id": None,
                  "attention_mask": torch.ones_like(ids)}
    plain = target.generate(ids, **kwargs)
    assisted = target.generate(ids, assistant_model=assistant, **kwargs)
    assert torch.equal(plain, assisted)


def test_mismatched_tokenizer_is_refused(tiny_pair_dir, tmp_path):
    other_tok = make_tokenizer(vocab_size=300)
    other = make_llama(len(other_tok), hidden=32, layers=1)
    other.save_pretrained(tmp_path / "other")
    other_tok.save_pretrained(tmp_path / "other")
    with pytest.raises(ExportError, match="vocabularies differ"):
        export(str(tmp_path / "other"), str(tiny_pair_dir / "target"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_killed_export_never_looks_complete(tiny_pair_dir, tmp_path, monkeypatch):
    def die(meta):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(export_module, "model_card", die)
    with pytest.raises(KeyboardInterrupt):
        export(str(tiny_pair_dir / "draft"), str(tiny_pair_dir / "target"), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".tmp-*"))


def test_gguf_round_trip(tiny_pair_dir, tmp_path):
    import gguf

    from specdistill.export import write_gguf

    path = write_gguf(tiny_pair_dir / "draft", tmp_path / "draft.gguf", dtype="f32")
    reader = gguf.GGUFReader(str(path))
    fields = reader.fields
    assert fields["general.architecture"].contents() == "llama"
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 2
    assert len(fields["tokenizer.ggml.tokens"].contents()) == 320
    original = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "draft")
    sd = original.state_dict()
    tensors = {t.name: torch.from_numpy(t.data.copy()).reshape(list(reversed(t.shape.tolist()))) for t in reader.tensors}
    assert torch.equal(tensors["token_embd.weight"], sd["model.embed_tokens.weight"])
    assert torch.equal(tensors["blk.0.attn_v.weight"], sd["model.layers.0.self_attn.v_proj.weight"])
    # transformers' GGUF loader undoes the q/k permutation: the reloaded model must give the same logits.
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="draft.gguf")
    x = torch.randint(0, 320, (1, 9))
    with torch.no_grad():
        assert torch.allclose(reloaded(x).logits, original(x).logits, atol=1e-4)
