"""Shared fixtures: a tiny byte-level BPE tokenizer with a ChatML template and tiny random Llama models.

Everything is built locally from config: no network, no SmolLM2 (that is for `slow` tests).
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding lets a small draft model propose tokens that a target verifies.",
    "Write a short poem about the sea and the sky, and explain each line.",
    "What is the capital of France? The capital of France is Paris.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000, and punctuation: !?;:'\"()[]{}",
] * 20


def make_tokenizer(vocab_size: int = 320, special=("<|endoftext|>", "<|im_start|>", "<|im_end|>")):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=special[1], eos_token=special[2],
                                   pad_token=special[2], unk_token=special[0])
    fast.chat_template = CHATML
    return fast


def make_llama(vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               seed: int = 0, tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=hidden // heads, max_position_embeddings=512, tie_word_embeddings=tie,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_pair_dir(tmp_path_factory, tiny_tokenizer):
    """HF folders for a 2-layer target and a 1-layer draft sharing the tiny tokenizer."""
    root = tmp_path_factory.mktemp("pair")
    target = make_llama(len(tiny_tokenizer), hidden=64, layers=2, seed=0)
    draft = make_llama(len(tiny_tokenizer), hidden=64, layers=1, seed=1)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tiny_tokenizer.save_pretrained(root / name)
    return root


@pytest.fixture
def tiny_target(tiny_tokenizer):
    return make_llama(len(tiny_tokenizer), hidden=64, layers=2, seed=0)


@pytest.fixture(scope="session")
def conversations(tmp_path_factory):
    """A small ShareGPT-format file so the tests need neither the real data nor the network."""
    words = ["the", "sea", "sky", "fox", "dog", "poem", "capital", "France", "Paris", "draft", "model", "token", "quick", "brown", "lazy"]
    records = []
    for i in range(48):
        q = " ".join(words[(i + j) % len(words)] for j in range(6))
        a = " ".join(words[(i * 3 + j) % len(words)] for j in range(12))
        records.append({"id": f"c{i}_0", "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
    path = tmp_path_factory.mktemp("data") / "chats.json"
    path.write_text(json.dumps(records))
    return path
