"""Rollout records (ppo_trainer/rollout_records.py): token pieces, record contents, row selection,
the atomic writer and the reader, and records built from a real PPO step's rollout batch."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from base_setup.tokenizer_setup import load_tokenizer
from config.ppo_config import PPOConfig
from experience_buffer.buffer import RolloutBatch
from fixtures.tiny_corpus import review_prompts
from ppo_trainer.callbacks import TrainerCallback
from ppo_trainer.ppo_trainer import PPOTrainer
from ppo_trainer.rollout_records import (
    RolloutArrays,
    log_rollouts,
    read_rollout_records,
    rollout_records,
    rollouts_due,
    select_rows,
    token_pieces,
    write_rollout_records,
)
from reward_kl.kl_divergence import kl_estimate
from reward_kl.reward_computer import per_token_rewards


class WordTokenizer:
    """Decodes ids to fixed strings; with ``sentencepiece=True`` it drops the leading space of
    the decoded text, as SentencePiece tokenizers do for a sequence's first word."""

    def __init__(self, vocab: Sequence[str], sentencepiece: bool = False) -> None:
        self.vocab = list(vocab)
        self.sentencepiece = sentencepiece

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = "".join(self.vocab[i] for i in ids)
        return text[1:] if self.sentencepiece and text.startswith(" ") else text


VOCAB = ["<eos>", "The", " good", " bad", " film", ".", "\n", " ", " was"]


def make_arrays(**overrides: Any) -> RolloutArrays:
    """Four responses of up to 5 tokens after a 2-token prompt, with distinct known numbers."""
    responses = np.array(
        [[1, 2, 4, 5, 0], [1, 3, 4, 0, 0], [1, 8, 2, 6, 7], [1, 0, 0, 0, 0]], dtype=np.int32
    )  # (B, T)
    lengths = np.array([5, 4, 5, 2])
    mask = (np.arange(5)[None, :] < lengths[:, None]).astype(np.float32)  # (B, T)
    prompt = np.array([[1, 4]] * 4)
    grid = np.arange(20, dtype=np.float32).reshape(4, 5)
    settings: dict[str, Any] = dict(
        step=3,
        algorithm="ppo",
        prompts=["The film"] * 4,
        query_responses=np.concatenate([prompt, responses], axis=1),
        prompt_lengths=np.full(4, 2),
        responses=responses,
        mask=mask,
        ended_with_stop=np.array([True, True, False, True]),
        scores=np.array([1.5, -2.0, 0.25, 0.0], dtype=np.float32),
        logprobs=-grid / 10,
        ref_logprobs=-grid / 20,
        kl=grid / 100,
        entropy=grid / 7,
        values=grid - 10,
        rewards=grid * 3,
        advantages=(grid - 8) / 3,
        returns=grid + 0.5,
    )
    settings.update(overrides)
    return RolloutArrays(**settings)


def six_digits(x: float) -> float:
    return float(f"{float(x):.6g}")


# --------------------------------------------------------------------------- token pieces


