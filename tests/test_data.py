import json
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdistill import data, speculative
from specdistill.config import ConfigError, GenerateConfig
from specdistill.data import (
    DataError,
    format_chat,
    generate_responses,
    generated_to_teacher_rows,
    is_heldout,
    load_sharegpt,
    parse_conversations,
    split_records,
    teacher_pass,
)

text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
turn = st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt"]), "value": text})
record = st.fixed_dictionaries({
    "id": st.text(alphabet="abcdefXYZ0123456789_", min_size=1, max_size=10),
    "conversations": st.lists(turn, min_size=0, max_size=4),
})


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(records=st.lists(record, max_size=8), cut=st.floats(0, 1), indent=st.sampled_from([None, 2]))
def test_truncated_file_keeps_every_complete_record(records, cut, indent):
    full = json.dumps(records, indent=indent, ensure_ascii=False)
    at = int(len(full) * cut)
    truncated = full[:at]
    result = parse_conversations(truncated)
    # Every record whose serialisation ends before the cut must be recovered (usable or counted as skipped).
    complete = 0
    for i in range(len(records)):
        prefix = json.dumps(records[: i + 1], indent=indent, ensure_ascii=False)
        closing = prefix.rstrip("]").rstrip()
        if len(closing) <= at:
            complete += 1
    assert result.complete == complete
    assert len(result.records) + sum(result.skipped.values()) - result.skipped.get("stray text", 0) >= complete


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_arbitrary_text_never_crashes(garbage):
    result = parse_conversations(garbage)
    assert result.complete >= len(result.records)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_file_never_crashes(tmp_path_factory, blob):
    path = tmp_path_factory.mktemp("blob") / "data.json"
    path.write_bytes(blob)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # truncation/skip warnings are expected on random bytes
            load_sharegpt(path)
    except DataError:
        pass  # nothing usable is a clear error, not a crash


def test_malformed_record_in_middle_is_skipped_and_neighbours_kept():
    good = '{"id": "a", "conversations": [{"from": "human", "value": "hi"}]}'
    bad = '{"id": "b", "conversations": [{"from": "human", "value": tru}]}'
    wrong_role = '{"id": "c", "conversations": [{"from": "robot", "value": "x"}]}'
    other = good.replace('"id": "a"', '"id": "d"')
    result = parse_conversations(f"[{good},\n{bad},\n{wrong_role},\n{other}]")
    assert [r["id"] for r in result.records] == ["a", "d"]
    assert result.skipped["invalid JSON"] == 1
    assert result.skipped["unknown role"] == 1
    assert result.truncated_at is None


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text("")
    with pytest.raises(DataError, match="no usable"):
        load_sharegpt(empty)
    with pytest.raises(DataError, match="does not exist"):
        load_sharegpt(tmp_path / "nope.json")


def test_truncation_warns_with_count_and_offset(tmp_path):
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
               for i in range(5)]
    blob = json.dumps(records)
    path = tmp_path / "cut.json"
    path.write_text(blob[: len(blob) - 10])
    with pytest.warns(UserWarning, match=r"truncated at byte [\d,]+: recovered 4 complete records"):
        result = load_sharegpt(path)
    assert len(result.records) == 4


def test_split_is_deterministic_and_keeps_parts_together():
    records = [{"id": f"conv{i}_{part}", "messages": []} for i in range(200) for part in range(3)]
    train, held = split_records(records, 0.2, seed=1)
    assert split_records(records, 0.2, seed=1) == (train, held)
    held_groups = {r["id"].rsplit("_", 1)[0] for r in held}
    assert held_groups and not held_groups & {r["id"].rsplit("_", 1)[0] for r in train}
    assert 0.1 < len(held) / len(records) < 0.3
    assert is_heldout("x_1", 0.5, 0) == is_heldout("x_2", 0.5, 0)


