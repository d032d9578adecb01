"""Tests for finetune/records.py and finetune/tokenize.py (loading, checks, tokenisation, batching) and fixtures/demo_data.py."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from base_setup.tokenizer_setup import load_tokenizer
from fixtures.demo_data import (
    preference_records,
    sft_records,
    write_preference_data,
    write_sft_data,
)
from fixtures.tiny_corpus import lexicon_score
from finetune.records import load_preference_data, load_sft_data, train_eval_split
from finetune.tokenize import (
    PreferenceExample,
    SFTExample,
    chat_tokens,
    collate_preferences,
    collate_sft,
    length_bucketed_batches,
    prompt_completion_tokens,
    tokenize_preferences,
    tokenize_sft,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


GOOD_SFT = json.dumps({"prompt": "Review of the camera:", "completion": " The screen is superb."})
GOOD_PAIR = json.dumps(
    {"prompt": "Review of the camera:", "chosen": " Great.", "rejected": " Bad."}
)


# --------------------------------------------------------------------------- loading and checks


def test_load_sft_data_reads_every_format(tmp_path: Path) -> None:
    chat = {
        "messages": [
            {"role": "user", "content": "Review the laptop."},
            {"role": "assistant", "content": "The screen is superb."},
        ]
    }
    system = {"system": "Be brief.", "prompt": "Review of the kettle:", "completion": " Fine."}
    path = write_lines(tmp_path / "sft.jsonl", [GOOD_SFT, "", json.dumps(chat), json.dumps(system)])
    data = load_sft_data(path)
    assert len(data) == 3  # the blank line is skipped
    assert data[0]["prompt"] == "Review of the camera:"
    assert data[1]["messages"][1]["content"] == "The screen is superb."
    assert data[2]["system"] == "Be brief."


GOOD_CHAT = json.dumps(
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
)


@pytest.mark.parametrize(
    ("lines", "line", "words"),
    [
        ([GOOD_SFT, '{"prompt": "a", "completion": '], 2, ["not valid JSON"]),
        ([GOOD_SFT, GOOD_SFT, json.dumps({"prompt": "Review:"})], 3, ["missing", "'completion'"]),
        ([json.dumps({"prompt": "Review:", "completion": "   "})], 1, ["'completion'", "empty"]),
        ([json.dumps({"prompt": 3, "completion": " x"})], 1, ["'prompt'", "string"]),
        ([GOOD_SFT, "[1, 2]"], 2, ["JSON object"]),
        (
            [json.dumps({"messages": [{"role": "user", "content": "hi"}]})],
            1,
            ["end with an assistant turn"],
        ),
        ([json.dumps({"messages": [{"role": "user"}]})], 1, ["messages[0]", "'content'"]),
        ([json.dumps({"messages": []})], 1, ["non-empty list"]),
        (
            [json.dumps({**json.loads(GOOD_CHAT), "tools": "[{"})],
            1,
            ["'tools' is not valid JSON"],
        ),
        ([json.dumps({**json.loads(GOOD_CHAT), "tools": ["calc"]})], 1, ["JSON schemas"]),
    ],
)
def test_malformed_sft_file_names_file_and_line(
    tmp_path: Path, lines: list[str], line: int, words: list[str]
) -> None:
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError) as info:
        load_sft_data(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: ")
    for word in words:
        assert word in message


@pytest.mark.parametrize(
    ("record", "words"),
    [
        ({"prompt": "p", "chosen": " a"}, ["missing", "'rejected'"]),
        ({"prompt": "p", "chosen": " a", "rejected": " a"}, ["same text"]),
        ({"prompt": "p", "chosen": " a", "rejected": " b", "margin": "big"}, ["'margin'"]),
        ({"prompt": "", "chosen": " a", "rejected": " b"}, ["'prompt'", "empty"]),
    ],
)
def test_malformed_preference_file_names_file_and_line(
    tmp_path: Path, record: dict[str, Any], words: list[str]
) -> None:
    path = write_lines(tmp_path / "prefs.jsonl", [GOOD_PAIR, json.dumps(record)])
    with pytest.raises(ValueError) as info:
        load_preference_data(path)
    assert str(info.value).startswith(f"{path}:2: ")
    for word in words:
        assert word in str(info.value)


def test_empty_missing_and_undecodable_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"{empty}: the file holds no records"):
        load_sft_data(empty)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_sft_data(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError, match="is a directory"):
        load_sft_data(tmp_path)
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(GOOD_SFT.encode() + b"\n" + '{"prompt": "caf\xe9"}'.encode("latin-1") + b"\n")
    with pytest.raises(ValueError, match=f"{latin}:2: not UTF-8"):
        load_sft_data(latin)


def test_records_passed_directly_are_checked_too(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="SFT record 1: missing field 'prompt'"):
        tokenize_sft([json.loads(GOOD_SFT), {"completion": " x"}], tokenizer, 64)
    with pytest.raises(ValueError, match="preference record 0: .*'chosen'"):
        tokenize_preferences([{"prompt": "p", "rejected": " b"}], tokenizer, 64)
    with pytest.raises(ValueError, match="data is empty"):
        tokenize_sft([], tokenizer, 64)


def test_train_eval_split() -> None:
    records = [{"i": i} for i in range(50)]
    train, held_out = train_eval_split(records, 0.2, seed=3)
    assert len(held_out) == 10 and len(train) == 40
    assert sorted(r["i"] for r in train + held_out) == list(range(50))
    assert [r["i"] for r in train] == sorted(r["i"] for r in train)  # original order kept
    assert train_eval_split(records, 0.2, seed=3) == (train, held_out)
    assert train_eval_split(records, 0.2, seed=4)[1] != held_out
    assert train_eval_split(records, 0.0, seed=3) == (records, [])
    assert len(train_eval_split(records[:3], 0.01, seed=0)[1]) == 1  # at least one held out
    with pytest.raises(ValueError, match="cannot hold out 1 of 1"):
        train_eval_split(records[:1], 0.5, seed=0)


# --------------------------------------------------------------------------- tokenisation


def test_prompt_completion_tokens_mask_the_prompt(tokenizer: Any) -> None:
    prompt, completion = "Review of the laptop:", " The screen is superb."
    ids, mask = prompt_completion_tokens(tokenizer, prompt, completion)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    # What PPO feeds as the prompt is exactly the unmasked part.
    assert ids[: len(prompt_ids)] == prompt_ids
    assert mask == [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[len(prompt_ids) : -1]) == completion
    example = tokenize_sft([{"prompt": prompt, "completion": completion}], tokenizer, 512)[0]
    assert example == SFTExample(ids, mask)
    assert example.num_targets == len(ids) - len(prompt_ids)


def _assistant_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of each assistant turn's content + end-of-turn in a ChatML string."""
    header, spans, start = "<|im_start|>assistant\n", [], 0
    while (i := text.find(header, start)) >= 0:
        begin = i + len(header)
        end = text.index("<|im_end|>\n", begin) + len("<|im_end|>\n")
        spans.append((begin, end))
        start = end
    return spans