def test_token_pieces_keep_multibyte_characters_whole(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    text = "café ☕ naïve\nok 😀 fine"
    ids = tokenizer.encode(text, add_special_tokens=False)
    # Decoded one by one, byte-level BPE breaks the characters this test is about.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    pieces = token_pieces(tokenizer, [], ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # the tokens holding the first bytes of a character
    assert "😀" in pieces or any("😀" in p for p in pieces)


def test_token_pieces_continue_the_prompt(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    prompt = tokenizer.encode("Review of the lamp:", add_special_tokens=False)
    response = tokenizer.encode(" It works well.", add_special_tokens=False)
    pieces = token_pieces(tokenizer, prompt, response + [0])  # 0: the EOS token, kept
    assert "".join(pieces) == " It works well.<|endoftext|>"
    assert pieces[-1] == "<|endoftext|>"


def test_token_pieces_keep_the_first_space_of_a_sentencepiece_response() -> None:
    tokenizer = WordTokenizer(VOCAB, sentencepiece=True)
    assert tokenizer.decode([2]) == "good"  # alone, the space is dropped
    assert token_pieces(tokenizer, [1], [2, 4, 5]) == [" good", " film", "."]
    assert token_pieces(tokenizer, [], [2, 4]) == ["good", " film"]  # nothing before it


def test_token_pieces_of_a_response_cut_inside_a_character(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    cut = ids[:-1]  # the emoji's last byte is missing
    pieces = token_pieces(tokenizer, [], cut)
    assert "".join(pieces) == tokenizer.decode(cut)
    assert pieces[-1].endswith("\ufffd")


# --------------------------------------------------------------------------- records


def test_records_hold_every_token_quantity_up_to_the_stop_token() -> None:
    arrays = make_arrays()
    records = rollout_records(arrays, WordTokenizer(VOCAB))
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    assert [r["length"] for r in records] == [5, 4, 5, 2]
    first = records[0]
    assert first["tokens"] == ["The", " good", " film", ".", "<eos>"]
    assert first["response"] == "The good film.<eos>"
    assert first["token_ids"] == [1, 2, 4, 5, 0]
    assert first["prompt"] == "The film" and first["step"] == 3 and first["source"] == "train"
    assert first["algorithm"] == "ppo" and first["group"] is None
    assert first["sequence_advantage"] is None and first["format"] == 1
    assert records[2]["tokens"] == ["The", " was", " good", "\n", " "]
    assert [r["ended_with_stop"] for r in records] == [True, True, False, True]
    assert [r["score"] for r in records] == [1.5, -2.0, 0.25, 0.0]
    fields = {
        "logprob": arrays.logprobs,
        "ref_logprob": arrays.ref_logprobs,
        "kl": arrays.kl,
        "entropy": arrays.entropy,
        "value": arrays.values,
        "reward": arrays.rewards,
        "advantage": arrays.advantages,
        "return": arrays.returns,
    }
    for record in records:
        row, n = record["index"], record["length"]
        for name, grid in fields.items():
            values = np.asarray(grid)
            expected = [six_digits(values[row, t]) for t in range(n)]  # naive: element by element
            assert record[name] == expected, (name, row)
    json.dumps(records, allow_nan=False)  # JSON-able as they are


def test_grpo_records_hold_groups_and_the_sequence_advantage() -> None:
    arrays = make_arrays(
        algorithm="grpo",
        group_size=2,
        values=None,
        returns=None,
        advantages=np.array([0.7, -0.7, 1.25, -1.25]),
    )
    records = rollout_records(arrays, WordTokenizer(VOCAB), rows=[3, 0])
    assert [r["index"] for r in records] == [3, 0]
    assert [r["group"] for r in records] == [1, 0]
    assert [r["sequence_advantage"] for r in records] == [-1.25, 0.7]
    assert records[0]["advantage"] == [-1.25, -1.25]  # the loss's advantage on every token
    assert records[1]["advantage"] == [0.7] * 5
    assert records[0]["value"] is None and records[0]["return"] is None


def test_non_finite_numbers_are_written_as_strings() -> None:
    kl = np.zeros((4, 5), dtype=np.float32)
    kl[0, :3] = [np.nan, np.inf, -np.inf]
    (record,) = rollout_records(make_arrays(kl=kl), WordTokenizer(VOCAB), rows=[0])
    assert record["kl"][:4] == ["NaN", "Infinity", "-Infinity", 0.0]
    json.dumps(record, allow_nan=False)


def test_what_the_rewards_logged_is_each_records_details() -> None:
    """The rewards' per-completion columns (``log_extra``) land on their rows, as JSON: numbers
    to 6 digits (numpy's too), containers item by item, None as null; none logged: null."""
    details = {
        "judge/prompt": ["Rate A", None, "Rate C", "Rate D"],
        "judge/score": [np.float32(7.123456789), 2.0, 0.5, 10],
        "judge/distribution": [{"yes": 0.25, "no": 0.75}] * 4,
    }
    records = rollout_records(make_arrays(details=details), WordTokenizer(VOCAB), rows=[1, 0])
    assert records[0]["details"] == {
        "judge/prompt": None,
        "judge/score": 2.0,
        "judge/distribution": {"yes": 0.25, "no": 0.75},
    }
    assert records[1]["details"]["judge/score"] == 7.12346
    assert records[1]["details"]["judge/prompt"] == "Rate A"
    json.dumps(records, allow_nan=False)
    assert rollout_records(make_arrays(), WordTokenizer(VOCAB), rows=[0])[0]["details"] is None
    with pytest.raises(ValueError, match="details 'judge/score' has 3 values for 4 responses"):
        make_arrays(details={"judge/score": [1.0, 2.0, 3.0]})


def test_mlx_arrays_are_copied_to_the_host() -> None:
    base = make_arrays()
    arrays = make_arrays(
        logprobs=mx.array(base.logprobs).astype(mx.bfloat16), scores=mx.array(base.scores)
    )
    assert isinstance(arrays.logprobs, np.ndarray) and arrays.logprobs.dtype == np.float32
    assert isinstance(arrays.scores, np.ndarray)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"prompts": ["p"] * 3}, "3 prompts for 4 responses"),
        ({"kl": np.zeros((4, 4))}, "kl has shape (4, 4), expected (4, 5)"),
        ({"advantages": np.zeros(3)}, "advantages has shape (3,)"),
        ({"scores": np.zeros(5)}, "scores has shape (5,)"),
        ({"group_size": 3}, "group_size=3"),
        ({"algorithm": ""}, "algorithm must name"),
        ({"prompt_lengths": np.full(4, 9)}, "prompt_lengths exceed"),
    ],
)
def test_bad_arrays_are_refused_with_what_to_fix(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_arrays(**overrides)


def test_a_mask_with_holes_is_refused() -> None:
    mask = np.array(make_arrays().mask)
    mask[0, 1] = 0.0
    with pytest.raises(ValueError, match="prefix"):
        rollout_records(make_arrays(mask=mask), WordTokenizer(VOCAB))


def test_select_rows() -> None:
    assert select_rows(4, 1, 16) == [0, 1, 2, 3]
    assert select_rows(10, 1, 4) == [0, 3, 6, 9]  # spread, first and last included
    assert select_rows(10, 1, 1) == [0]
    assert select_rows(16, 4, 8) == [0, 1, 2, 3, 12, 13, 14, 15]  # whole groups
    assert select_rows(16, 4, 2) == [0, 1]  # fewer than a group: part of the first
    for batch, group, limit in [(7, 1, 6), (64, 8, 20), (12, 3, 11), (5, 1, 2)]:
        rows = select_rows(batch, group, limit)
        assert len(rows) == len(set(rows)) <= limit and rows == sorted(rows)
        assert all(0 <= r < batch for r in rows)
    with pytest.raises(ValueError):
        select_rows(4, 1, 0)


def test_rollouts_due() -> None:
    due = [s for s in range(1, 26) if rollouts_due(s, 10, last_step=25)]
    assert due == [1, 10, 20, 25]
    assert not any(rollouts_due(s, 0, last_step=5) for s in range(1, 6))


# --------------------------------------------------------------------------- files


def test_writer_is_atomic_and_reader_returns_steps_in_order(tmp_path: Path) -> None:
    tokenizer = WordTokenizer(VOCAB)
    path = log_rollouts(tmp_path, make_arrays(step=12), tokenizer, limit=2)
    assert path == tmp_path / "rollouts" / "step_000012.jsonl"
    eval_path = log_rollouts(tmp_path, make_arrays(step=12, source="eval"), tokenizer, limit=3)
    assert eval_path.name == "step_000012_eval.jsonl"
    log_rollouts(tmp_path, make_arrays(step=2), tokenizer, limit=4)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["index"] for line in lines] == [0, 3]
    steps = read_rollout_records(tmp_path)
    assert [(s.step, s.source, len(s.records)) for s in steps] == [
        (2, "train", 4),
        (12, "train", 2),
        (12, "eval", 3),
    ]
    # A write that fails half-way leaves the previous file and no temporary file behind.
    before = path.read_bytes()
    good = rollout_records(make_arrays(), tokenizer, rows=[0])[0]
    with pytest.raises(TypeError):
        write_rollout_records(tmp_path, 12, [good, {"bad": object()}])
    assert path.read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == [
        "step_000002.jsonl",
        "step_000012.jsonl",
        "step_000012_eval.jsonl",
    ]


