"""The task trainers in examples/: their rewards on hand-made completions, their data checks, one
in-process PPO step each (the scores the step trains on are the task's own reward), and one
command-line run each on the tiny model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
import pytest

from config.ppo_config import PPOConfig
from examples import code_generation, dialogue, summarization
from examples.code_generation import (
    CodeGenerationTrainer,
    build_program,
    code_record,
    code_sft_record,
    score_programs,
)
from examples.dialogue import (
    DialogueTrainer,
    conversation_prompt,
    dialogue_record,
    dialogue_sft_record,
    heuristic_reward,
    keyword_heuristic_score,
    parse_hh_dialogue,
)
from examples.summarization import (
    SummarizationTrainer,
    length_penalty,
    rouge_quality,
    rouge_reward,
    summary_record,
    summary_sft_record,
)
from examples.task_common import SHOWN_SAMPLES, load_task_records, reward_change
from finetune.stage_cache import cached_stage
from finetune.tokenize import tokenize_sft
from models.reward_model import RewardModel
from ppo_trainer.trained_model import read_run_config
from sandbox import SandboxLimits
from token_attribution.sequences import build_query_responses

REPO = Path(__file__).resolve().parents[1]
# Wall time for a candidate's whole run: a loaded CI machine can take over a second just to start
# the sandboxed interpreter; the looping candidate is stopped by its CPU time first.
LIMITS = SandboxLimits(timeout_s=6.0, cpu_time_s=3, memory_mb=256)

ARTICLE = (
    "The town council of Millbrook voted on Tuesday to turn the empty lot behind the train "
    "station into a community garden. The plan includes forty raised beds, a tool shed and a "
    "rainwater tank. Residents can rent a bed for twenty dollars a season, and the first plots "
    "will be handed out in April."
)
REFERENCE = (
    "Millbrook will turn the lot behind its train station into a community garden with forty "
    "rentable beds from April."
)
ADD_TASK: dict[str, Any] = {
    "prompt": 'def add(a, b):\n    """Return the sum of a and b."""\n',
    "tests": ["assert add(1, 2) == 3", "assert add(-4, 4) == 0", "assert add(2.5, 0.5) == 3.0"],
}
EVEN_TASK: dict[str, Any] = {
    "prompt": 'def is_even(n):\n    """Return True if n is even."""\n',
    "tests": ["assert is_even(4) is True", "assert is_even(7) is False"],
}
FLOWERS = [
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "How do I keep cut flowers fresh longer?"},
]


def make_config(model_dir: Path, tmp_path: Path, **overrides: Any) -> PPOConfig:
    settings: dict[str, Any] = dict(
        model_name=str(model_dir),
        max_new_tokens=6,
        batch_size=2,
        num_ppo_epochs=1,
        num_mini_batches=1,
        learning_rate=1e-3,
        output_dir=str(tmp_path / "run"),
        progress_bar=False,
    )
    settings.update(overrides)
    return PPOConfig(**settings)


def write_jsonl(path: Path, lines: Sequence[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


# --------------------------------------------------------------------------- summarization reward


@pytest.mark.slow
def test_rouge_quality_matches_a_hand_computation() -> None:
    # unigrams: 2 of 3 match 2 of 4 -> F1 = 2 * (2/3) * (2/4) / (2/3 + 2/4) = 4/7
    # bigrams: "the cat" of {the cat, cat sat} and {the cat, cat ran, ran away}:
    #   F1 = 2 * (1/2) * (1/3) / (1/2 + 1/3) = 0.4
    # LCS "the cat" (2 words) -> same as unigrams, 4/7
    expected = (4 / 7 + 0.4 + 4 / 7) / 3
    assert rouge_quality("the cat sat", ["the cat ran away"]) == pytest.approx(expected)
    assert rouge_quality(REFERENCE, [REFERENCE]) == pytest.approx(1.0)
    assert rouge_quality("zebra quantum", [REFERENCE]) == 0.0
    assert rouge_quality("", [REFERENCE]) == 0.0
    # the best reference counts
    assert rouge_quality("the cat sat", ["dogs bark", "the cat ran away"]) == pytest.approx(
        expected
    )


def test_length_penalty_is_zero_within_budget_then_linear() -> None:
    ref = " ".join(["w"] * 10)  # 10 words: budget 1.5 * 10 = 15 words
    assert length_penalty(" ".join(["x"] * 15), [ref], max_length_ratio=1.5, coef=1.0) == 0.0
    assert length_penalty(" ".join(["x"] * 20), [ref], max_length_ratio=1.5, coef=1.0) == 0.5
    assert length_penalty(" ".join(["x"] * 20), [ref], max_length_ratio=1.5, coef=2.0) == 1.0
    # capped at coef once the excess reaches the reference's length
    assert length_penalty(" ".join(["x"] * 25), [ref], max_length_ratio=1.5, coef=2.0) == 2.0
    assert length_penalty(" ".join(["x"] * 90), [ref], max_length_ratio=1.5, coef=2.0) == 2.0
    # the longest reference sets the budget
    assert length_penalty(" ".join(["x"] * 20), ["a b", ref], max_length_ratio=2.0, coef=1.0) == 0


def test_summary_score_prefers_the_faithful_concise_summary() -> None:
    def score(summary: str) -> float:
        refs = [REFERENCE]
        return rouge_quality(summary, refs) - length_penalty(
            summary, refs, max_length_ratio=1.5, coef=1.0
        )

    faithful = "Millbrook will turn the lot behind the station into a garden with forty beds."
    padded = faithful + " " + ARTICLE
    unrelated = "A storm knocked down dozens of trees in the central park on Monday night."
    wrong_facts = "Millbrook will sell the station lot to a supermarket chain next year."
    assert score(faithful) > score(padded)
    assert score(faithful) > score(wrong_facts) > score(unrelated)
    assert score(faithful) > 0.5 and score(unrelated) < 0.1
    assert score(padded) >= -1.0  # the length penalty is capped at its coefficient


# --------------------------------------------------------------------------- dialogue reward


def test_keyword_heuristic_score_hand_computed() -> None:
    # asked: keep, flowers, fresh, longer; the reply repeats keep, flowers, fresh (3/4),
    # one polite phrase ("thank") and one helpful phrase ("you can"); 15 words, in [5, 80].
    reply = "Thank you for asking! You can trim the stems and keep the flowers in fresh water."
    assert keyword_heuristic_score(FLOWERS, reply) == pytest.approx(0.25 + 0.25 + 0.75)
    # two rude phrases, nothing else, exactly min_words words
    assert keyword_heuristic_score(FLOWERS, "Whatever, figure it out, stupid.") == -1.0
    assert keyword_heuristic_score(FLOWERS, "Thanks!") == pytest.approx(0.25 - 0.5)  # too short
    assert keyword_heuristic_score(FLOWERS, "") == -1.0
    long_reply = " ".join(["word"] * 180)  # 100 words over max_words: -min(1, 0.01 * 100)
    assert keyword_heuristic_score(FLOWERS, long_reply) == pytest.approx(-1.0)
    assert keyword_heuristic_score(FLOWERS, " ".join(["word"] * 130)) == pytest.approx(-0.5)


def test_conversations_are_cut_after_the_last_user_turn() -> None:
    hh = "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Any tea tips?\n\nAssistant: Yes."
    messages = parse_hh_dialogue(hh)
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert conversation_prompt(messages, "x") == messages[:3]
    assert messages[2]["content"] == "Any tea tips?"
    with pytest.raises(ValueError, match="no .*user turn"):
        conversation_prompt([{"role": "system", "content": "Be nice."}], "here")
    with pytest.raises(ValueError, match="here: messages\\[0\\]"):
        conversation_prompt([{"role": "robot", "content": "beep"}], "here")


# --------------------------------------------------------------------------- code reward


def test_build_program_continues_the_stub_or_takes_the_fenced_block() -> None:
    stub = ADD_TASK["prompt"]
    assert build_program(stub, "    return a + b\n\ndef other():\n    pass") == (
        stub + "    return a + b\n"
    )
    assert build_program(stub, "    return a + b\nprint(add(1, 2))") == stub + "    return a + b"
    answer = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert build_program(stub, answer) == stub + "\ndef add(a, b):\n    return a + b\n"


@pytest.mark.slow
def test_code_reward_is_the_honest_fraction_and_hostile_code_scores_zero() -> None:
    stub, tests = ADD_TASK["prompt"], ADD_TASK["tests"]
    completions = [
        "    return a + b\n",  # 3/3
        "    return 3\n",  # add(1, 2) == 3 and add(2.5, 0.5) == 3.0 pass, add(-4, 4) fails
        "    return a - b\n",  # -1, -8, 2.0: none pass
        "    while True:\n        pass\n",  # the first test never ends: timeout
        "    import os\n    os.kill(os.getpid(), 9)\n",  # kills itself in the first test
        "    raise SystemExit(0)\n",  # leaving early is a failure, not a pass
        "    print('PASS 0 1 2')\n    return None\n",  # fake results on stdout are not parsed
        "import sys; sys.exit(0)",  # top-level code that exits before any test runs
    ]
    scores = score_programs(
        [stub] * len(completions),
        completions,
        [tests] * len(completions),
        limits=LIMITS,
        max_workers=2,
    )
    assert scores == pytest.approx([1.0, 2 / 3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])


@pytest.mark.slow
def test_bundled_code_solutions_pass_every_test() -> None:
    records = load_task_records(code_generation.BUNDLED_DATA, code_record)
    assert len(records) == 32
    solved = score_programs(
        [r["prompt"] for r in records],
        [r["solution"] for r in records],
        [r["tests"] for r in records],
        limits=LIMITS,
        max_workers=2,
    )
    assert solved == [1.0] * len(records)


def test_bundled_code_solutions_fit_the_tiny_runs_token_limit() -> None:
    """Each reference solution and the end-of-sequence token fit in the offline run's
    max_new_tokens of the embedded model's tokenizer, so the SFT stage shows whole programs and a
    sampled program can be as long as the reference."""
    from fixtures.tiny_model import TINY_SIZES, train_tokenizer

    tokenizer = train_tokenizer(TINY_SIZES["demo"].vocab_size)
    limit = code_generation.TINY_DEFAULTS["max_new_tokens"]
    records = load_task_records(code_generation.BUNDLED_DATA, code_record)
    lengths = {r["prompt"].split("(")[0]: len(tokenizer.encode(r["solution"]).ids) for r in records}
    assert {name: n for name, n in lengths.items() if n + 1 > limit} == {}


def test_mbpp_and_humaneval_records_become_stub_tasks() -> None:
    mbpp = {
        "text": "Write a function to triple a number.",
        "code": "import math\ndef triple(x):\r\n  return 3 * x",
        "test_list": ["assert triple(2) == 6", "assert triple(0) == 0"],
        "test_setup_code": "",
    }
    task = code_record(mbpp, "mbpp row 0")
    assert task["prompt"] == 'def triple(x):\n    """Write a function to triple a number."""\n'
    assert task["tests"] == mbpp["test_list"] and task["solution"] is None
    humaneval = {
        "prompt": 'def inc(x):\n    """Add one."""\n',
        "test": "def check(candidate):\n    assert candidate(1) == 2\n",
        "entry_point": "inc",
    }
    task = code_record(humaneval, "he row 0")
    assert task["tests"] == [humaneval["test"] + "\ncheck(inc)"]
    scores = score_programs(
        [task["prompt"]] * 2,
        ["    return x + 1\n", "    return x\n"],
        [task["tests"]] * 2,
        limits=LIMITS,
    )
    assert scores == [1.0, 0.0]


# --------------------------------------------------------------------------- data files


def test_bundled_datasets_pass_their_checks() -> None:
    summaries = load_task_records(summarization.BUNDLED_DATA, summary_record)
    conversations = load_task_records(dialogue.BUNDLED_DATA, dialogue_record)
    assert len(summaries) == 36 and len(conversations) == 30
    assert summaries[0]["references"][0].startswith("Millbrook will turn")
    raw = [json.loads(line) for line in dialogue.BUNDLED_DATA.read_text().splitlines()]
    # each conversation ends with the reply to its last user turn: the prompt stops before it
    assert all(c["prompt"] == r["messages"][:-1] for c, r in zip(conversations, raw))
    assert all(c["reply"] == r["messages"][-1]["content"] for c, r in zip(conversations, raw))


@pytest.mark.parametrize(
    "check, good, bad, message",
    [
        (summary_record, {"article": "A.", "summary": "B."}, {"article": "A."}, "column"),
        (
            summary_record,
            {"article": "A.", "summary": "B."},
            {"document": "A.", "summary": []},
            "'summary'",
        ),
        (dialogue_record, {"messages": FLOWERS}, {"messages": FLOWERS[:2][1:]}, "user turn"),
        (code_record, ADD_TASK, {"prompt": "def f():\n", "tests": "assert f()"}, "tests"),
        (code_record, ADD_TASK, {"prompt": "def f():\n", "tests": ["assert ("]}, "compile"),
        (code_record, ADD_TASK, '{"prompt": "def f():\\n", "tests": [', "not valid JSON"),
    ],
)
def test_malformed_lines_are_named_by_file_and_line(
    tmp_path: Path, check: Any, good: Any, bad: Any, message: str
) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", [good, bad, good])
    with pytest.raises(ValueError, match=f"{path}:2: .*{message}"):
        load_task_records(path, check)


# --------------------------------------------------------------------------- one step each


def scripted(cls: type, completion: str) -> type:
    """``cls`` whose completions all decode to ``completion`` (the rollout tokens are unchanged),
    so the step's scores are known."""

    class Scripted(cls):
        def decode_completion(self, tokens: Sequence[int]) -> str:
            return completion

    return Scripted


