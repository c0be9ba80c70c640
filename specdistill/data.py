"""Data: ShareGPT (truncated-file recovery), chat formatting with assistant-only loss masks, MT-bench,
and resumable target-generated responses (the default distillation data).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import datasets

from .config import hidden_layers

logger = logging.getLogger(__name__)

ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "assistant": "assistant",
    "system": "system",
}
_WHITESPACE = " \t\r\n"


class DataError(ValueError):
    """Input data cannot be used at all (missing file, nothing recoverable)."""


@dataclass
class ShareGPTLoad:
    records: list[dict]
    skipped: Counter = field(default_factory=Counter)
    truncated_at: int | None = None  # byte offset of the incomplete trailing record, if any
    total_bytes: int = 0
    complete: int = 0  # records decoded whole, usable or not
    raw_turns: int = 0  # turns in those records, before normalisation

    @property
    def num_turns(self) -> int:
        return sum(len(r["messages"]) for r in self.records)

    def summary(self) -> str:
        parts = [f"{self.complete:,} complete records ({self.raw_turns:,} turns) recovered",
                 f"{len(self.records):,} usable conversations"]
        if self.skipped:
            parts.append("skipped " + ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())))
        if self.truncated_at is not None:
            parts.append(f"file truncated at byte {self.truncated_at:,} of {self.total_bytes:,}")
        return "; ".join(parts)


def _scan_object_end(text: str, start: int) -> int | None:
    """End index (exclusive) of the brace-balanced object at ``start``, string-aware; None if EOF first."""
    depth, in_string, escape = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _normalise(record) -> tuple[dict | None, str | None]:
    """ShareGPT record -> {"id", "messages": [{"role", "content"}]} or (None, reason)."""
    if not isinstance(record, dict):
        return None, "not an object"
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list):
        return None, "no conversations list"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, "turn is not an object"
        role = ROLE_MAP.get(str(turn.get("from", turn.get("role", ""))).lower())
        content = turn.get("value", turn.get("content"))
        if role is None:
            return None, "unknown role"
        if not isinstance(content, str):
            return None, "turn text is not a string"
        messages.append({"role": role, "content": content})
    # Conversations that open with the assistant (ShareGPT's split parts) start at the first user turn.
    while messages and messages[0]["role"] == "assistant":
        messages.pop(0)
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        return None, "no user turn"
    record_id = record.get("id", record.get("question_id"))
    return {"id": str(record_id) if record_id is not None else "", "messages": messages}, None


def parse_conversations(text: str) -> ShareGPTLoad:
    """Decode a JSON array (or a stream / JSONL) of conversation records one object at a time.

    A truncated tail is reported, not fatal; a malformed record in the middle is skipped and counted,
    and decoding resumes after it, so no complete record is ever lost.
    """
    decoder = json.JSONDecoder()
    result = ShareGPTLoad(records=[], total_bytes=len(text.encode("utf-8", errors="replace")))
    pos, n = 0, len(text)
    if text.startswith("\ufeff"):
        pos = 1
    while pos < n:
        ch = text[pos]
        if ch in _WHITESPACE or ch in ",[]":
            pos += 1
            continue
        if ch != "{":
            # Not the start of a record: skip to the next candidate.
            nxt = text.find("{", pos)
            result.skipped["stray text"] += 1
            if nxt < 0:
                break
            pos = nxt
            continue
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            end = _scan_object_end(text, pos)
            if end is None:
                result.truncated_at = len(text[:pos].encode("utf-8", errors="replace"))
                break
            result.skipped["invalid JSON"] += 1
            pos = end
            continue
        result.complete += 1
        if isinstance(obj, dict) and isinstance(obj.get("conversations"), list):
            result.raw_turns += len(obj["conversations"])
        record, reason = _normalise(obj)
        if record is None:
            result.skipped[reason] += 1
        else:
            if not record["id"]:
                record["id"] = f"record-{len(result.records)}"
            result.records.append(record)
        pos = end
    return result


def load_sharegpt(path: str | Path | None = None, max_records: int = 0) -> ShareGPTLoad:
    from .assets import sharegpt_path

    path = Path(path) if path else sharegpt_path()
    if not path.is_file():
        raise DataError(f"conversation file {path} does not exist")
    text = path.read_bytes().decode("utf-8", errors="replace")
    result = parse_conversations(text)
    if result.truncated_at is not None:
        warnings.warn(
            f"{path.name} is truncated at byte {result.truncated_at:,}: recovered "
            f"{result.complete:,} complete records before the break",
            stacklevel=2,
        )
    if result.skipped:
        warnings.warn(f"{path.name}: skipped unusable records: {dict(result.skipped)}", stacklevel=2)
    if not result.records:
        raise DataError(f"{path}: no usable conversation records ({result.summary()})")
    if max_records:
        result.records = result.records[:max_records]
    return result


def load_mtbench(path: str | Path | None = None) -> list[dict]:
    """MT-bench questions: ``question_id``, ``category``, ``turns`` (two user turns)."""
    from .assets import mtbench_path

    path = Path(path) if path else mtbench_path()
    questions = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{line_no}: invalid JSON ({e})") from None
        if not isinstance(q.get("turns"), list) or not q["turns"]:
            raise DataError(f"{path}:{line_no}: question without turns")
        questions.append({"question_id": q["question_id"], "category": q.get("category", ""), "turns": q["turns"]})
    return questions


# ---------------------------------------------------------------- splitting and formatting


def conversation_group(record_id: str) -> str:
    """ShareGPT splits long chats into ``<id>_0``, ``<id>_1``...: keep the parts on one side of the split."""
    base, sep, suffix = record_id.rpartition("_")
    return base if sep and suffix.isdigit() else record_id


def is_heldout(record_id: str, fraction: float, seed: int = 0) -> bool:
    digest = hashlib.sha256(f"{seed}:{conversation_group(record_id)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_records(records: list[dict], heldout_fraction: float, seed: int = 0) -> tuple[list[dict], list[dict]]:
    train, heldout = [], []
    for r in records:
        (heldout if is_heldout(r["id"], heldout_fraction, seed) else train).append(r)
    return train, heldout


def format_chat(tokenizer, messages: list[dict], max_length: int) -> dict | None:
    """Tokenise a chat with the tokenizer's template; ``loss_mask`` marks assistant tokens only.

    Assistant spans are found by rendering growing prefixes of the chat (a template renders each prefix
    as a prefix of the whole), then mapped to tokens through the offset mapping. Each span covers the
    reply and its end-of-turn token, which the draft must learn to predict.
    """
    spans = []
    rendered_prev = None
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: k + 1], tokenize=False)
        if not upto.startswith(before):
            raise DataError("the chat template does not render prefixes consistently; cannot build loss masks")
        spans.append((len(before), len(upto.rstrip())))
        rendered_prev = upto
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    if rendered_prev is not None and not full.startswith(rendered_prev):
        raise DataError("the chat template does not render prefixes consistently; cannot build loss masks")
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, truncation=True,
                    max_length=max_length)
    input_ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(input_ids)
    for i, (start, end) in enumerate(offsets):
        for s, e in spans:
            if start >= s and end <= e and end > start:
                mask[i] = 1
                break
    if not any(mask):
        return None
    return {"input_ids": input_ids, "loss_mask": mask}


def _tokenizer_key(tokenizer) -> str:
    vocab = json.dumps(sorted(tokenizer.get_vocab().items())[:2000]) + str(len(tokenizer))
    template = tokenizer.chat_template or ""
    return hashlib.sha256((vocab + template).encode()).hexdigest()[:16]


def build_chat_dataset(tokenizer, records: list[dict], max_length: int, cache_root: Path | None = None,
                       name: str = "chats") -> datasets.Dataset:
    """Formatted, masked conversations as an Arrow dataset cached by tokenizer, records and settings."""
    from .assets import cache_dir

    ids_digest = hashlib.sha256("\n".join(r["id"] for r in records).encode()).hexdigest()[:16]
    key = f"{name}-{_tokenizer_key(tokenizer)}-{ids_digest}-L{max_length}"
    out = Path(cache_root or cache_dir()) / "datasets" / key
    if (out / "dataset_info.json").is_file():
        return datasets.load_from_disk(str(out))
    # Characters beyond ~8 per token cannot survive the token cap; cutting them first saves tokeniser time.
    char_budget = max_length * 8

    def rows():
        for r in records:
            messages, used = [], 0
            for m in r["messages"]:
                messages.append(m)
                used += len(m["content"])
                if used > char_budget:
                    break
            item = format_chat(tokenizer, messages, max_length)
            if item is not None:
                yield {"id": r["id"], **item}

    ds = datasets.Dataset.from_generator(rows, features=datasets.Features({
        "id": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
    }), cache_dir=str(Path(cache_root or cache_dir()) / "hf-datasets"))
    from .assets import atomic_write_dir

    atomic_write_dir(out, lambda tmp: ds.save_to_disk(str(tmp)))
    return datasets.load_from_disk(str(out))


def prompt_messages(record: dict) -> list[dict]:
    """The chat up to and including the first user turn: what the target is asked to answer."""
    messages = []
    for m in record["messages"]:
        messages.append(m)
        if m["role"] == "user":
            break
    return messages


# ---------------------------------------------------------------- target-generated data

GENERATED_FEATURES = datasets.Features({
    "prompt_id": datasets.Value("string"),
    "prompt_ids": datasets.Sequence(datasets.Value("int32")),
    "response_ids": datasets.Sequence(datasets.Value("int32")),
    "finished": datasets.Value("bool"),
})
# With generate.teacher_top_k: per reply token, the target's top-k ids and log-probs (the free teacher cache).
TOKEN_FEATURES = {"input_ids": datasets.Sequence(datasets.Value("int32")),
                  "loss_mask": datasets.Sequence(datasets.Value("int8"))}
TEACHER_FEATURES = {
    "topk_ids": datasets.Sequence(datasets.Sequence(datasets.Value("int32"))),
    "topk_logp": datasets.Sequence(datasets.Sequence(datasets.Value("float16"))),
}
# With generate.prompt_teacher: the same at prompt positions 0..P-2, each predicting the next prompt token.
PROMPT_TEACHER_FEATURES = {f"prompt_{name}": feature for name, feature in TEACHER_FEATURES.items()}
# With generate.teacher_hidden_layer: per reply token, the target's hidden state at that layer.
HIDDEN_FEATURES = {"hidden": datasets.Sequence(datasets.Sequence(datasets.Value("float16")))}


def _shards(out_dir: Path) -> list[Path]:
    return sorted(p for p in out_dir.glob("shard-*") if (p / "dataset_info.json").is_file())


def load_generated(out_dir: str | Path) -> datasets.Dataset:
    out_dir = Path(out_dir)
    shards = _shards(out_dir)
    if not shards:
        raise DataError(f"{out_dir}: no generated shards yet")
    return datasets.concatenate_datasets([datasets.load_from_disk(str(s)) for s in shards])


# Names the loop that wrote a generated set: caches from another loop (HF generate before) sample differently.
GENERATOR = "specdistill.target_generate_stream/1"
GENERATOR_TAG = hashlib.sha256(GENERATOR.encode()).hexdigest()[:6]  # for cache folder names


def claim_folder(out_dir: Path, settings: dict, what: str) -> None:
    """Record ``settings`` in a resumable data folder, or refuse one written with other settings: its shards
    would mix two sets."""
    meta_path = out_dir / "settings.json"
    if meta_path.is_file():
        previous = json.loads(meta_path.read_text())
        if previous != settings:
            raise DataError(f"{out_dir} holds {what} with other settings {previous}; "
                            f"use another output folder or delete it")
    else:
        meta_path.write_text(json.dumps(settings, indent=2))


def resume_shards(out_dir: Path) -> tuple[set[int], float]:
    """A resumable data folder's finished shard indices and the seconds its earlier runs spent; clears the
    half-written shards a killed run left."""
    done = {int(p.name.split("-")[1]) for p in _shards(out_dir)}
    for stale in out_dir.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    spent_path = out_dir / "generation_seconds.json"
    return done, json.loads(spent_path.read_text())["seconds"] if spent_path.is_file() else 0.0


def save_shard(out_dir: Path, index: int, shard: datasets.Dataset, seconds: float) -> None:
    """Write shard ``index`` and the folder's seconds spent so far, each atomically (a kill leaves neither half)."""
    from .assets import atomic_write_dir

    atomic_write_dir(out_dir / f"shard-{index:05d}", lambda tmp: shard.save_to_disk(str(tmp)))
    (out_dir / ".tmp-seconds.json").write_text(json.dumps({"seconds": seconds}))
    (out_dir / ".tmp-seconds.json").replace(out_dir / "generation_seconds.json")