def test_multi_turn_loss_mask_covers_assistant_tokens_only(tiny_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And the sea?"},
        {"role": "assistant", "content": "The sea is blue."},
    ]
    item = format_chat(tiny_tokenizer, messages, max_length=512)
    ids, mask = item["input_ids"], item["loss_mask"]
    assert len(ids) == len(mask)
    masked_text = tiny_tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert masked_text == "Paris.<|im_end|>The sea is blue.<|im_end|>"
    unmasked = tiny_tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert "capital of France" in unmasked and "Paris" not in unmasked
    # Truncation keeps masks aligned with the kept tokens.
    short = format_chat(tiny_tokenizer, messages, max_length=len(ids) - 3)
    assert short["loss_mask"] == mask[: len(ids) - 3]


def test_chat_without_assistant_turn_gives_none(tiny_tokenizer):
    assert format_chat(tiny_tokenizer, [{"role": "user", "content": "hi"}], 64) is None


class Interrupt(Exception):
    pass


def test_generation_resumes_without_duplicates_or_gaps(tmp_path, tiny_tokenizer, tiny_target, monkeypatch):
    prompts = [(f"p{i}", [{"role": "user", "content": "word " * (i % 5 + 1)}]) for i in range(10)]
    kwargs = {"max_prompt_tokens": 64, "max_new_tokens": 6, "batch_size": 3, "temperature": 1.0, "seed": 7}
    reference = generate_responses(tiny_target, tiny_tokenizer, prompts, tmp_path / "ref", **kwargs)

    original = speculative.target_generate_stream

    def dying_generate(*args, **kw):  # killed after two batches were written, others in flight
        for done, item in enumerate(original(*args, **kw)):
            if done == 2:
                raise Interrupt("killed")
            yield item

    monkeypatch.setattr(speculative, "target_generate_stream", dying_generate)
    with pytest.raises(Interrupt):
        generate_responses(tiny_target, tiny_tokenizer, prompts, tmp_path / "run", **kwargs)
    assert len(list((tmp_path / "run").glob("shard-*"))) == 2  # two complete batches survived
    monkeypatch.setattr(speculative, "target_generate_stream", original)
    resumed = generate_responses(tiny_target, tiny_tokenizer, prompts, tmp_path / "run", **kwargs)
    ids = sorted(resumed["prompt_id"])
    assert ids == sorted(p[0] for p in prompts)
    assert sorted(zip(resumed["prompt_id"], map(tuple, resumed["response_ids"]))) == \
        sorted(zip(reference["prompt_id"], map(tuple, reference["response_ids"])))
    with pytest.raises(DataError, match="other settings"):
        generate_responses(tiny_target, tiny_tokenizer, prompts, tmp_path / "run", **{**kwargs, "seed": 8})