def test_chat_tokens_train_on_every_assistant_turn(tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "You review things."},
        {"role": "user", "content": "The camera?"},
        {"role": "assistant", "content": "The screen is superb."},
        {"role": "user", "content": "And the kettle?"},
        {"role": "assistant", "content": "Terrible."},
    ]
    ids, mask = chat_tokens(tokenizer, messages)
    text = tokenizer.decode(ids)
    # Naive reference: the text of the target tokens is exactly the assistant turns.
    targets = "".join(tokenizer.decode([t]) for t, m in zip(ids, mask) if m)
    expected = "".join(text[a:b] for a, b in _assistant_spans(text))
    assert targets == expected == "The screen is superb.<|im_end|>\nTerrible.<|im_end|>\n"
    # A system field makes a prompt/completion record a three-turn conversation.
    record = {"system": "Be brief.", "prompt": "The camera?", "completion": "Superb."}
    example = tokenize_sft([record], tokenizer, 512)[0]
    as_chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "The camera?"},
        {"role": "assistant", "content": "Superb."},
    ]
    assert (example.input_ids, example.loss_mask) == chat_tokens(tokenizer, as_chat)


def test_sft_truncation_and_prompt_too_long(tokenizer: Any) -> None:
    record = {"prompt": "Review of the laptop:", "completion": " The screen is superb. " * 5}
    full = tokenize_sft([record], tokenizer, 512)[0]
    cut = tokenize_sft([record], tokenizer, 12)[0]
    assert cut.input_ids == full.input_ids[:12] and cut.loss_mask == full.loss_mask[:12]
    prompt_len = len(tokenizer.encode(record["prompt"], add_special_tokens=False))
    with pytest.raises(ValueError, match=f"takes {prompt_len} tokens, so max_length={prompt_len}"):
        tokenize_sft([record], tokenizer, prompt_len)


def test_tokenize_preferences(tokenizer: Any) -> None:
    short = {
        "prompt": "Review of the camera:",
        "chosen": " Great.",
        "rejected": " Bad.",
        "margin": 2,
    }
    long = {"prompt": "Review of the camera:", "chosen": " Great." * 40, "rejected": " Bad."}
    examples = tokenize_preferences([short, long], tokenizer, 32)
    eos = tokenizer.eos_token_id
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    assert examples == [
        PreferenceExample(
            encode("Review of the camera: Great.") + [eos],
            encode("Review of the camera: Bad.") + [eos],
            2.0,
        )
    ]  # the long pair is dropped
    with pytest.raises(ValueError, match="all 1 preference pairs are longer than max_length=32"):
        tokenize_preferences([long], tokenizer, 32)


