"""rewards/: the registry (names, paths, parameters, errors) and each built-in on hand-written
cases."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rewards
from rewards import check_reward_columns, list_rewards, register_reward, resolve_reward
from rewards import math_check
from rewards.builtin import (
    choice_letter,
    cosine_scaled,
    repetition_score,
    soft_overlong_penalty,
)
from rewards.text import (
    answer_text,
    final_answer,
    last_boxed,
    single_expression,
    stated_answer,
    think_opened,
)
from ppo_trainer.callbacks import TrainerCallback

BUILT_INS = [
    "code_tests",
    "cosine_length",
    "math_accuracy",
    "mcq_accuracy",
    "repetition_penalty",
    "soft_overlong",
    "think_format",
    "think_format_soft",
]


# --------------------------------------------------------------------------- the registry


def test_every_built_in_is_listed_with_a_summary() -> None:
    listed = {info.name: info for info in list_rewards()}
    assert set(BUILT_INS) <= set(listed)
    assert all(listed[name].summary for name in BUILT_INS)
    assert listed["math_accuracy"].columns == ("answer|solution",)
    assert listed["code_tests"].columns == ("tests",)


def test_resolve_by_name_and_by_path() -> None:
    assert resolve_reward("think_format") is rewards.builtin.think_format
    assert resolve_reward(" math_accuracy ") is rewards.builtin.math_accuracy
    assert resolve_reward("rewards.builtin:mcq_accuracy") is rewards.builtin.mcq_accuracy


def test_unknown_name_lists_close_matches() -> None:
    with pytest.raises(ValueError, match=r"unknown reward 'math_acuracy': did you mean math_acc"):
        resolve_reward("math_acuracy")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_reward("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="is not a function"):
        resolve_reward("rewards.builtin:nothing_here")


def test_parameters_are_bound_and_checked() -> None:
    fn = resolve_reward({"name": "soft_overlong", "max_length": 10, "cache": 4})
    assert fn.__name__ == "soft_overlong"
    assert fn(["p"] * 3, ["a"] * 3, completion_ids=[[1] * 6, [1] * 8, [1] * 11]) == [
        0.0,
        -0.5,
        -1.0,
    ]
    with pytest.raises(ValueError, match=r"needs the parameter\(s\) \['cache', 'max_length'\]"):
        resolve_reward("soft_overlong")
    with pytest.raises(ValueError, match=r"has no parameter \['max_len'\]"):
        resolve_reward({"name": "soft_overlong", "max_len": 10, "cache": 4})
    with pytest.raises(ValueError, match="needs a 'name'"):
        resolve_reward({"max_length": 10})
    # A column is not a parameter.
    with pytest.raises(ValueError, match=r"no parameter \['answer'\]"):
        resolve_reward({"name": "math_accuracy", "answer": "2"})


def test_register_reward_adds_a_users_reward() -> None:
    @register_reward("test_length_reward", columns=("target",))
    def length_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float | None]:
        return [float(len(c)) for c in completions]

    assert resolve_reward("test_length_reward") is length_reward
    assert "test_length_reward" in [info.name for info in list_rewards()]
    with pytest.raises(ValueError, match="registered already"):
        register_reward("test_length_reward")(lambda prompts, completions: [])
    with pytest.raises(ValueError, match="plain word"):
        register_reward("a:b")


def test_missing_column_is_named() -> None:
    check_reward_columns(resolve_reward("math_accuracy"), ["prompt", "solution"])
    with pytest.raises(ValueError, match=r"math_accuracy reads the column 'answer' or 'solution'"):
        check_reward_columns(resolve_reward("math_accuracy"), ["prompt"])
    bound = resolve_reward({"name": "code_tests", "max_workers": 1})
    with pytest.raises(ValueError, match="code_tests reads the column 'tests'"):
        check_reward_columns(bound, ["prompt", "answer"])


# --------------------------------------------------------------------------- reading completions


def test_think_block_reading() -> None:
    assert think_opened("<|im_start|>assistant\n<think>\n")
    assert not think_opened("<think>a</think> ok")
    assert not think_opened("plain")
    assert answer_text("q", "<think>a</think> 42") == " 42"
    assert answer_text("q<think>", "a</think>42") == "42"
    assert answer_text("q", "<think>unfinished") is None
    assert answer_text("q", "no block 7") == "no block 7"
    assert last_boxed(r"\boxed{1} then \boxed{\frac{1}{2}} end") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{unclosed") is None
    assert final_answer("q", r"<think>\boxed{3}</think> so \boxed{4}.") == "4"
    assert final_answer("q", "<think>x</think>  the answer is 5 ") == "the answer is 5"
    assert final_answer("q", "<think>x</think>   ") is None


# --------------------------------------------------------------------------- the built-ins


def test_think_format_strict_and_soft() -> None:
    cases = [
        # (prompt, completion, strict, soft)
        ("q", "<think>reason</think> 42", 1.0, 1.0),
        ("q", "  <think>reason</think>\n42", 1.0, 1.0),
        ("q<think>\n", "reason</think> 42", 1.0, 1.0),  # the template opened the block
        ("q<think>\n", "<think>reason</think> 42", 0.0, 1.0),  # two openings
        ("q", "<think>reason</think>", 0.0, 0.0),  # no answer
        ("q", "<think>reason</think>   ", 0.0, 0.0),
        ("q", "<think>reason", 0.0, 0.0),  # never closed
        ("q", "42", 0.0, 0.0),
        ("q", "preamble <think>r</think> 42", 0.0, 1.0),  # text before the block
        ("q", "<think>a</think> b <think>c</think> 42", 0.0, 1.0),  # two blocks
        ("q", "reason</think> 42", 0.0, 0.0),  # closed, never opened
    ]
    prompts = [c[0] for c in cases]
    completions = [c[1] for c in cases]
    assert resolve_reward("think_format")(prompts, completions) == [c[2] for c in cases]
    assert resolve_reward("think_format_soft")(prompts, completions) == [c[3] for c in cases]
    custom = resolve_reward({"name": "think_format", "think_start": "<r>", "think_end": "</r>"})
    assert custom(["q", "q"], ["<r>x</r> 1", "<think>x</think> 1"]) == [1.0, 0.0]


def test_math_accuracy_matches_math_verify() -> None:
    from math_verify import parse, verify

    cases = [
        # (completion, answer, expected)
        (r"<think>half</think> \boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"<think>x</think> \boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"<think>x</think> The answer is \boxed{50\%}", "0.5", None),  # filled in below
        (r"<think>x</think> \boxed{\{1, 2\}}", r"$\{2, 1\}$", 1.0),
        (r"<think>x</think> \boxed{2x + 2}", "$2(x+1)$", 1.0),
        (r"<think>x</think> \boxed{3}", "4", 0.0),
        ("<think>7 is wrong, \\boxed{7}</think> 8", "8", 1.0),  # the box in the thought is ignored
        ("<think>the answer is 8", "8", 0.0),  # never closed: no answer
        ("<think>x</think> 12", "12", 1.0),
        ("<think>x</think>", "12", 0.0),
    ]
    completions = [c for c, _, _ in cases]
    answers = [a for _, a, _ in cases]
    scores = resolve_reward("math_accuracy")(["q"] * len(cases), completions, answer=answers)
    for (completion, answer, expected), score in zip(cases, scores):
        boxed = last_boxed(completion.rpartition("</think>")[2])
        if boxed is not None:
            own = float(verify(parse(answer), parse(rf"\boxed{{{boxed}}}")))
            assert score == own, (completion, answer)
        if expected is not None:
            assert score == expected, (completion, answer)
    # TRL's column name, and a reference that does not parse is "not applicable".
    by_solution = resolve_reward("math_accuracy")(["q"], [r"\boxed{2}"], solution=["$2$"])
    assert by_solution == [1.0]
    assert resolve_reward("math_accuracy")(["q"], [r"\boxed{2}"], answer=["@@"]) == [None]
    with pytest.raises(ValueError, match="'answer' \\(or 'solution'\\) column"):
        resolve_reward("math_accuracy")(["q"], ["2"])
    with pytest.raises(ValueError, match="1 completions but 2 values"):
        resolve_reward("math_accuracy")(["q"], ["2"], answer=["2", "3"])


def test_stated_answer_is_one_box_phrase_or_expression() -> None:
    assert stated_answer(r"so \boxed{1} then \boxed{\frac{1}{2}}.") == (r"\frac{1}{2}", True)
    assert stated_answer("The answer is $\\frac{3}{4}$.") == (r"\frac{3}{4}", False)
    assert stated_answer("**Final Answer:** 14") == ("14", False)
    assert stated_answer("Answer:\n14") == ("14", False)
    assert stated_answer("The final answer is 7. I hope it is correct.") == ("7", False)
    assert stated_answer(" 2^{10} ") == ("2^{10}", False)
    assert stated_answer("x = 2 \\cdot 7") == ("x = 2 \\cdot 7", False)
    assert stated_answer("1,024") == ("1,024", False)  # a thousands separator
    assert stated_answer(r"$\{1, 2\}$") == (r"\{1, 2\}", False)  # a comma inside braces
    assert stated_answer(r"\sqrt{2} + pi") == (r"\sqrt{2} + pi", False)
    assert stated_answer("The answer is $18.") == ("18", False)  # a price (GSM8K's answers)
    assert stated_answer(r"Answer: \$1,250.50") == ("1,250.50", False)
    assert stated_answer("The answer to 5 + 9 is 14.") == ("14", False)
    matrix = r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}"
    assert stated_answer(f"${matrix}$") == (matrix, False)
    for none in (
        "So we get 14.",  # prose
        "14, 18, 19",  # a list
        "14; 18",
        "1 2 3",  # numbers side by side
        "$14$ or $18$",  # two math environments
        "The answer is 14 or 18.",
        "The answer is 14. Wait, that is wrong.",  # words after the answer
        "The answer is correct.",
        r"5 \text{ cm}",  # a unit outside a box reads as prose
        "$18 or $19",
        r"\boxed{ }",
        "",
    ):
        assert stated_answer(none) is None, none
    assert single_expression("$14$.") == "14"
    assert single_expression("**14**") == "14"


def test_math_accuracy_reads_the_final_answer_only() -> None:
    """issue #47: without a box the answer region went to math-verify's plain-text extraction,
    which takes a number from anywhere; strict (the default) reads one stated answer, LaTeX as
    LaTeX; lenient=True keeps the old rule."""
    fn = resolve_reward("math_accuracy")
    lenient = resolve_reward({"name": "math_accuracy", "lenient": True})
    garbled = "Answer: 5 + 9 = 14, 18, 19, 20, 22, 24"
    cases = [
        # (completion, answer, strict, lenient)
        ("2^{10}", "2", 0.0, 1.0),
        ("2^{10}", "1024", 1.0, 0.0),
        ("<think>x</think> 2^{10}", "1024", 1.0, 0.0),
        (garbled, "14", 0.0, 1.0),
        ("2 \\cdot 7", "14", 1.0, 0.0),
        ("The answer is $\\frac{3}{4}$.", "0.75", 1.0, 1.0),
        ("x = 14", "14", 1.0, 1.0),
        ("So we get 14.", "14", 0.0, 1.0),
    ]
    completions = [c[0] for c in cases]
    answers = [c[1] for c in cases]
    prompts = ["q"] * len(cases)
    assert fn(prompts, completions, answer=answers) == [c[2] for c in cases]
    assert lenient(prompts, completions, answer=answers) == [c[3] for c in cases]
    # A tower of powers read as LaTeX is 10^(10^(10^10)), not 10: the comparison runs out of time
    # (1 s here) and scores 0.
    tower = "10^{10^{10^{10}}}"
    assert fn(["q"], [tower], answer=["10"], timeout_seconds=1) == [0.0]
    assert lenient(["q"], [tower], answer=["10"], timeout_seconds=1) == [1.0]
    # cosine_length judges correctness by the same rule.
    cosine = resolve_reward({"name": "cosine_length", "max_length": 40})
    wrong = cosine_scaled(False, len(garbled), 40, -1, -0.5, 0.5, 1)
    assert cosine(["q"], [garbled], answer=["14"]) == [pytest.approx(wrong)]
    lenient_cosine = resolve_reward({"name": "cosine_length", "max_length": 40, "lenient": True})
    right = cosine_scaled(True, len(garbled), 40, -1, -0.5, 0.5, 1)
    assert lenient_cosine(["q"], [garbled], answer=["14"]) == [pytest.approx(right)]


@pytest.mark.parametrize(
    "prompt, completion, answer",
    [
        # Many numbers: one of them is right.
        ("q", " ".join(str(i) for i in range(1, 15)), "14"),
        ("q", "14, 18, 19, 20, 22, 24", "14"),
        ("q", "Answer: 5 + 9 = 14, 18, 19, 20, 22, 24", "14"),
        ("q", "The answer is 13 or 14.", "14"),
        ("q", "$13$, $14$", "14"),
        # The answer only inside the think block.
        ("q", "<think>the answer is 14</think> I am not sure.", "14"),
        ("q", r"<think>\boxed{14}</think>", "14"),
        ("q", r"<think>so \boxed{14}", "14"),  # never closed
        # An answer, then a retraction.
        ("q", "The answer is 14. Wait, that is wrong.", "14"),
        ("q", "The answer is 14. No, the answer is 13.", "14"),
        ("q", r"\boxed{14}, no: \boxed{13}", "14"),
        # The prompt's numbers echoed.
        ("Which is larger, 5 or 9?", "5 or 9", "9"),
        ("Which is larger, 5 or 9?", "The numbers are 5 and 9.", "9"),
        ("What is 7 times 2?", "7 2 14", "14"),
    ],
)
def test_reward_hacking_shapes_score_zero(prompt: str, completion: str, answer: str) -> None:
    assert resolve_reward("math_accuracy")([prompt], [completion], answer=[answer]) == [0.0]


def test_math_accuracy_off_the_main_thread_uses_a_helper_process() -> None:
    out: list[Any] = []
    fn = resolve_reward("math_accuracy")
    worker = threading.Thread(
        target=lambda: out.append(fn(["q", "q"], [r"\boxed{2}", r"\boxed{3}"], answer=["2", "2"]))
    )
    worker.start()
    worker.join()
    assert out == [[1.0, 0.0]]


def test_a_check_that_overruns_scores_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    math_check._kill_helper()
    # No time for the fresh helper process to even start: the check overruns, is killed, 0.
    monkeypatch.setattr(math_check, "_STARTUP_SECONDS", -0.95)
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(math_check.verify_answer("2", "2", 0)))
    worker.start()
    worker.join()
    assert out == [False]
    assert math_check._worker is None


def test_mcq_accuracy() -> None:
    assert choice_letter(r"\boxed{B}") == "B"
    assert choice_letter("The answer is (C).") == "C"
    assert choice_letter("Answer: d") == "D"
    assert choice_letter(" (A) ") == "A"
    assert choice_letter("I think so") is None
    completions = [
        "<think>A looks wrong</think> The answer is B",
        "<think>x</think> (C)",
        r"<think>x</think> \boxed{A}",
        "<think>the answer is B",
        "<think>x</think> I am not sure",
    ]
    scores = resolve_reward("mcq_accuracy")(
        ["q"] * 5, completions, answer=["B", "(B)", "A", "B", "B"]
    )
    assert scores == [1.0, 0.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="not an option letter"):
        resolve_reward("mcq_accuracy")(["q"], ["A"], answer=["42"])


def test_soft_overlong_formula() -> None:
    # L_max = 10, L_cache = 4: 0 up to 6 tokens, then -1/4 per token, -1 past 10.
    expected = {0: 0.0, 6: 0.0, 7: -0.25, 8: -0.5, 10: -1.0, 11: -1.0, 50: -1.0}
    for length, value in expected.items():
        assert soft_overlong_penalty(length, 10, 4) == value
    with pytest.raises(ValueError, match="0 < cache <= max_length"):
        resolve_reward({"name": "soft_overlong", "max_length": 4, "cache": 8})(
            ["p"], ["a"], completion_ids=[[1]]
        )


def test_cosine_length_formula_and_reward() -> None:
    # Correct and empty: max_value_correct; correct at L_max: min_value_correct.
    assert cosine_scaled(True, 0, 100, -1.0, -0.5, 0.5, 1.0) == pytest.approx(1.0)
    assert cosine_scaled(True, 100, 100, -1.0, -0.5, 0.5, 1.0) == pytest.approx(0.5)
    assert cosine_scaled(True, 50, 100, -1.0, -0.5, 0.5, 1.0) == pytest.approx(0.75)
    # Wrong: -1 when short, -0.5 at L_max (a long wrong answer is punished less).
    assert cosine_scaled(False, 0, 100, -1.0, -0.5, 0.5, 1.0) == pytest.approx(-1.0)
    assert cosine_scaled(False, 100, 100, -1.0, -0.5, 0.5, 1.0) == pytest.approx(-0.5)
    # open-r1: min_value = max_value_wrong, max_value = min_value_wrong when wrong.
    naive = -0.5 + 0.5 * (-1.0 - -0.5) * (1 + math.cos(math.pi * 0.25))
    assert cosine_scaled(False, 25, 100, -1.0, -0.5, 0.5, 1.0) == pytest.approx(naive)
    fn = resolve_reward({"name": "cosine_length", "max_length": 40})
    right, wrong = r"\boxed{2}", r"\boxed{3}"
    scores = fn(["q", "q"], [right, wrong], answer=["2", "2"])
    assert scores[0] == pytest.approx(cosine_scaled(True, len(right), 40, -1, -0.5, 0.5, 1))
    assert scores[1] == pytest.approx(cosine_scaled(False, len(wrong), 40, -1, -0.5, 0.5, 1))


def test_repetition_penalty() -> None:
    # "a b a b a b": 2-grams ab ba ab ba ab, 2 distinct of 5: -(1 - 2/5).
    assert repetition_score("a b a b a b", 2, -1.0) == pytest.approx(-0.6)
    assert repetition_score("A b c d", 2, -1.0) == 0.0
    assert repetition_score("short", 3, -1.0) == 0.0
    fn = resolve_reward({"name": "repetition_penalty", "ngram_size": 2, "max_penalty": -0.5})
    assert fn(["p", "p"], ["x y x y x y", "one two three"]) == pytest.approx([-0.3, 0.0])
    with pytest.raises(ValueError, match="max_penalty <= 0"):
        resolve_reward({"name": "repetition_penalty", "max_penalty": 1.0})(["p"], ["a"])


def test_code_tests_runs_the_sandbox() -> None:
    tests = [["assert add(1, 2) == 3", "assert add(0, 0) == 0"]] * 4
    completions = [
        "<think>sum</think>\n```python\ndef add(a, b):\n    return a + b\n```",
        "def add(a, b):\n    return a - b",
        "<think>never closed\ndef add(a, b):\n    return a + b",
        "<think>x</think> def add(a, b): return 3",
    ]
    scores = resolve_reward("code_tests")(["p"] * 4, completions, tests=tests)
    assert scores == [1.0, 0.5, 0.0, 0.5]


# --------------------------------------------------------------------------- in a config and a run


def test_reward_funcs_in_a_config_file_mix_names_paths_and_parameters(tmp_path: Path) -> None:
    from config.loading import load_config
    from ppo_trainer.components import reward_function

    path = tmp_path / "run.yaml"
    path.write_text(
        "model_name: m\nalgorithm: grpo\ngroup_size: 2\n"
        "reward_funcs:\n"
        "  - think_format\n"
        "  - {name: soft_overlong, max_length: 512, cache: 64}\n"
        "  - rewards.builtin:math_accuracy\n"
        "  - org/reward-model\n"
        "reward_weights: [0.5, 1, 1, 1]\n"
    )
    cfg = load_config(path)
    assert cfg.reward_func_names == [
        "think_format",
        "soft_overlong",
        "math_accuracy",
        "reward-model",
    ]
    assert cfg.reward_funcs is not None
    assert cfg.reward_funcs[1] == {"name": "soft_overlong", "max_length": 512, "cache": 64}
    overlong = reward_function(cfg.reward_funcs[1])
    assert overlong(["p"], ["c"], completion_ids=[[1] * 464]) == [-0.25]
    assert reward_function("rewards.builtin:math_accuracy") is rewards.builtin.math_accuracy
    with pytest.raises(ValueError, match="unknown reward 'think_formt': did you mean think_format"):
        reward_function("think_formt")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_name: m\nreward_funcs: [{name: x, p: {nested: 1}}]\n")
    with pytest.raises(ValueError, match="reward_funcs must be"):
        load_config(bad)


def test_built_in_rewards_score_a_grpo_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    from tests.test_algorithms_learn import config
    from ppo_trainer.ppo_trainer import PPOTrainer

    cfg = config(
        tiny_model_dir,
        tmp_path / "run",
        algorithm="grpo",
        group_size=2,
        reward_funcs=[
            {"name": "repetition_penalty", "ngram_size": 1},
            {"name": "soft_overlong", "max_length": 12, "cache": 8},
            "math_accuracy",
        ],
        reward_weights=[1.0, 0.5, 1.0],
    )
    trainer = PPOTrainer(cfg)
    records = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]
    keep = _KeepRollout()
    trainer.run.callbacks.append(keep)
    metrics = trainer.step(records)
    for name in ("repetition_penalty", "soft_overlong", "math_accuracy"):
        assert f"rewards/{name}/mean" in metrics
    rollout = keep.rollouts[-1]
    # Each completion's ids, the stop token included (the mask's tokens after the prompt).
    rows = np.asarray(rollout.query_responses).tolist()
    starts = np.asarray(rollout.prompt_lengths).tolist()
    counts = np.asarray(rollout.mask).sum(axis=1).astype(int).tolist()
    ids = [row[s : s + n] for row, s, n in zip(rows, starts, counts)]
    repeated = resolve_reward({"name": "repetition_penalty", "ngram_size": 1})
    expected = np.array(repeated(rollout.texts, rollout.completions))
    answers = [r["answer"] for r in records for _ in range(2)]
    accuracy = resolve_reward("math_accuracy")(rollout.texts, rollout.completions, answer=answers)
    expected += np.array([0.0 if a is None else a for a in accuracy])
    overlong = resolve_reward({"name": "soft_overlong", "max_length": 12, "cache": 8})
    expected += 0.5 * np.array(overlong(rollout.texts, rollout.completions, completion_ids=ids))
    np.testing.assert_allclose(np.array(rollout.scores), expected, rtol=1e-5, atol=1e-6)


def test_a_missing_column_fails_before_any_generation(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_algorithms_learn import config
    from ppo_trainer import rollout as rollout_module
    from ppo_trainer.ppo_trainer import PPOTrainer

    cfg = config(
        tiny_model_dir,
        tmp_path / "run",
        algorithm="grpo",
        group_size=2,
        reward_funcs=["think_format", "math_accuracy"],
    )
    trainer = PPOTrainer(cfg)
    rolled: list[Any] = []
    original = rollout_module.sample_responses

    def sample_responses(*args: Any, **kwargs: Any) -> Any:
        rolled.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(rollout_module, "sample_responses", sample_responses)
    with pytest.raises(ValueError, match="reads the column 'answer' or 'solution'"):
        trainer.step([{"prompt": "What is 1 + 1?", "question_id": 3}] * 4)
    assert not rolled
    trainer.step([{"prompt": "What is 1 + 1?", "answer": "2"}] * 4)
    assert rolled  # the same step with the column runs


def test_main_rewards_lists_every_built_in(capsys: pytest.CaptureFixture[str]) -> None:
    import main

    assert main.main(["rewards"]) == 0
    lines = capsys.readouterr().out.splitlines()
    by_name = {line.split()[0]: line for line in lines}
    assert set(BUILT_INS) <= set(by_name)
    assert "[reads answer or solution]" in by_name["math_accuracy"]
    assert "[parameters: max_length, cache]" in by_name["soft_overlong"]
    assert "lenient" in by_name["math_accuracy"]
    assert "completion_ids" in by_name["soft_overlong"]


class _KeepRollout(TrainerCallback):
    """Keeps the rollouts of the steps it sees (``on_rollout_scored``)."""

    def __init__(self) -> None:
        self.rollouts: list[Any] = []

    def on_rollout_scored(self, trainer: Any, step: int, rollout: Any) -> None:
        self.rollouts.append(rollout)


# --------------------------------------------------------------------------- against TRL


def test_built_ins_equal_trls_rewards_where_they_mean_the_same() -> None:
    """trl.rewards (TRL 1.12) on the same inputs, recorded by tests/trl_rewards_reference.py in
    a throwaway venv with trl (CI has none). Where ours differ, on purpose, the case is listed
    with both values:

    - think_format is stricter than think_format_reward: an answer must follow ``</think>``
      and there is one ``</think>`` only; it allows whitespace before ``<think>``, TRL none.
    - math_accuracy takes a plain final answer ("The answer is 4."), TRL only LaTeX; its
      lenient rule gives the same verdicts here.
    - repetition_penalty counts n-grams of lower-cased words (open-r1), TRL of token ids: TRL
      is given the words as ids here, so the formula is what is compared.
    - cosine_length measures characters (open-r1), TRL tokens: the completions are padded to
      the token count here.
    """
    import json

    from rewards.builtin import (
        cosine_length,
        math_accuracy,
        repetition_penalty,
        soft_overlong,
        think_format,
    )
    from tests import trl_rewards_reference as ref

    trl = json.loads(ref.OUT.read_text())

    def blank(n: int) -> list[str]:
        return [""] * n

    def compare(ours: list[Any], theirs: list[Any], differ: dict[int, tuple[Any, Any]]) -> None:
        assert len(ours) == len(theirs)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if i in differ:
                assert (a, b) == differ[i], i
            else:
                assert (a is None and b is None) or a == pytest.approx(b, abs=1e-12), i

    cases = list(ref.THINK_CASES)
    compare(
        think_format(blank(len(cases)), cases),
        trl["think_format"],
        {5: (0.0, 1.0), 6: (0.0, 1.0), 7: (1.0, 0.0)},  # empty answer, two </think>, blank first
    )
    for key, table in (
        ("accuracy", ref.ACCURACY_CASES),
        ("reasoning_accuracy", ref.REASONING_CASES),
    ):
        texts, solutions = (list(c) for c in zip(*table))
        differ = {8: (1.0, 0.0)} if key == "accuracy" else {}  # "The answer is 4."
        compare(math_accuracy(blank(len(texts)), texts, solution=solutions), trl[key], differ)
        lenient = math_accuracy(blank(len(texts)), texts, solution=solutions, lenient=True)
        compare(lenient, trl[key], differ)
    ids = [[1] * n for n in ref.SOFT_OVERLONG_LENGTHS]
    max_length, cache = ref.SOFT_OVERLONG
    overlong = soft_overlong(
        blank(len(ids)), blank(len(ids)), ids, max_length=max_length, cache=cache
    )
    compare(overlong, trl["soft_overlong"], {})
    texts, solutions, lengths = (list(c) for c in zip(*ref.COSINE_CASES))
    padded = [t + " " * (n - len(t)) for t, n in zip(texts, lengths)]
    cosine = cosine_length(
        blank(len(texts)), padded, solution=solutions, max_length=ref.COSINE_MAX_LEN
    )
    compare(cosine, trl["cosine"], {})
    repetition = [
        repetition_penalty([""], [text], ngram_size=n, max_penalty=-1.0)[0]
        for text, n in ref.REPETITION_CASES
    ]
    compare(repetition, trl["repetition"], {})
