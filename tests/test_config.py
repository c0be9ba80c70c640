import json

import pytest
import yaml

from specdistill.config import ConfigError, DistillConfig, DraftConfig, load_config, parse_overrides, record_run


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("draft:\n  init: fresh\n  num_layers: 3\noutput_dir: x\n")
    cfg = load_config(DistillConfig, path, ["draft.num_layers=5", "target.dtype=float32", "draft.layers=[1,2]"])
    assert cfg.draft.num_layers == 5
    assert cfg.draft.init == "fresh"
    assert cfg.target.dtype == "float32"
    assert cfg.draft.layers == [1, 2]
    assert cfg.output_dir == "x"


def test_unknown_key_names_full_key(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'draft.num_layer'"):
        load_config(DistillConfig, None, ["draft.num_layer=2"])
    path = tmp_path / "c.yaml"
    path.write_text("bogus: 1\n")
    with pytest.raises(ConfigError, match="unknown config key 'bogus'"):
        load_config(DistillConfig, path)


def test_out_of_range_and_type_errors_name_key():
    with pytest.raises(ConfigError, match="target.dtype"):
        load_config(DistillConfig, None, ["target.dtype=float16"])
    with pytest.raises(ConfigError, match="draft.num_layers"):
        load_config(DistillConfig, None, ["draft.num_layers=0"])
    with pytest.raises(ConfigError, match="draft.num_layers: expected an integer"):
        load_config(DistillConfig, None, ["draft.num_layers=two"])
    with pytest.raises(ConfigError, match="data.heldout_fraction"):
        load_config(DistillConfig, None, ["data.heldout_fraction=1.5"])
    with pytest.raises(ConfigError, match="draft.path"):
        DraftConfig(init="pretrained")


def test_teacher_hidden_layer_takes_one_layer_or_an_increasing_list():
    from specdistill.config import hidden_layers

    base = ["generate.teacher_top_k=8"]
    cfg = load_config(DistillConfig, None, [*base, "generate.teacher_hidden_layer=[15,30]"])
    assert cfg.generate.teacher_hidden_layer == [15, 30] and hidden_layers(cfg.generate.teacher_hidden_layer) == [15, 30]
    # One layer has one form, so [15] and 15 name the same generated set.
    assert load_config(DistillConfig, None, [*base, "generate.teacher_hidden_layer=[15]"]).generate.teacher_hidden_layer == 15
    assert hidden_layers(0) == [] and hidden_layers(15) == [15]
    for bad in ("[30,15]", "[0,15]", "[15,15]", "[]", "-1"):
        with pytest.raises(ConfigError, match="generate.teacher_hidden_layer"):
            load_config(DistillConfig, None, [*base, f"generate.teacher_hidden_layer={bad}"])


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["draft.num_layers"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(DistillConfig, tmp_path / "missing.yaml")


def test_record_run_writes_config_and_provenance(tmp_path):
    cfg = load_config(DistillConfig, None, ["train.max_steps=7"])
    out = record_run(tmp_path / "run", cfg, seed=3)
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["max_steps"] == 7
    run = json.loads((out / "run.json").read_text())
    assert run["seed"] == 3 and run["git_sha"] and run["versions"]["torch"]
    assert isinstance(run["argv"], list)


def test_every_config_file_loads():
    from pathlib import Path

    from specdistill import config as config_module

    presets = sorted(Path(__file__).resolve().parent.parent.joinpath("configs").glob("*.yaml"))
    assert presets, "no presets found"
    for preset in presets:
        assert preset.read_text().startswith("#"), f"{preset} must start with its launch command"
        header = preset.read_text().splitlines()[0]
        scripts = [name for name in config_module.STAGES if name in header]
        assert scripts, f"{preset}: header names no entry script ({', '.join(config_module.STAGES)})"
        load_config(config_module.STAGES[scripts[0]], preset)


AMX_CPU = {"cpu_capability": "AVX512", "cuda": False, "amx_tile": True, "avx512_bf16": True}
AVX2_CPU = {"cpu_capability": "AVX2", "cuda": False, "amx_tile": False, "avx512_bf16": False}


@pytest.mark.parametrize("machine, dtype, autocast", [(AMX_CPU, "bfloat16", True), (AVX2_CPU, "float32", False)])
def test_auto_precision_follows_the_hardware(monkeypatch, tmp_path, machine, dtype, autocast):
    # An AVX2-only CPU emulates bf16 (≈ 6× slower than fp32): "auto" must pick fp32 there, bf16 with AMX.
    from specdistill import precision

    monkeypatch.setattr(precision, "hardware", lambda: machine)
    cfg = load_config(DistillConfig, None, ["target.dtype=auto", "train.bf16=auto"])
    assert (cfg.target.dtype, cfg.train.bf16) == (dtype, autocast)
    explicit = load_config(DistillConfig, None, ["target.dtype=bfloat16", "train.bf16=false"])
    assert (explicit.target.dtype, explicit.train.bf16) == ("bfloat16", False)
    # The saved config holds what ran, and run.json says why.
    out = record_run(tmp_path / "run", cfg)
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert (saved["target"]["dtype"], saved["train"]["bf16"]) == (dtype, autocast)
    assert json.loads((out / "run.json").read_text())["hardware"] == machine
    with pytest.raises(ConfigError, match="train.bf16: must be true, false or auto"):
        load_config(DistillConfig, None, ["train.bf16=sometimes"])


def test_hardware_report_matches_this_machine():
    import torch

    from specdistill.precision import bf16_is_fast, hardware, resolve_dtype

    info = hardware()
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert resolve_dtype("auto") == ("bfloat16" if bf16_is_fast() else "float32")
    assert resolve_dtype("float32") == "float32"