def test_generation_time_limit_keeps_a_partial_set_that_a_later_run_completes(tmp_path, tiny_tokenizer, tiny_target):
    prompts = [(f"p{i}", [{"role": "user", "content": "word " * (i % 5 + 1)}]) for i in range(10)]
    kwargs = {"max_prompt_tokens": 64, "max_new_tokens": 6, "batch_size": 3, "temperature": 1.0, "seed": 7}
    reference = generate_responses(tiny_target, tiny_tokenizer, prompts, tmp_path / "ref", **kwargs)
    rows = lambda ds: sorted(zip(ds["prompt_id"], map(tuple, ds["response_ids"])))

    # A limit that is always exceeded: the first call still makes one batch (there is always data) ...
    with pytest.warns(UserWarning, match="budget is spent with 1 of 4 batches"):
        partial = generate_responses(tiny_target, tiny_tokenizer, prompts, tmp_path / "run", max_minutes=1e-9,
                                     **kwargs)
    assert set(rows(partial)) < set(rows(reference))  # the same samples as an uninterrupted run, fewer of them
    # ... and the budget is the set's, not the call's: the same call again (the trainer after the demo's own
    # generation step, or a resumed run) adds nothing.
    with pytest.warns(UserWarning, match="budget is spent with 1 of 4 batches"):
        again = generate_responses(tiny_target, tiny_tokenizer, prompts, tmp_path / "run", max_minutes=1e-9, **kwargs)
    assert rows(again) == rows(partial)
    # A larger budget (0 = none) completes the set.
    partial = generate_responses(tiny_target, tiny_tokenizer, prompts, tmp_path / "run", max_minutes=0, **kwargs)
    assert len(list((tmp_path / "run").glob("shard-*"))) == 4
    assert rows(partial) == rows(reference)
    with pytest.raises(ConfigError, match="generate.max_minutes"):
        GenerateConfig(max_minutes=-1)

    # A pool of 9 rows (three batches at once) starts nothing after the budget either, and samples the same rows.
    with pytest.warns(UserWarning, match="budget is spent with 1 of 4 batches"):
        pooled = generate_responses(tiny_target, tiny_tokenizer, prompts, tmp_path / "pool", max_minutes=1e-9,
                                    max_active_rows=9, **kwargs)
    assert set(rows(pooled)) < set(rows(reference))
    pooled = generate_responses(tiny_target, tiny_tokenizer, prompts, tmp_path / "pool", max_active_rows=9, **kwargs)
    assert rows(pooled) == rows(reference)
    with pytest.raises(ConfigError, match="generate.max_active_rows"):
        GenerateConfig(max_active_rows=-1)


def test_generation_stores_the_teacher_it_sampled_from(tmp_path, tiny_tokenizer, tiny_target):
    """generate.teacher_top_k: the stored top-k is the target's full-forward top-k at each loss position."""
    import torch

    from specdistill.losses import teacher_topk
    from specdistill.trainer import pad_batch

    prompts = [(f"p{i}", [{"role": "user", "content": "word " * (i % 4 + 1)}]) for i in range(6)]
    kwargs = {"max_prompt_tokens": 64, "max_new_tokens": 7, "batch_size": 4, "temperature": 0.0}
    plain = generate_responses(tiny_target, tiny_tokenizer, prompts, tmp_path / "plain", **kwargs)
    stored = generate_responses(tiny_target, tiny_tokenizer, prompts, tmp_path / "teacher", teacher_top_k=5, **kwargs)
    assert list(map(tuple, stored["response_ids"])) == list(map(tuple, plain["response_ids"]))  # same sampling
    rows = generated_to_teacher_rows(stored, seq_len=10_000, top_k=3)
    for gen_row, row in zip(stored, rows):
        reply = gen_row["response_ids"]
        assert len(gen_row["topk_ids"]) == len(reply) and all(len(t) == 5 for t in gen_row["topk_ids"])
        assert [t[0] for t in gen_row["topk_ids"]] == reply  # greedy: each token is its own top-1
        batch = pad_batch([row], 10_000, tiny_tokenizer.pad_token_id)
        with torch.inference_mode():
            logits = tiny_target(input_ids=batch["input_ids"]).logits[0, :-1][batch["select"][0]]
        ids, logp = teacher_topk(logits, 3)
        assert torch.equal(torch.tensor(row["topk_ids"]), ids)
        torch.testing.assert_close(torch.tensor(row["topk_logp"]), logp, atol=2e-3, rtol=2e-3)  # stored as fp16

    # A reply cut by seq_len keeps exactly the teacher rows of its kept loss positions.
    cut_len = len(stored[0]["prompt_ids"]) + 3
    for row in generated_to_teacher_rows(stored, seq_len=cut_len, top_k=5):
        select = pad_batch([row], cut_len, tiny_tokenizer.pad_token_id)["select"]
        assert len(row["topk_ids"]) == int(select.sum())
    with pytest.raises(DataError, match="exceeds the 5 teacher entries"):
        generated_to_teacher_rows(stored, seq_len=64, top_k=6)
    with pytest.raises(DataError, match="no teacher log-probs"):
        generated_to_teacher_rows(plain, seq_len=64, top_k=2)