def test_reader_errors_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="log_rollouts_every"):
        read_rollout_records(tmp_path)
    folder = tmp_path / "rollouts"
    folder.mkdir()
    (folder / "step_000001.jsonl").write_text('{"format": 1}\n{oops\n', encoding="utf-8")
    with pytest.raises(ValueError, match="step_000001.jsonl:2"):
        read_rollout_records(tmp_path)


# --------------------------------------------------------------------------- from a real step


class _Recorder(TrainerCallback):
    def __init__(self) -> None:
        self.batches: list[RolloutBatch] = []

    def on_rollout_end(self, trainer: PPOTrainer, step: int, batch: RolloutBatch) -> None:
        self.batches.append(batch)


@pytest.mark.slow
def test_records_of_a_real_ppo_rollout(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = PPOConfig(
        model_name=str(tiny_model_dir),
        max_new_tokens=8,
        batch_size=4,
        learning_rate=1e-3,
        num_ppo_epochs=2,  # LoRA: lora_a moves from the second update on (lora_b starts at 0)
        num_mini_batches=2,
        output_dir=str(tmp_path / "run"),
        progress_bar=False,
        save_every=0,
        total_steps=1,
    )
    trainer = PPOTrainer(config, reward_model=lambda p, c: [float(len(x)) for x in c])
    before = dict(tree_flatten(trainer.policy.trainable_parameters()))
    mx.eval(before)
    recorder = _Recorder()
    trainer.train(review_prompts(4, seed=0), callbacks=[recorder])
    after = dict(tree_flatten(trainer.policy.trainable_parameters()))
    unchanged = [k for k in before if np.array_equal(np.array(before[k]), np.array(after[k]))]
    assert not unchanged, unchanged
    (batch,) = recorder.batches
    assert batch.values is not None and batch.returns is not None
    kl = kl_estimate(batch.logprobs, batch.ref_logprobs, config.kl_estimator) * batch.mask
    rewards, _ = per_token_rewards(batch.scores, kl, batch.mask, config.kl_coef)
    lengths = np.array(batch.mask).sum(axis=1).astype(int)
    responses = np.array(batch.responses)
    ended = np.array([responses[b, n - 1] in trainer.stop_token_ids for b, n in enumerate(lengths)])
    prompts = [
        trainer.tokenizer.decode(np.array(batch.query_responses)[b, :p].tolist())
        for b, p in enumerate(np.array(batch.prompt_lengths).tolist())
    ]
    arrays = RolloutArrays(
        step=1,
        algorithm="ppo",
        prompts=prompts,
        query_responses=batch.query_responses,
        prompt_lengths=batch.prompt_lengths,
        responses=batch.responses,
        mask=batch.mask,
        ended_with_stop=ended,
        scores=batch.scores,
        logprobs=batch.logprobs,
        ref_logprobs=batch.ref_logprobs,
        kl=kl,
        values=batch.values,
        rewards=rewards,
        advantages=batch.advantages,
        returns=batch.returns,
    )
    path = log_rollouts(trainer.run_dir, arrays, trainer.tokenizer, limit=config.batch_size)
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(records) == 4
    for record in records:
        row, n = record["index"], record["length"]
        assert n == lengths[row] and record["token_ids"] == responses[row, :n].tolist()
        decoded = trainer.tokenizer.decode(record["token_ids"], skip_special_tokens=False)
        assert record["response"] == decoded
        assert record["prompt"] == prompts[row]
        for name, grid in (
            ("logprob", batch.logprobs),
            ("value", batch.values),
            ("advantage", batch.advantages),
            ("reward", rewards),
        ):
            expected = np.array(grid)[row, :n]
            assert np.allclose(record[name], expected, rtol=1e-5, atol=1e-6), name
        # The per-token rewards add up to the score plus the KL penalty.
        assert math.isclose(
            sum(record["reward"]),
            record["score"] - config.kl_coef * sum(record["kl"]),
            rel_tol=1e-4,
            abs_tol=1e-4,
        )


@pytest.mark.slow
def test_training_writes_records_the_inspector_reads(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The trainer's own records: the first and last steps, each evaluation; the page reads them."""
    from ppo_trainer.inspector import write_inspector

    config = PPOConfig(
        model_name=str(tiny_model_dir),
        algorithm="grpo",
        group_size=2,
        max_new_tokens=6,
        batch_size=2,
        learning_rate=1e-3,
        num_ppo_epochs=1,
        output_dir=str(tmp_path / "run"),
        progress_bar=False,
        total_steps=3,
        log_rollouts_every=2,
        rollout_records_per_step=3,
        eval_every=3,
    )
    trainer = PPOTrainer(config, reward_model=lambda p, c: [float(len(x)) for x in c])
    trainer.train(review_prompts(6, seed=0), eval_prompts=review_prompts(5, seed=1))
    steps = read_rollout_records(tmp_path / "run")
    assert [(s.step, s.source) for s in steps] == [
        (1, "train"),
        (2, "train"),
        (3, "train"),
        (3, "eval"),
    ]
    train_records = steps[0].records
    assert len(train_records) == 2  # whole groups of 2 within the limit of 3
    assert {r["group"] for r in train_records} == {train_records[0]["group"]}
    assert all(
        r["algorithm"] == "grpo" and r["sequence_advantage"] is not None for r in train_records
    )
    eval_records = steps[-1].records
    assert len(eval_records) == 3 and all(r["source"] == "eval" for r in eval_records)
    assert all(len(r["kl"]) == r["length"] for r in eval_records)
    page = write_inspector(tmp_path / "run")
    assert page.is_file() and "step_000003" not in page.name