def stored_top_k(rows: datasets.Dataset, top_k: int) -> int:
    """The teacher entries stored per token in ``rows``, checked to hold at least the ``top_k`` training reads."""
    stored = len(rows[0]["topk_ids"][0]) if len(rows) and rows[0]["topk_ids"] else top_k
    if top_k > stored:
        raise DataError(f"train.cache_top_k={top_k} exceeds the {stored} teacher entries stored per token "
                        f"(generate.teacher_top_k)")
    return stored


def generate_responses(model, tokenizer, prompts: list[tuple[str, list[dict]]], out_dir: str | Path,
                       max_prompt_tokens: int, max_new_tokens: int, batch_size: int, temperature: float = 0.0,
                       top_p: float = 1.0, seed: int = 0, max_batches: int | None = None,
                       teacher_top_k: int = 0, max_minutes: float = 0.0, prompt_teacher: bool = False,
                       max_active_rows: int = 0, teacher_hidden_layer: int | list[int] = 0) -> datasets.Dataset:
    """Generate the target's own replies to ``prompts`` (``(id, messages)``) into Arrow shards.

    ``teacher_top_k`` > 0 also stores, per reply token, the target's top-k log-probs (T=1) from the very
    forward that sampled it: logit distillation's teacher at no extra target pass (``train.data_mode=cache``).
    ``prompt_teacher`` also stores it at the prompt's positions (``prompt_topk_*``, for ``train.prompt_loss``):
    the prefill computed them anyway, only its LM head runs on every position instead of the last.
    ``teacher_hidden_layer`` > 0 also stores, per reply token, the target's residual stream after that many layers
    (``hidden``, fp16) at the position whose logits sampled it: the intermediate teacher of ``train.hidden_weight``
    (a list of layers: their states side by side; the last layer's after the final norm).

    Prompts are sorted by length (less padding) and cut into batches of ``batch_size``; up to
    ``max_active_rows`` rows (0: one batch) decode together, a new batch joining as finished rows leave
    (``speculative.target_generate_stream``). Each finished batch is one shard, written atomically, so a killed
    run resumes and redoes only the batches in flight. Each row samples with its own seed (from the shard's
    index and its row), so a resumed run draws what an uninterrupted one would, up to float rounding of the
    rows it shares the pool with.

    Batches run in a seeded random order, so the progress bar's ETA is honest and ``max_minutes`` (> 0: the
    set's generation budget, summed over every call that wrote into the folder, so a resumed or repeated call
    does not start a fresh clock) leaves a sample of all prompt lengths, not only the shortest. Once the budget
    is spent no batch starts (except a first one, so there is always data): the partial set is returned as is,
    and a call with a larger ``max_minutes`` (or 0, no limit) generates the missing batches into the same folder.
    """
    import torch
    from tqdm.auto import tqdm

    from . import speculative

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = {"generator": GENERATOR, "max_prompt_tokens": max_prompt_tokens, "max_new_tokens": max_new_tokens,
                "batch_size": batch_size, "temperature": temperature, "top_p": top_p, "seed": seed,
                "prompt_ids": hashlib.sha256("\n".join(p[0] for p in prompts).encode()).hexdigest()[:16]}
    if teacher_top_k:  # only then, so folders written before this option keep matching their settings
        settings["teacher_top_k"] = teacher_top_k
    if prompt_teacher:
        if not teacher_top_k:
            raise DataError("generate.prompt_teacher needs generate.teacher_top_k > 0")
        settings["prompt_teacher"] = True
    if teacher_hidden_layer:
        settings["teacher_hidden_layer"] = teacher_hidden_layer
    claim_folder(out_dir, settings, "data generated")

    encoded = []
    for prompt_id, messages in prompts:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        if len(ids) > max_prompt_tokens:
            continue  # a cut prompt would lose its generation header: skip rather than corrupt it
        encoded.append((prompt_id, list(ids)))
    encoded.sort(key=lambda item: (len(item[1]), item[0]))
    batches = [encoded[i: i + batch_size] for i in range(0, len(encoded), batch_size)]
    if max_batches is not None:
        batches = batches[:max_batches]
    done, spent_before = resume_shards(out_dir)

    eos_ids = eos_token_ids(model, tokenizer)
    todo = [i for i in range(len(batches)) if i not in done]
    random.Random(seed).shuffle(todo)  # the order only: each shard's content depends on its index alone
    bar = tqdm(total=len(todo), desc="target generation", unit="batch")
    started = time.perf_counter()
    admitted = []

    def admit():
        """Batches in ``todo`` order until the budget is spent (a batch already started still finishes)."""
        for index in todo:
            have = len(done) + len(admitted)
            if have and max_minutes and spent_before + time.perf_counter() - started > max_minutes * 60:
                return
            admitted.append(index)
            yield index, [ids for _, ids in batches[index]]

    generated_tokens = 0  # this run's, so a resumed run shows its own rate
    stream = speculative.target_generate_stream(
        model, admit(), max(max_active_rows, batch_size), max_new_tokens, eos_ids, temperature=temperature,
        top_p=top_p, seed=seed, record_top_k=teacher_top_k, record_prompt=prompt_teacher,
        record_hidden_layer=teacher_hidden_layer)
    for index, outputs in stream:
        batch = batches[index]
        rows = [{"prompt_id": prompt_id, "prompt_ids": ids, "response_ids": out.tokens,
                 "finished": bool(out.tokens) and out.tokens[-1] in eos_ids}
                for (prompt_id, ids), out in zip(batch, outputs)]
        features = GENERATED_FEATURES
        if teacher_top_k:
            features = datasets.Features({**GENERATED_FEATURES, **TEACHER_FEATURES})
            for row, out in zip(rows, outputs):
                row["topk_ids"] = torch.stack([ids for ids, _ in out.teacher]).int().tolist()
                row["topk_logp"] = torch.stack([logp for _, logp in out.teacher]).half().float().tolist()
        if prompt_teacher:
            features = datasets.Features({**features, **PROMPT_TEACHER_FEATURES})
            for row, out in zip(rows, outputs):
                row["prompt_topk_ids"] = torch.stack([ids for ids, _ in out.prompt_teacher]).int().tolist()
                row["prompt_topk_logp"] = torch.stack([lp for _, lp in out.prompt_teacher]).half().float().tolist()
        if teacher_hidden_layer:
            features = datasets.Features({**features, **HIDDEN_FEATURES})
            for row, out in zip(rows, outputs):
                row["hidden"] = torch.stack(out.hidden).half().float().numpy()
        save_shard(out_dir, index, datasets.Dataset.from_list(rows, features=features),
                   spent_before + time.perf_counter() - started)
        generated_tokens += sum(len(r["response_ids"]) for r in rows)
        bar.update(1)
        bar.set_postfix(reply_tokens=generated_tokens, tok_s=f"{generated_tokens / (time.perf_counter() - started):.0f}")
    bar.close()
    if len(admitted) < len(todo):
        have = len(done) + len(admitted)
        warnings.warn(f"generate.max_minutes={max_minutes:g}: the set's generation budget is spent with {have} of "
                      f"{len(batches)} batches; training uses those. A run with a larger generate.max_minutes "
                      f"(0 = no limit) generates the other {len(batches) - have} into {out_dir}", stacklevel=2)
    return load_generated(out_dir)


