"""Slow tests on the real embedded SmolLM2 target (``make test-slow``)."""

import pytest
import torch

pytestmark = pytest.mark.slow


def test_smollm2_greedy_reply_to_mtbench_is_text():
    from specdistill.data import load_mtbench
    from specdistill.models import load_model, load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    model = load_model("smollm2-135m", "bfloat16")
    question = load_mtbench()[0]
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": question["turns"][0]}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    reply = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert len(reply.strip()) > 10 and any(c.isalpha() for c in reply)


def test_shipped_sharegpt_recovers_17671_records():
    from specdistill.data import load_sharegpt

    with pytest.warns(UserWarning, match="17,671 complete records"):
        result = load_sharegpt()
    assert result.complete == 17671
