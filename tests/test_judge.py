"""rewards/judge.py: local LLM judges whose score is read from the judge's own probabilities."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from rewards import resolve_reward
from rewards.judge import (
    QUESTIONS,
    Candidates,
    answer_probabilities,
    candidates_for,
    expected_scores,
    group_judge,
    judge,
    judge_prompt_ids,
    load_judge,
    prompt_groups,
)
from ppo_trainer.rollout_records import read_records_file
from tests.test_ppo_trainer import assert_all_changed, make_config, trainable


class WordTokenizer:
    """encode() from a fixed table: what candidates_for sees of a tokenizer."""

    def __init__(self, table: dict[str, list[int]]) -> None:
        self.table = table

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.table[text]


def digits_split(ten_single: bool) -> WordTokenizer:
    table = {str(k): [k] for k in range(10)}
    table["10"] = [10] if ten_single else [1, 0]
    return WordTokenizer(table)


def test_candidates_force_the_shared_first_token_of_ten_only_where_ten_is_two_tokens() -> None:
    split = candidates_for(digits_split(ten_single=False), "0-10")
    assert split.forced == 1 and split.ids[10] == (1, 0) and split.values[10] == 10.0
    single = candidates_for(digits_split(ten_single=True), "0-10")
    assert single.forced is None and single.ids[10] == (10,)


def test_yes_no_variants_count_once_and_multi_token_replies_read_their_first_token() -> None:
    tok = WordTokenizer({"yes": [5, 6], "Yes": [7, 6], "no": [8], "No": [8]})
    c = candidates_for(tok, "yes/no")
    assert c.ids == ((5,), (7,), (8,)) and c.values == (1.0, 1.0, 0.0) and c.forced is None


def test_candidates_that_cannot_be_told_apart_are_refused() -> None:
    with pytest.raises(ValueError, match="two scores the ids"):
        candidates_for(WordTokenizer({"yes": [3], "Yes": [4], "no": [3], "No": [5]}), "yes/no")
    table = {str(k): [k] for k in range(10)} | {"10": [1, 0, 0]}
    with pytest.raises(ValueError, match="share first tokens"):
        candidates_for(WordTokenizer(table), "0-10")
    with pytest.raises(ValueError, match="scale must be one of"):
        candidates_for(digits_split(True), "1-5")


def test_answer_probabilities_equal_an_enumeration_of_two_token_replies() -> None:
    """A two-step model over 12 tokens: P(a) then P(b | a). Enumerated, the reply "1" is every
    sequence (1, b) with b != 0, "10" is (1, 0), and "k" (k != 1) every (k, b)."""
    rng = np.random.default_rng(0)
    vocab = 12
    first = rng.dirichlet(np.ones(vocab), size=3)  # (B, V)
    after = rng.dirichlet(np.ones(vocab), size=(3, vocab))  # (B, a, V): P(b | a)
    c = candidates_for(digits_split(ten_single=False), "0-10")
    got = answer_probabilities(first, after[:, c.forced], c)
    want = np.zeros((3, 11))
    for b, (x, y) in itertools.product(range(3), itertools.product(range(vocab), repeat=2)):
        p = first[b, x] * after[b, x, y]
        if x == 1:
            want[b, 10 if y == 0 else 1] += p
        elif x <= 9:
            want[b, x] += p
    np.testing.assert_allclose(got, want, rtol=1e-12)
    scores = expected_scores(got, c.values)
    naive = (want * np.arange(11)).sum(1) / want.sum(1) / 10
    np.testing.assert_allclose(scores, naive, rtol=1e-12)


def test_expected_scores_are_the_top_for_a_sure_judge() -> None:
    c = Candidates(ids=((0,), (1,)), values=(0.0, 1.0), forced=None)
    sure = np.array([[0.0, 0.5, 0.5], [0.25, 0.0, 0.75]])
    np.testing.assert_allclose(
        expected_scores(answer_probabilities(sure, None, c), c.values), [1, 0]
    )


def test_judge_reads_the_same_probabilities_as_a_full_unpadded_pass(tiny_model_dir: Path) -> None:
    """Batched and right-padded, at the last prompt position (and the forced token's): each
    score equals the one computed from the judge's whole-sequence logits, one prompt at a
    time."""
    model = load_judge(str(tiny_model_dir))
    prompts = ["Review of the film:", "Review of a long and winding road trip story:"]
    completions = ["great", "The plot was slow and the acting was fine but long."]
    scores = judge(prompts, completions, model=str(tiny_model_dir), batch_size=2)
    c = candidates_for(model.tokenizer, "0-10")
    for prompt, completion, score in zip(prompts, completions, scores):
        text = f"Rate the response to the request below: is it correct, helpful and to the point?\n\nRequest:\n{prompt}\n\nResponse:\n{completion}\n\n{QUESTIONS['0-10']}"
        ids = judge_prompt_ids(model.tokenizer, text) + ([c.forced] if c.forced is not None else [])
        logits = model(mx.array([ids]))[0]  # (L, V)
        probs = np.asarray(mx.softmax(logits.astype(mx.float32), axis=-1))
        n = len(ids) - (1 if c.forced is not None else 0)
        second = probs[n][None] if c.forced is not None else None
        want = expected_scores(answer_probabilities(probs[n - 1][None], second, c), c.values)
        assert score == pytest.approx(float(want[0]), abs=1e-5)
        assert 0.0 <= score <= 1.0


def test_group_judge_shows_each_group_its_own_responses(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert prompt_groups(["a", "a", "b", "b", "b", "a"]) == [range(0, 2), range(2, 5), range(5, 6)]
    seen: list[str] = []
    import rewards.judge as judge_module

    def fake_probabilities(
        model: Any, texts: list[str], scale: str, batch_size: int
    ) -> tuple[np.ndarray, Candidates]:
        seen.extend(texts)
        return np.full((len(texts), 2), 0.25), Candidates(((1,), (2,)), (1.0, 0.0), None)

    monkeypatch.setattr(judge_module, "judge_probabilities", fake_probabilities)
    monkeypatch.setattr(judge_module, "load_judge", lambda path: None)
    out = group_judge(["p", "p", "q"], ["A1", "A2", "B1"], model=str(tiny_model_dir))
    assert out == [0.5, 0.5, 0.5] and len(seen) == 3
    assert (
        "Response 1:\nA1" in seen[0] and "Response 2:\nA2" in seen[0] and "response 1," in seen[0]
    )
    assert "response 2," in seen[1] and "B1" not in seen[1]
    assert "Response 1:\nB1" in seen[2] and "A1" not in seen[2]


def test_a_judge_without_its_model_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="needs the parameter"):
        resolve_reward({"name": "judge"})
    with pytest.raises(ValueError, match="scale must be one of"):
        judge(["p"], ["c"], model="unused", scale="1-5")


@pytest.mark.parametrize("name", ["judge", "group_judge"])
def test_grpo_trains_the_tiny_model_on_a_judges_scores(
    tiny_model_dir: Path, tmp_path: Path, name: str
) -> None:
    """A GRPO step whose reward is the judge (here the tiny model judging itself): every
    adapter moves."""
    from ppo_trainer.ppo_trainer import PPOTrainer

    config = make_config(
        tiny_model_dir,
        tmp_path,
        algorithm="grpo",
        group_size=4,
        batch_size=2,
        use_lora=True,
        reward_funcs=[{"name": name, "model": str(tiny_model_dir), "scale": "yes/no"}],
    )
    trainer = PPOTrainer(config)
    before = trainable(trainer.policy.model)
    metrics = trainer.step(["Review of the film:", "Review of the book:"])
    assert np.isfinite(metrics["objective/scores"])
    assert_all_changed(before, trainable(trainer.policy.model))
    # The rollout records carry the judge's prompt and verdict beside each score.
    records = read_records_file(Path(trainer.run_dir) / "rollouts" / "step_000001.jsonl")
    assert len(records) == 8
    for record in records:
        details = record["details"]
        assert record["score"] == pytest.approx(details[f"{name}/score"], abs=2e-6)  # P(yes)
        assert sum(details[f"{name}/distribution"].values()) == pytest.approx(1.0, abs=1e-5)
        assert list(details[f"{name}/distribution"]) == ["yes", "no"]
        assert 0.0 < details[f"{name}/mass"] <= 1.0
        prompt = details[f"{name}/prompt"]
        if name == "judge":
            assert record["prompt"] in prompt and "Response:\n" in prompt
        else:  # the group's prompt, once, on its first completion; each one's number
            number = details["group_judge/response"]
            assert number == record["index"] % 4 + 1
            assert (prompt is None) == (number != 1)
            if number == 1:
                assert record["prompt"] in prompt and "Response 4:\n" in prompt


@pytest.mark.slow
def test_a_resumed_group_judge_run_equals_the_straight_run(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GRPO scored by ``group_judge`` on the 0-10 scale, stopped after its first step and
    resumed: the same metrics and weights as straight through (the judge is loaded again by the
    resumed trainer and reads the same probabilities)."""
    from fixtures.tiny_corpus import review_prompts
    from ppo_trainer.ppo_trainer import PPOTrainer
    from tests.resume_checks import assert_resume_equals_straight

    monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "off")
    judge_spec = [{"name": "group_judge", "model": str(tiny_model_dir), "scale": "0-10"}]
    trainers: dict[str, PPOTrainer] = {}

    def trainer_in(name: str) -> PPOTrainer:
        config = make_config(
            tiny_model_dir,
            tmp_path / name,
            algorithm="grpo",
            group_size=2,
            batch_size=2,
            reward_funcs=judge_spec,
            save_every=100,
        )
        trainers[name] = PPOTrainer(config)
        return trainers[name]

    assert_resume_equals_straight(trainer_in, review_prompts(2, seed=0))
    fresh = trainable(trainer_in("fresh").policy.model)
    assert_all_changed(fresh, trainable(trainers["a"].policy.model))  # the judge's scores moved it