def eos_token_ids(model, tokenizer) -> list[int]:
    ids = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return sorted(ids)


def generated_to_teacher_rows(ds: datasets.Dataset, seq_len: int, top_k: int, prompt_loss: bool = False,
                              hidden: bool = False) -> datasets.Dataset:
    """Generated rows with a stored teacher -> the offline teacher cache's layout (``trainer.build_teacher_cache``).

    The teacher rows follow the loss positions in order, cut where ``seq_len`` cuts the reply, and keep the
    ``top_k`` most likely of the stored entries (stored sorted, so that is again a top-k). ``prompt_loss``
    also makes prompt tokens 1..P-1 loss tokens, with the teacher stored there (``generate.prompt_teacher``).
    ``hidden`` keeps the stored hidden states (``generate.teacher_hidden_layer``), cut like the teacher.
    """
    if "topk_ids" not in ds.column_names:
        raise DataError("this generated set holds no teacher log-probs: generate it with generate.teacher_top_k > 0")
    if prompt_loss and "prompt_topk_ids" not in ds.column_names:
        raise DataError("train.prompt_loss needs the teacher at prompt positions: generate the set with "
                        "generate.prompt_teacher=true")
    if hidden and "hidden" not in ds.column_names:
        raise DataError("train.hidden_weight needs the target's hidden states: generate the set with "
                        "generate.teacher_hidden_layer > 0")
    stored = stored_top_k(ds, top_k)
    if not prompt_loss and stored == top_k and len(ds) and _all_fit(ds, seq_len):
        # Nothing to cut: the teacher (and hidden-state) columns pass through Arrow column for Arrow column. The
        # per-row Python round trip of 2 × 64 teacher numbers and 576 hidden ones per token took 56 s for 1,856
        # replies (≈ 3 min for a full preset's 5,722), all of it spent copying; this takes 0.3 s.
        teacher = ["topk_ids", "topk_logp", *(["hidden"] if hidden else [])]
        tokens = ds.map(lambda prompt, reply: {"input_ids": prompt + reply,
                                               "loss_mask": [0] * len(prompt) + [1] * len(reply)},
                        input_columns=["prompt_ids", "response_ids"], remove_columns=ds.column_names,
                        desc="pack generated data", features=datasets.Features(TOKEN_FEATURES))
        return datasets.concatenate_datasets([tokens, ds.select_columns(teacher)], axis=1)
    return _pack_rowwise(ds, seq_len, top_k, prompt_loss, hidden)