def test_generation_stores_the_teacher_at_prompt_positions(tmp_path, monkeypatch, tiny_tokenizer, tiny_target):
    """generate.prompt_teacher + train.prompt_loss: prompt tokens 1..P-1 become loss tokens whose stored
    teacher is the target's full-forward top-k, also when the prefill runs in several chunks."""
    import torch

    from specdistill.config import DistillConfig, load_config
    from specdistill.losses import teacher_topk
    from specdistill.trainer import pad_batch

    monkeypatch.setattr(speculative, "PREFILL_CHUNK", 5)  # the prompts below span 1–4 chunks
    prompts = [(f"p{i}", [{"role": "user", "content": "word " * (3 * i + 1)}]) for i in range(5)]
    kwargs = {"max_prompt_tokens": 64, "max_new_tokens": 6, "batch_size": 3, "temperature": 0.0, "teacher_top_k": 4}
    replies_only = generate_responses(tiny_target, tiny_tokenizer, prompts, tmp_path / "replies", **kwargs)
    stored = generate_responses(tiny_target, tiny_tokenizer, prompts, tmp_path / "prompts", prompt_teacher=True,
                                **kwargs)
    assert list(map(tuple, stored["response_ids"])) == list(map(tuple, replies_only["response_ids"]))
    assert stored["topk_ids"] == replies_only["topk_ids"]  # the chunked prefill changes nothing downstream
    rows = generated_to_teacher_rows(stored, seq_len=10_000, top_k=4, prompt_loss=True)
    for gen_row, row in zip(stored, rows):
        prompt = gen_row["prompt_ids"]
        assert len(gen_row["prompt_topk_ids"]) == len(prompt) - 1
        assert sum(row["loss_mask"]) == len(prompt) - 1 + len(gen_row["response_ids"])
        batch = pad_batch([row], 10_000, tiny_tokenizer.pad_token_id)
        with torch.inference_mode():
            logits = tiny_target(input_ids=batch["input_ids"]).logits[0, :-1][batch["select"][0]]
        ids, logp = teacher_topk(logits, 4)
        assert torch.equal(torch.tensor(row["topk_ids"]), ids)
        torch.testing.assert_close(torch.tensor(row["topk_logp"]), logp, atol=2e-3, rtol=2e-3)
    # A window that ends inside the prompt keeps exactly its loss positions' teacher rows.
    for cut_len in (3, len(stored[-1]["prompt_ids"]) + 2):
        for row in generated_to_teacher_rows(stored, seq_len=cut_len, top_k=4, prompt_loss=True):
            select = pad_batch([row], cut_len, tiny_tokenizer.pad_token_id)["select"]
            assert len(row["topk_ids"]) == int(select.sum())
    with pytest.raises(DataError, match="generate.prompt_teacher=true"):
        generated_to_teacher_rows(replies_only, seq_len=64, top_k=4, prompt_loss=True)
    with pytest.raises(ConfigError, match="generate.prompt_teacher"):
        GenerateConfig(prompt_teacher=True)
    with pytest.raises(ConfigError, match="train.prompt_loss"):
        load_config(DistillConfig, None, ["train.prompt_loss=true", "train.data_mode=cache",
                                          "generate.teacher_top_k=64"])