# --------------------------------------------------------------------------- batching


def test_length_bucketed_batches_cover_everything_and_cut_padding() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 200, size=103).tolist()
    batches = length_bucketed_batches(lengths, 8, window=4, seed=1, epoch=0)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(103))
    assert [len(b) for b in batches].count(8) == 12 and len(batches) == 13
    assert batches == length_bucketed_batches(lengths, 8, window=4, seed=1, epoch=0)
    assert batches != length_bucketed_batches(lengths, 8, window=4, seed=1, epoch=1)

    def padded_tokens(bs: list[list[int]]) -> int:
        return sum(len(b) * max(lengths[i] for i in b) for b in bs)

    plain = length_bucketed_batches(lengths, 8, window=1, seed=1, epoch=0)
    assert sorted(i for b in plain for i in b) == list(range(103))
    bucketed = length_bucketed_batches(lengths, 8, window=13, seed=1, epoch=0)
    # One window over everything: sorted batches, the least padding possible.
    assert padded_tokens(bucketed) < 0.75 * padded_tokens(plain)
    assert padded_tokens(batches) < padded_tokens(plain)


def test_collate() -> None:
    a = SFTExample([5, 6, 7, 8], [0, 0, 1, 1])
    b = SFTExample([9, 10], [0, 1])
    batch = collate_sft([a, b], pad_token_id=1)
    np.testing.assert_array_equal(np.array(batch.input_ids), [[5, 6, 7, 8], [9, 10, 1, 1]])
    np.testing.assert_array_equal(np.array(batch.loss_mask), [[0, 0, 1, 1], [0, 1, 0, 0]])
    assert batch.num_targets == 3
    pairs = [PreferenceExample([1, 2, 3], [4, 5], None), PreferenceExample([6], [7, 8, 9, 10], 1.5)]
    pb = collate_preferences(pairs, pad_token_id=0, default_margin=0.25)
    np.testing.assert_array_equal(
        np.array(pb.input_ids),
        [[1, 2, 3, 0], [6, 0, 0, 0], [4, 5, 0, 0], [7, 8, 9, 10]],  # chosen rows, then rejected
    )
    np.testing.assert_array_equal(np.array(pb.lengths), [3, 1, 2, 4])
    np.testing.assert_allclose(np.array(pb.margins), [0.25, 1.5])
    assert pb.num_pairs == 2


# --------------------------------------------------------------------------- demo data


def test_demo_sft_data(tmp_path: Path) -> None:
    records = sft_records(60, seed=2)
    assert records == sft_records(60, seed=2) != sft_records(60, seed=3)
    assert all(r["prompt"].startswith("Review of ") and r["prompt"].endswith(":") for r in records)
    assert all(r["completion"].startswith(" ") for r in records)
    scores = [lexicon_score(r["completion"]) for r in records]
    assert sum(s > 0 for s in scores) == sum(s < 0 for s in scores) == sum(s == 0 for s in scores)
    path = write_sft_data(tmp_path / "data" / "sft.jsonl", 60, seed=2)
    assert [dict(r) for r in load_sft_data(path)] == records


def test_demo_preference_data_is_checkably_positive(tmp_path: Path) -> None:
    records = preference_records(90, seed=5)
    assert records == preference_records(90, seed=5)
    assert len({(r["chosen"], r["rejected"]) for r in records}) == 90
    for r in records:
        assert lexicon_score(r["chosen"]) > lexicon_score(r["rejected"])
    kinds = Counter(
        (np.sign(lexicon_score(r["chosen"])), np.sign(lexicon_score(r["rejected"])))
        for r in records
    )
    assert kinds == {(1, -1): 30, (1, 0): 30, (0, -1): 30}
    path = write_preference_data(tmp_path / "prefs.jsonl", 90, seed=5)
    loaded = load_preference_data(path)
    assert [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in loaded] == records


def test_vocabulary_difference_names_what_differs() -> None:
    from base_setup.tokenizer_setup import vocabulary_difference

    class Vocab:
        def __init__(self, vocab: dict[str, int]) -> None:
            self.vocab = vocab

        def get_vocab(self) -> dict[str, int]:
            return self.vocab

    ours = Vocab({"a": 0, "b": 1, "c": 2})
    assert vocabulary_difference(ours, Vocab({"c": 2, "b": 1, "a": 0})) is None
    difference = vocabulary_difference(ours, Vocab({"a": 0, "b": 2, "d": 1}))
    assert difference == (
        "3 tokens against 3; only the first's: ['c'], only the second's: ['d'], other ids: ['b']"
    )