def _all_fit(ds: datasets.Dataset, seq_len: int) -> bool:
    """Whether every row's prompt + reply fits in ``seq_len`` tokens (read from Arrow list lengths)."""
    import pyarrow.compute as pc

    table = ds.with_format("arrow")[:]
    lengths = pc.add(pc.list_value_length(table["prompt_ids"]), pc.list_value_length(table["response_ids"]))
    return pc.max(lengths).as_py() <= seq_len


def _pack_rowwise(ds: datasets.Dataset, seq_len: int, top_k: int, prompt_loss: bool, hidden: bool
                  ) -> datasets.Dataset:
    """``generated_to_teacher_rows`` row by row: where prompts join the loss or replies are cut."""

    def convert(row):
        prompt, reply = row["prompt_ids"], row["response_ids"]
        kept = max(0, min(len(reply), seq_len - len(prompt)))
        ids, logp = row["topk_ids"][:kept], row["topk_logp"][:kept]
        prompt_mask = [0] * len(prompt)
        if prompt_loss:
            in_window = min(len(prompt), seq_len) - 1  # prompt tokens 1.. inside the window
            prompt_mask = [0] + [1] * (len(prompt) - 1)
            ids, logp = row["prompt_topk_ids"][:in_window] + ids, row["prompt_topk_logp"][:in_window] + logp
        packed = {"input_ids": (prompt + reply)[:seq_len], "loss_mask": (prompt_mask + [1] * len(reply))[:seq_len],
                  "topk_ids": [t[:top_k] for t in ids], "topk_logp": [t[:top_k] for t in logp]}
        if hidden:
            packed["hidden"] = row["hidden"][:kept]
        return packed

    return ds.map(convert, remove_columns=ds.column_names, desc="pack generated data + teacher",
                  features=datasets.Features({**TOKEN_FEATURES, **TEACHER_FEATURES,
                                              **(HIDDEN_FEATURES if hidden else {})}))