def test_generation_stores_the_targets_hidden_state_behind_each_reply_token(tmp_path, tiny_tokenizer, tiny_target):
    """generate.teacher_hidden_layer: the stored state is layer L's output of a full forward over prompt + reply, at
    the position that predicts each reply token, also with rows joining and leaving a pool (max_active_rows)."""
    import torch

    from specdistill.trainer import pad_batch, stored_hidden_states

    prompts = [(f"p{i}", [{"role": "user", "content": "word " * (i % 5 + 1)}]) for i in range(7)]
    kwargs = {"max_prompt_tokens": 64, "max_new_tokens": 6, "batch_size": 3, "temperature": 1.0, "teacher_top_k": 4,
              "max_active_rows": 5}
    stored = generate_responses(tiny_target, tiny_tokenizer, prompts, tmp_path / "hidden", teacher_hidden_layer=1,
                                **kwargs)
    rows = generated_to_teacher_rows(stored, seq_len=10_000, top_k=4, hidden=True)
    # Nothing is cut here, so the columns passed through as stored: the same rows the row-by-row packing makes.
    assert rows.features == data._pack_rowwise(stored, 10_000, 4, False, True).features
    assert rows.to_list() == data._pack_rowwise(stored, 10_000, 4, False, True).to_list()
    captured = {}
    hook = tiny_target.model.layers[0].register_forward_hook(lambda m, a, out: captured.__setitem__("h", out))
    try:
        for row in rows:
            batch = pad_batch([row], 10_000, tiny_tokenizer.pad_token_id)
            with torch.inference_mode():
                tiny_target(input_ids=batch["input_ids"])
            want = captured["h"][0, :-1][batch["select"][0]]
            torch.testing.assert_close(torch.tensor(row["hidden"]), want, atol=3e-3, rtol=3e-3)  # stored as fp16
    finally:
        hook.remove()
    # Read back in one piece (trainer.stored_hidden_states): the same states, row by row.
    states, bounds = stored_hidden_states(rows)
    assert states.dtype == torch.float16 and states.shape[1] == tiny_target.config.hidden_size
    assert len(bounds) == len(rows) + 1 and bounds[-1] == len(states)
    for i, row in enumerate(rows):
        assert torch.equal(states[bounds[i]: bounds[i + 1]], torch.tensor(row["hidden"]).half())
    # A reply cut by seq_len keeps exactly its kept positions' states.
    cut_len = len(stored[0]["prompt_ids"]) + 2
    for row in generated_to_teacher_rows(stored, seq_len=cut_len, top_k=4, hidden=True):
        assert len(row["hidden"]) == sum(row["loss_mask"])
    plain = generate_responses(tiny_target, tiny_tokenizer, prompts, tmp_path / "plain", **kwargs)
    with pytest.raises(DataError, match="teacher_hidden_layer"):
        generated_to_teacher_rows(plain, seq_len=64, top_k=4, hidden=True)
    with pytest.raises(ValueError, match="decoder layers"):
        generate_responses(tiny_target, tiny_tokenizer, prompts, tmp_path / "deep", teacher_hidden_layer=9, **kwargs)

    # Two layers, side by side; the last one after the final norm, as output_hidden_states reports it.
    both = generate_responses(tiny_target, tiny_tokenizer, prompts, tmp_path / "both", teacher_hidden_layer=[1, 2],
                              **kwargs)
    assert both["response_ids"] == stored["response_ids"]  # what is stored does not change what is sampled
    for row in generated_to_teacher_rows(both, seq_len=10_000, top_k=4, hidden=True):
        batch = pad_batch([row], 10_000, tiny_tokenizer.pad_token_id)
        with torch.inference_mode():
            out = tiny_target(input_ids=batch["input_ids"], output_hidden_states=True)
        want = torch.cat([out.hidden_states[1], out.hidden_states[2]], -1)[0, :-1][batch["select"][0]]
        torch.testing.assert_close(torch.tensor(row["hidden"]), want, atol=3e-3, rtol=3e-3)


class _Killed(Exception):
    pass