def spy_on(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[Any]:
    """Record every call of ``module.name`` (which still runs)."""
    calls: list[Any] = []
    real = getattr(module, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        calls.append((args, kwargs, result))
        return result

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.slow
def test_summarization_step_trains_on_rouge_minus_length_penalty(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = spy_on(monkeypatch, summarization, "rouge_quality")
    other_ref = "Scientists tagged twelve young sea turtles with satellite trackers."
    records = [
        summary_record(row, f"row {i}")
        for i, row in enumerate(
            [
                {"article": ARTICLE, "summary": REFERENCE},
                {"article": "Researchers tagged turtles with trackers.", "summary": other_ref},
            ]
        )
    ]
    assert records[1] == {"prompt": records[1]["prompt"], "references": [other_ref]}
    summary = REFERENCE + " " + " ".join(["garden"] * 20)  # 38 words: over 1.5 x 18 (ref words)
    trainer = scripted(SummarizationTrainer, summary)(
        make_config(tiny_model_dir, tmp_path), length_penalty=0.5
    )
    assert trainer.reward_model is None and trainer.reward_fn is rouge_reward
    metrics = trainer.step(records)
    expected = [
        rouge_quality(summary, [REFERENCE])
        - length_penalty(summary, [REFERENCE], max_length_ratio=1.5, coef=0.5),
        rouge_quality(summary, [other_ref])
        - length_penalty(summary, [other_ref], max_length_ratio=1.5, coef=0.5),
    ]
    assert expected[0] < rouge_quality(summary, [REFERENCE])  # the penalty applies
    assert len(calls) == 2  # the trainer's reward, once per completion
    assert metrics["objective/scores"] == pytest.approx(float(np.mean(expected)), abs=1e-6)
    result = trainer.evaluate(records, num_samples=1)
    assert result["eval/mean_reward"] == pytest.approx(float(np.mean(expected)), abs=1e-6)
    assert result["eval/rouge"] - result["eval/length_penalty"] == pytest.approx(
        result["eval/mean_reward"], abs=1e-6
    )
    assert result["eval/summary_words"] == len(summary.split())
    assert len(result["samples"]) == 1


def test_summarization_prompt_format_and_truncation(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = SummarizationTrainer(make_config(tiny_model_dir, tmp_path, max_prompt_length=40))
    short = "Rain fell."
    assert trainer.format_prompt(short) == "Summarize: Rain fell.\nTL;DR:"
    text = trainer.format_prompt(ARTICLE)
    assert len(trainer.encode_prompt(text)) <= 40
    assert text.startswith("Summarize: The town council") and text.endswith("\nTL;DR:")
    # plain articles carry no references: refused before anything is generated
    with pytest.raises(ValueError, match="rouge_reward needs the column\\(s\\) \\['references'\\]"):
        trainer.step([short, ARTICLE])
    with pytest.raises(ValueError, match='"references": \\[summary, ...\\]'):
        trainer.evaluate([short])


@pytest.mark.slow
def test_summarization_with_a_reward_model_subtracts_the_length_penalty(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    rm = RewardModel.from_causal_lm(tiny_model_dir, head_init="normal", seed=1)
    trainer = SummarizationTrainer(make_config(tiny_model_dir, tmp_path), reward_model=rm)
    assert trainer.reward_model is rm and trainer.reward_fn is None
    record = summary_record(
        {"article": ARTICLE, "summary": "The garden will offer forty beds in April."}, "row"
    )
    prompt = trainer.format_prompt(record["prompt"])
    completions = [
        "A garden.",
        "A garden with forty beds for rent behind the old train station from next April.",
    ]
    responses = [trainer.encode_prompt(c) for c in completions]
    width = max(len(r) for r in responses)
    padded = mx.array([r + [trainer.pad_token_id] * (width - len(r)) for r in responses])
    prompt_ids = [trainer.encode_prompt(prompt)] * 2
    query_responses, prompt_lengths = build_query_responses(
        prompt_ids, padded, trainer.pad_token_id
    )
    lengths = prompt_lengths + mx.array([len(r) for r in responses])
    scores, metrics = trainer.compute_scores(
        [prompt] * 2, completions, query_responses, lengths, references=[record["references"]] * 2
    )
    assert float(metrics["rewards/length_penalty"]) == pytest.approx(0.375 / 2)
    # reference: 8 words -> budget 12 words; 15 words -> penalty (15 - 12) / 8 = 0.375
    expected = np.array(rm.score(query_responses, lengths)) - np.array([0.0, 0.375])
    np.testing.assert_allclose(np.array(scores), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_dialogue_step_trains_on_the_heuristic_stand_in(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = spy_on(monkeypatch, dialogue, "keyword_heuristic_score")
    reply = "Thank you! You can keep the flowers fresh in cool water."
    trainer = scripted(DialogueTrainer, reply)(
        make_config(tiny_model_dir, tmp_path), system_prompt="Be brief."
    )
    assert trainer.reward_model is None and trainer.reward_fn is heuristic_reward
    other = [{"role": "system", "content": "Own system."}, {"role": "user", "content": "Hi."}]
    records = [
        dialogue_record({"messages": FLOWERS + FLOWERS[1:2]}, "row 0"),
        dialogue_record({"messages": other}, "row 1"),
    ]
    conversations = [r["prompt"] for r in records]
    assert conversations[0] == FLOWERS  # cut after the last user turn
    text = trainer.format_prompt(conversations[0])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    assert "Be brief." not in trainer.format_prompt(other)  # its own system message stays
    with pytest.raises(ValueError, match="end with the user turn"):
        trainer.format_prompt(FLOWERS[:2])
    metrics = trainer.step(records)
    assert len(calls) == 2  # the trainer's reward, once per completion
    expected = [keyword_heuristic_score(c, reply) for c in conversations]
    assert expected[0] > expected[1]
    assert metrics["objective/scores"] == pytest.approx(float(np.mean(expected)), abs=1e-6)


def test_dialogue_with_a_reward_model_uses_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    rm = RewardModel.from_causal_lm(tiny_model_dir, head_init="normal", seed=1)
    trainer = DialogueTrainer(make_config(tiny_model_dir, tmp_path), reward_model=rm)
    assert trainer.reward_model is rm and trainer.reward_fn is None


@pytest.mark.slow
def test_code_step_trains_on_the_sandboxed_pass_fraction(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = spy_on(monkeypatch, code_generation, "score_completions")
    trainer = scripted(CodeGenerationTrainer, "    return a + b\n")(
        make_config(tiny_model_dir, tmp_path), limits=LIMITS, max_workers=1
    )
    assert trainer.reward_model is None and trainer.reward_fn == trainer.test_reward
    records = [code_record(ADD_TASK, "add"), code_record(EVEN_TASK, "even")]
    metrics = trainer.step(records)
    [(args, kwargs, scores)] = calls
    programs, tests = args
    assert programs == [
        ADD_TASK["prompt"] + "    return a + b\n",
        EVEN_TASK["prompt"] + "    return a + b\n",
    ]
    assert tests == [ADD_TASK["tests"], EVEN_TASK["tests"]]
    assert kwargs["max_workers"] == 1 and kwargs["limits"] is LIMITS
    assert scores == [1.0, 0.0]  # is_even has no a or b: NameError in every test
    assert metrics["objective/scores"] == pytest.approx(0.5)
    result = trainer.evaluate(records, num_samples=1)
    assert result["eval/pass_rate"] == 0.5 and result["eval/mean_reward"] == pytest.approx(0.5)
    assert len(result["samples"]) == 1


def test_code_trainer_rejects_a_reward_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unset reward_model_name"):
        CodeGenerationTrainer(
            make_config(tiny_model_dir, tmp_path, reward_model_name=str(tiny_model_dir))
        )
    with pytest.raises(ValueError, match="pass no reward_model"):
        CodeGenerationTrainer(make_config(tiny_model_dir, tmp_path), reward_model=lambda p, c: c)
    trainer = CodeGenerationTrainer(make_config(tiny_model_dir, tmp_path), prompt_style="chat")
    assert trainer.format_prompt(ADD_TASK["prompt"]).startswith("<|im_start|>user\nComplete")


# --------------------------------------------------------------------------- offline SFT


def test_sft_records_demonstrate_completions_of_the_prompts_ppo_continues(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Each task's SFT example is the PPO prompt's tokens followed by target tokens only.
    reply = "You can trim the stems and change the water every two days."
    flowers = dialogue_record(
        {"messages": FLOWERS + [{"role": "assistant", "content": reply}]}, "r"
    )
    summary = summary_record({"article": ARTICLE, "summary": REFERENCE}, "row")
    task = code_record({**ADD_TASK, "solution": "    return a + b\n"}, "add")
    config = make_config(tiny_model_dir, tmp_path)
    dialogue_sft = dialogue_sft_record(flowers, "Be brief.")
    chat_sft = code_sft_record(task, "chat")
    assert dialogue_sft is not None and chat_sft is not None
    cases = [
        (SummarizationTrainer(config), summary, summary_sft_record(summary)),
        (DialogueTrainer(config, system_prompt="Be brief."), flowers, dialogue_sft),
        (CodeGenerationTrainer(config), task, code_sft_record(task)),
        (CodeGenerationTrainer(config, prompt_style="chat"), task, chat_sft),
    ]
    for trainer, record, sft in cases:
        assert sft is not None
        [example] = tokenize_sft([sft], trainer.tokenizer, 1024)
        prompt_ids = trainer.encode_prompt(trainer.format_prompt(record["prompt"]))
        n = len(prompt_ids)
        assert example.input_ids[:n] == prompt_ids, type(trainer).__name__
        assert set(example.loss_mask[n:]) == {1} and set(example.loss_mask[:n]) <= {0, 1}
    assert flowers["reply"] == reply and dialogue_sft["messages"][-1]["content"] == reply
    answer = chat_sft["messages"][-1]["content"]  # a chat answer that passes the tests
    assert score_programs([task["prompt"]], [answer], [task["tests"]], limits=LIMITS) == [1.0]
    # rows without a demonstration give none
    assert dialogue_sft_record(dialogue_record({"messages": FLOWERS}, "r")) is None
    assert code_sft_record({**task, "solution": None}) is None


def test_cached_stage_reuses_a_stage_until_its_settings_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs: list[int] = []

    def run() -> Path:
        runs.append(1)
        model = tmp_path / "stage" / "model"
        model.mkdir(parents=True, exist_ok=True)
        return model

    stage = tmp_path / "stage"
    model = cached_stage("SFT", stage, {"lr": 1.0}, run)
    assert cached_stage("SFT", stage, {"lr": 1.0}, run) == model and len(runs) == 1
    assert "[SFT] reusing the cached result" in capsys.readouterr().out
    cached_stage("SFT", stage, {"lr": 2.0}, run)  # other settings: run again
    cached_stage("SFT", stage, {"lr": 2.0}, run, fresh=True)
    assert len(runs) == 3


def test_reward_change_pairs_the_samples_by_prompt() -> None:
    # 2 prompts, 2 samples each, in the order evaluate_records makes: p0, p1, p0, p1
    def result(rewards: list[float]) -> dict[str, Any]:
        samples = [{"reward": r} for r in rewards]
        return {"prompts": 2, "samples": samples, "eval/mean_reward": float(np.mean(rewards))}

    before, after = result([0.0, 1.0, 0.0, 1.0]), result([1.0, 1.0, 0.0, 1.0])
    # per-prompt means 0, 1 -> 0.5, 1: changes 0.5, 0; mean 0.25, std 0.3536 / sqrt(2)
    change, error = reward_change(before, after)
    assert change == pytest.approx(0.25) and error == pytest.approx(0.25)


# --------------------------------------------------------------------------- command line


def cli_args(module: str, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--max-new-tokens",
        "6",
        "--output-dir",
        str(tmp_path / module),
        "--set",
        "progress_bar=false",
        "--set",
        "num_ppo_epochs=1",
        "--set",
        "num_mini_batches=1",
        *extra,
    ]


def run_cli(module: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", f"examples.{module}", *cli_args(module, tmp_path, *extra)]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


def short_articles(tmp_path: Path) -> Path:
    """10 short articles (fast to summarise); with --eval-fraction 0.2, 2 are held out."""
    records = [{"article": f"Story {i}: {ARTICLE[:80]}", "summary": REFERENCE} for i in range(10)]
    return write_jsonl(tmp_path / "short.jsonl", records)


#: Records of an example's bundled data the CLI runs take: fewer samples to evaluate (each code
#: sample is a sandbox run, about a tenth of a second; 4 samples per prompt, before and after).
FEW_RECORDS = {"code_generation": 4, "dialogue": 10}


def first_bundled(module: str, tmp_path: Path) -> Path:
    """The first ``FEW_RECORDS[module]`` records of example ``module``'s bundled data."""
    example = {"code_generation": code_generation, "dialogue": dialogue}[module]
    lines = example.BUNDLED_DATA.read_text().splitlines()[: FEW_RECORDS[module]]
    return write_jsonl(tmp_path / f"{module}.jsonl", lines)


SAMPLE_LINE = re.compile(r"^  \[[+-]\d\.\d{3}\] .+\n {10}-> .+$", re.M)


def check_before_and_after(stdout: str, held_out: bool) -> None:
    """The evaluations before and after PPO, each with its samples, and the verdicts."""
    names = ["training prompts"] + (["held-out prompts"] if held_out else [])
    for name in names:
        for when in ("Before", "After"):  # PPO, or the example's offline algorithm (GRPO)
            assert re.search(f"{when} (PPO|GRPO), {name}: mean reward ", stdout), (when, name)
        assert re.search(f"mean reward on {name} (rose|did NOT clearly rise) ", stdout), name
    assert 2 * len(names) <= len(SAMPLE_LINE.findall(stdout)) <= 2 * len(names) * SHOWN_SAMPLES


@pytest.mark.slow
@pytest.mark.parametrize("module", ["summarization", "code_generation"])
def test_cli_runs_on_a_given_model(tiny_model_dir: Path, tmp_path: Path, module: str) -> None:
    if module == "summarization":  # 2 held out, evaluated before and after
        data_args = ["--data", str(short_articles(tmp_path)), "--eval-fraction", "0.2"]
    else:  # none held out
        data_args = ["--data", str(first_bundled(module, tmp_path)), "--eval-fraction", "0"]
    result = run_cli(module, tmp_path, "--model", str(tiny_model_dir), *data_args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[SFT]" not in result.stdout  # a given model is trained as it is
    check_before_and_after(result.stdout, held_out=module == "summarization")
    out = tmp_path / module
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 1 and np.isfinite(records[0]["objective/scores"])
    assert (out / "final").is_dir()
    if module == "summarization":  # ROUGE reward: mean reward = ROUGE - length penalty
        final = json.loads((out / "eval_final.json").read_text())
        assert final["eval/mean_reward"] == pytest.approx(
            final["eval/rouge"] - final["eval/length_penalty"], abs=1e-6
        )
        assert "2 held out" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("module", ["summarization", "dialogue", "code_generation"])
def test_cli_offline_run_fine_tunes_the_tiny_model_first_and_reuses_it(
    tmp_path: Path, module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--tiny-size", "test", "--sft-steps", "2", "--eval-fraction", "0.2"]
    if module == "summarization":
        args += ["--data", str(short_articles(tmp_path))]
    if module in FEW_RECORDS:
        args += ["--data", str(first_bundled(module, tmp_path))]
    result = run_cli(module, tmp_path, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / module
    assert "[SFT] done" in result.stdout
    sft_model = out / "sft" / "model"
    assert (sft_model / "config.json").is_file() and (out / "sft" / "stage.json").is_file()
    assert str(sft_model) in (out / "config.yaml").read_text()  # PPO starts from the SFT model
    # the SFT data: one demonstration per training record, none of the held-out ones
    held_out = int(re.findall(r"(\d+) held out", result.stderr)[0])
    records = {"summarization": 10, **FEW_RECORDS}[module]
    demonstrations = (out / "sft" / "data.jsonl").read_text().splitlines()
    assert held_out >= 1 and len(demonstrations) == records - held_out
    check_before_and_after(result.stdout, held_out=True)
    if module == "dialogue":
        assert "keyword_heuristic_score" in result.stderr  # the stand-in is announced
    # A second run reuses the SFT stage and replaces the PPO run.
    module_main = (
        {"summarization": summarization, "dialogue": dialogue}.get(module, code_generation).main
    )
    capsys.readouterr()
    assert module_main(cli_args(module, tmp_path, *args)) == 0
    second = capsys.readouterr().out
    assert f"[SFT] reusing the cached result in {sft_model}" in second
    assert "[SFT] done" not in second
    check_before_and_after(second, held_out=True)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.slow
def test_cli_resume_continues_the_run_with_its_recorded_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = ["--data", str(short_articles(tmp_path)), "--eval-fraction", "0.2"]
    first = ["--tiny-size", "test", "--sft-steps", "2", "--set", "kl_coef=0.2", *data]
    assert summarization.main(cli_args("summarization", tmp_path, *first)) == 0
    out = tmp_path / "summarization"
    sft_model = str(out / "sft" / "model")
    capsys.readouterr()
    # Only the flags given again change the run: not the task's or the tiny model's defaults
    # (batch_size 8, max_new_tokens 32, kl_coef 0.05), and no new tiny model or SFT stage.
    resumed = ["--resume", "latest", "--output-dir", str(out), "--steps", "2", *data]
    assert summarization.main(resumed) == 0
    printed = capsys.readouterr()
    assert "[SFT]" not in printed.out
    check_before_and_after(printed.out, held_out=True)
    config = read_run_config(out)
    assert config is not None
    assert config["total_steps"] == 2 and config["model_name"] == sft_model
    assert (config["batch_size"], config["max_new_tokens"], config["kl_coef"]) == (2, 6, 0.2)
    assert config["num_ppo_epochs"] == 1 and config["progress_bar"] is False
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    # SFT flags on a resume, and a resume with nothing to resume, fail before any work.
    assert summarization.main([*resumed, "--fresh"]) == 2
    assert "resumed run" in capsys.readouterr().err
    empty = ["--resume", "latest", "--output-dir", str(tmp_path / "none"), *data]
    assert summarization.main(empty) == 2
    assert "no checkpoint with a recorded config" in capsys.readouterr().err


def test_cli_reports_a_malformed_data_line_before_loading_a_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = write_jsonl(tmp_path / "bad.jsonl", [ADD_TASK, {"prompt": "def f():\n"}])
    args = cli_args("code_generation", tmp_path, "--model", str(tmp_path / "no_model"))
    assert code_generation.main([*args, "--data", str(bad)]) == 2
    assert f"error: {bad}:2:" in capsys.readouterr().err  # not the missing model
    # a given model gets no SFT: asking for one is an error, not ignored
    assert code_generation.main([*args, "--sft-steps", "3"]) == 2
    assert "embedded tiny model" in capsys.readouterr().err


@pytest.mark.slow
def test_reasoning_example_runs_every_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m examples.reasoning --smoke`` (its ``main``, in this process: the command
    line's process boundary is tested by the other examples' runs above): SFT warm-up, GRPO with
    the built-in rewards, and the format rate and accuracy before and after, on the training and
    held-out problems."""
    from examples import reasoning

    assert reasoning.main(["--smoke", "--output-dir", str(tmp_path)]) == 0
    stdout = capsys.readouterr().out
    for name in ("training", "held-out"):
        for metric in ("format", "accuracy"):
            assert re.search(
                rf"^{metric} on {name} problems: \d\.\d{{3}} -> \d\.\d{{3}}", stdout, re.M
            )
        assert re.search(
            rf"accuracy on {name} problems (clearly rose|did NOT clearly rise)", stdout
        )
    assert "no reference model" in stdout
    assert (tmp_path / "grpo" / "metrics.jsonl").is_file()


def test_reasoning_problems_are_seeded_and_held_out_apart() -> None:
    from examples.reasoning import HELD_OUT, problems, score, worked_solution

    train, held_out = problems(1)
    assert len(held_out) == HELD_OUT and len(train) + len(held_out) == 100
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert problems(1) == (train, held_out) and problems(2) != (train, held_out)
    record = {"prompt": "What is 3 + 4?\n", "answer": "7"}
    assert worked_solution(record) == "<think>3+4=7</think>7"
    result = score([record, record], [worked_solution(record), "<think>3+4=8</think>8"])
    assert (result["format"], result["accuracy"]) == (1.0, 0.5)


@pytest.mark.slow
def test_tool_use_example_runs_every_stage(tmp_path: Path) -> None:
    """``python -m examples.tool_use --smoke``: SFT warm-up on demonstrations of tool calls, then
    (here GRPO only, to stay short) multi-turn training with the calculator tool, and the task
    reward, tool-call success rate and turns per episode before and after."""
    cmd = [sys.executable, "-m", "examples.tool_use", "--smoke", "--algorithms", "grpo"]
    cmd += ["--output-dir", str(tmp_path)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for label in (
        "task reward",
        "tool-call success rate (episodes with a successful call)",
        "well-formed calls (successful calls / calls)",
        "calls per episode",
        "turns per episode",
    ):
        assert re.search(
            rf"^grpo {re.escape(label)} on held-out problems: \d+\.\d{{3}} -> \d+\.\d{{3}}",
            result.stdout,
            re.M,
        ), label
    for label in ("task reward", "tool-call success rate"):
        assert re.search(rf"grpo {label} (clearly rose|did NOT clearly rise)", result.stdout)
    assert (tmp_path / "grpo" / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_distill_task_example_runs_every_stage(tmp_path: Path) -> None:
    """``python -m examples.distill_task --quick`` with each loss (``reverse_kl``: algorithm
    distill; ``gkd``: algorithm gkd on-policy): the teacher's and the student's SFT (the second
    run reuses the first's), distillation on prompts alone, and the table of task scores and
    per-token KL to the teacher (student before and after, teacher); the student's KL to the
    teacher falls."""
    for loss in ("reverse_kl", "gkd"):
        cmd = [sys.executable, "-m", "examples.distill_task", "--quick", "--loss", loss]
        cmd += ["--output-dir", str(tmp_path)]
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        algorithm = {"reverse_kl": "distill", "gkd": "gkd"}[loss]
        assert f"[{loss}] algorithm {algorithm}: " in result.stdout
        rows = {}
        for label in ("student before", "student after", "teacher"):
            match = re.search(
                rf"^\| {label} \| (\d\.\d{{3}}) \| (\d\.\d{{3}}) \| (-?\d+\.\d{{3}}) \|$",
                result.stdout,
                re.M,
            )
            assert match, (loss, label)
            rows[label] = [float(x) for x in match.groups()]
        for metric in ("sampled", "greedy"):
            assert re.search(
                rf"^{metric} score (clearly rose|did NOT clearly rise): change ",
                result.stdout,
                re.M,
            )
        assert abs(rows["teacher"][2]) < 1e-3  # the teacher's KL to itself
        assert rows["student after"][2] < rows["student before"][2], (loss, rows)
        assert "KL per token fell" in result.stdout
        assert (tmp_path / loss / "metrics.jsonl").is_file()
    assert "[SFT] reusing the cached result" in result.stdout  # the gkd run reused the SFT stages