def generated_to_training(ds: datasets.Dataset) -> datasets.Dataset:
    """Generated rows -> ``input_ids`` (prompt + reply) and ``loss_mask`` (reply tokens only)."""
    def convert(row):
        return {"id": row["prompt_id"], "input_ids": row["prompt_ids"] + row["response_ids"],
                "loss_mask": [0] * len(row["prompt_ids"]) + [1] * len(row["response_ids"])}

    return ds.map(convert, remove_columns=ds.column_names, desc="pack generated data")



def sharegpt_prompts(records: list[dict], num_prompts: int, max_chars: int, seed: int = 0) -> list[tuple[str, list]]:
    """First-turn prompts from ShareGPT records, shuffled deterministically, short enough to keep whole."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    prompts = []
    for i in order:
        messages = prompt_messages(records[i])
        if messages[-1]["role"] == "user" and 0 < sum(len(m["content"]) for m in messages) <= max_chars:
            prompts.append((records[i]["id"], messages))
            if len(prompts) == num_prompts:
                break
    return prompts


def sharegpt_conversations(records: list[dict], count: int, seed: int = 0) -> list[dict]:
    """``count`` records in a seeded random order (all of them if fewer): the fixed replies of a teacher pass."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    return [records[i] for i in order[:count]]


def generated_dir(target_path: str, gen, data, split: str = "train") -> Path:
    """Cache folder for target-generated data, keyed by target, source data and generation settings."""
    from .assets import cache_dir

    parts = [GENERATOR, target_path, split, data.source, data.heldout_fraction, data.seed, gen.num_prompts,
             gen.max_prompt_tokens, gen.max_new_tokens, gen.temperature, gen.top_p, gen.seed]
    if gen.teacher_top_k:  # appended only when set, so existing caches keep their folder
        parts.append(f"teacher-top{gen.teacher_top_k}")
    if gen.prompt_teacher:
        parts.append("prompt-teacher")
    if gen.teacher_hidden_layer:
        parts.append("hidden-L" + "-".join(map(str, hidden_layers(gen.teacher_hidden_layer))))
    key = json.dumps(parts)
    name = Path(target_path).name or "target"
    return cache_dir() / "generated" / f"{name}-{split}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def target_generated_dataset(model, tokenizer, target_path: str, data, gen, records: list[dict] | None = None,
                             split: str = "train") -> datasets.Dataset:
    """The target's own replies to ShareGPT prompts from ``split``: generated once, then cached."""
    if records is None:
        loaded = load_conversations(data)
        train, heldout = split_records(loaded, data.heldout_fraction, data.seed)
        records = train if split == "train" else heldout
    prompts = sharegpt_prompts(records, gen.num_prompts, max_chars=gen.max_prompt_tokens * 3, seed=gen.seed)
    return generate_responses(model, tokenizer, prompts, generated_dir(target_path, gen, data, split),
                              max_prompt_tokens=gen.max_prompt_tokens, max_new_tokens=gen.max_new_tokens,
                              batch_size=gen.batch_size, temperature=gen.temperature, top_p=gen.top_p, seed=gen.seed,
                              teacher_top_k=gen.teacher_top_k, max_minutes=gen.max_minutes,
                              prompt_teacher=gen.prompt_teacher, max_active_rows=gen.max_active_rows,
                              teacher_hidden_layer=gen.teacher_hidden_layer)