def test_teacher_pass_stores_the_targets_top_k_and_state_at_each_loss_token_and_resumes(tmp_path, tiny_tokenizer,
                                                                                      tiny_target, monkeypatch):
    """train.data_mode=fixed-cache's data: per loss token of a fixed reply, the target's top-k log-probs and its
    layer-1 state at the position before, as a forward of that row alone gives them; killed or out of budget, a
    later call completes the same set."""
    import datasets
    import torch

    from specdistill import losses

    chats = [format_chat(tiny_tokenizer, [{"role": "user", "content": "word " * (i % 4 + 1)},
                                          {"role": "assistant", "content": "reply " * (i % 5 + 2)}], 64)
             for i in range(10)]
    rows = datasets.Dataset.from_list(chats)
    kwargs = {"top_k": 5, "hidden_layer": 1, "rows_per_forward": 3, "rows_per_shard": 4}
    reference = teacher_pass(tiny_target, rows, tmp_path / "ref", **kwargs)
    assert sorted(map(tuple, reference["input_ids"])) == sorted(tuple(c["input_ids"]) for c in chats)
    for row in reference:
        ids = torch.tensor([row["input_ids"]])
        with torch.inference_mode():
            out = tiny_target(input_ids=ids, output_hidden_states=True)
        at = torch.tensor(row["loss_mask"][1:], dtype=torch.bool).nonzero().squeeze(1)
        assert row["loss_mask"][0] == 0 and len(at) == sum(row["loss_mask"]) == len(row["topk_ids"]) > 0
        logp = out.logits[0, at].log_softmax(-1)
        want_logp, want_ids = logp.topk(5, -1)
        assert torch.equal(torch.tensor(row["topk_ids"]), want_ids)
        assert torch.allclose(torch.tensor(row["topk_logp"]), want_logp, atol=2e-2)  # stored in fp16
        assert torch.allclose(torch.tensor(row["hidden"]), out.hidden_states[1][0, at], atol=2e-2)

    # Two layers side by side, the last one after the final norm (output_hidden_states' last entry).
    both = teacher_pass(tiny_target, rows, tmp_path / "both", **{**kwargs, "hidden_layer": [1, 2]})
    for row in both:
        with torch.inference_mode():
            out = tiny_target(input_ids=torch.tensor([row["input_ids"]]), output_hidden_states=True)
        at = torch.tensor(row["loss_mask"][1:], dtype=torch.bool).nonzero().squeeze(1)
        want = torch.cat([out.hidden_states[1][0, at], out.hidden_states[2][0, at]], -1)
        assert torch.allclose(torch.tensor(row["hidden"]), want, atol=2e-2)

    as_set = lambda ds: sorted(
        (tuple(ids), tuple(map(tuple, topk))) for ids, topk in zip(ds["input_ids"], ds["topk_ids"])
    )
    calls = {"n": 0}
    original = losses.teacher_topk

    def dying_topk(*args, **kw):  # killed inside the second shard: the first is on disk, the second is not
        calls["n"] += 1
        if calls["n"] == 6:
            raise _Killed("killed")
        return original(*args, **kw)

    monkeypatch.setattr(losses, "teacher_topk", dying_topk)
    with pytest.raises(_Killed):
        teacher_pass(tiny_target, rows, tmp_path / "run", **kwargs)
    assert len(list((tmp_path / "run").glob("shard-*"))) == 1
    monkeypatch.setattr(losses, "teacher_topk", original)
    # A budget always exceeded adds nothing to a set that has data; no budget completes it.
    with pytest.warns(UserWarning, match="budget is spent with 1 of 3 shards"):
        partial = teacher_pass(tiny_target, rows, tmp_path / "run", max_minutes=1e-9, **kwargs)
    assert len(partial) == 4 and set(as_set(partial)) < set(as_set(reference))
    assert as_set(teacher_pass(tiny_target, rows, tmp_path / "run", **kwargs)) == as_set(reference)

    with pytest.raises(DataError, match="other settings"):
        teacher_pass(tiny_target, rows, tmp_path / "run", **{**kwargs, "top_k": 4})
    with pytest.raises(DataError, match="has 2 decoder layers"):
        teacher_pass(tiny_target, rows, tmp_path / "bad", **{**kwargs, "hidden_layer": 3})
    with pytest.raises(DataError, match="teacher_top_k must be > 0"):
        teacher_pass(tiny_target, rows, tmp_path / "bad", **{**kwargs, "top_k": 0})