def load_conversations(data) -> list[dict]:
    """Records for ``data.source``: the embedded ShareGPT, MT-bench turn 1, or a local conversation file."""
    if data.source == "mtbench":
        return [{"id": f"mtbench-{q['question_id']}", "category": q["category"],
                 "messages": [{"role": "user", "content": q["turns"][0]}]} for q in load_mtbench()]
    path = None if data.source == "sharegpt" else data.source
    return load_sharegpt(path, max_records=data.max_records).records


# ---------------------------------------------------------------- the teacher over fixed replies

# Names the code that wrote a teacher-pass set (part of its folder key and settings).
TEACHER_PASS = "specdistill.teacher_pass/1"


def teacher_pass(model, rows: datasets.Dataset, out_dir: str | Path, top_k: int, hidden_layer: int | list[int] = 0,
                 rows_per_forward: int = 8, rows_per_shard: int = 32, max_minutes: float = 0.0,
                 seed: int = 0) -> datasets.Dataset:
    """The target's top-k log-probs (T=1) at every loss position of fixed rows (``input_ids``, ``loss_mask``:
    ShareGPT's own replies), and with ``hidden_layer`` > 0 its residual stream after that many layers at the
    position before each loss token (fp16; a list of layers: side by side, the last one after the final norm), in
    the layout ``generated_to_teacher_rows`` gives generated sets.

    One teacher-forced forward per ``rows_per_forward`` rows scores every position at once (a decode step, one
    per row): 1.86× the stored tokens per minute of the pooled generation on 2 Zen 4 cores in bf16, at the price
    of contexts the target did not write (17 % less greedy α at an equal budget, docs/results.md). Rows are
    sorted by length (less padding) and cut into shards of ``rows_per_shard``, written atomically in a seeded
    random order, so a killed pass resumes and ``max_minutes`` (> 0, summed over every call into the folder)
    leaves a random sample of lengths, as ``generate_responses`` does.
    """
    import torch
    from tqdm.auto import tqdm

    from .losses import teacher_topk

    if top_k < 1:
        raise DataError("the teacher pass stores the target's top-k: generate.teacher_top_k must be > 0")
    layers = model.config.num_hidden_layers
    wanted = hidden_layers(hidden_layer)
    if not all(1 <= layer <= layers for layer in wanted):
        raise DataError(f"generate.teacher_hidden_layer={hidden_layer}: the target has {layers} decoder layers")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = {"generator": TEACHER_PASS, "rows": rows._fingerprint, "num_rows": len(rows), "top_k": top_k,
                "hidden_layer": hidden_layer, "rows_per_shard": rows_per_shard, "seed": seed,
                "dtype": str(model.dtype)}
    claim_folder(out_dir, settings, "a teacher pass")

    lengths = [len(ids) for ids in rows["input_ids"]]
    order = sorted(range(len(rows)), key=lambda i: (lengths[i], i))
    shards = [order[i: i + rows_per_shard] for i in range(0, len(order), rows_per_shard)]
    done, spent_before = resume_shards(out_dir)
    todo = [i for i in range(len(shards)) if i not in done]
    random.Random(seed).shuffle(todo)
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int8")),
                                  **TEACHER_FEATURES, **(HIDDEN_FEATURES if wanted else {})})
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    started, scored, written = time.perf_counter(), 0, 0
    bar = tqdm(total=len(todo), desc="teacher pass", unit="shard")
    for index in todo:
        if (done or written) and max_minutes and spent_before + time.perf_counter() - started > max_minutes * 60:
            break
        records = []
        shard_rows = [rows[i] for i in shards[index]]
        for start in range(0, len(shard_rows), rows_per_forward):
            chunk = shard_rows[start: start + rows_per_forward]
            width = max(len(r["input_ids"]) for r in chunk)
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            attention = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, r in enumerate(chunk):
                ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
                attention[i, : len(r["input_ids"])] = 1
            with torch.inference_mode():
                # The body, then the LM head at loss positions only (prompt and padding positions need none).
                out = getattr(model, model.base_model_prefix)(input_ids=ids, attention_mask=attention,
                                                              output_hidden_states=bool(wanted))
            for i, r in enumerate(chunk):
                # Position t predicts token t + 1: the teacher of loss token t + 1 sits at t (the first token
                # has no position before it, so it is never a loss token).
                mask = [0, *list(r["loss_mask"])[1:]]
                at = torch.tensor(mask[1:], dtype=torch.bool).nonzero().squeeze(1)
                with torch.inference_mode():
                    logits = model.get_output_embeddings()(out.last_hidden_state[i, at])
                top_ids, top_logp = teacher_topk(logits, top_k)
                record = {"input_ids": list(r["input_ids"]), "loss_mask": mask,
                          "topk_ids": top_ids.int().tolist(), "topk_logp": top_logp.half().float().tolist()}
                if wanted:
                    record["hidden"] = torch.cat([out.hidden_states[layer][i, at] for layer in wanted],
                                                 dim=-1).half().float().numpy()
                records.append(record)
                scored += len(at)
        save_shard(out_dir, index, datasets.Dataset.from_list(records, features=features),
                   spent_before + time.perf_counter() - started)
        written += 1
        bar.update(1)
        bar.set_postfix(loss_tokens=scored, tok_s=f"{scored / (time.perf_counter() - started):.0f}")
    bar.close()
    have = len(done) + written
    if have < len(shards):
        warnings.warn(f"generate.max_minutes={max_minutes:g}: the teacher pass's budget is spent with {have} of "
                      f"{len(shards)} shards; training uses those. A run with a larger generate.max_minutes "
                      f"(0 = no limit) scores the other {len(shards) - have} into {out_dir}", stacklevel=2)
    return load_generated(out_dir)


def teacher_pass_dir(target_path: str, dtype: str, rows: datasets.Dataset, top_k: int, hidden_layer: int | list[int],
                     seed: int) -> Path:
    """Cache folder for a teacher pass, keyed by target, its dtype, the rows and what is stored."""
    from .assets import cache_dir

    key = json.dumps([TEACHER_PASS, target_path, dtype, rows._fingerprint, top_k, hidden_layer, seed])
    name = Path(target_path).name or "target"
    return cache_dir() / "teacher-pass" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def cut_teacher(rows: datasets.Dataset, top_k: int) -> datasets.Dataset:
    """Stored teacher rows with only their ``top_k`` most likely entries (stored sorted, so again a top-k)."""
    if top_k == stored_top_k(rows, top_k):
        return rows
    return rows.map(lambda r: {"topk_ids": [t[:top_k] for t in r["topk_ids"]],
                               "topk_logp": [t[:top_k] for t in r["topk_logp"]]}, desc="cut the stored teacher")
