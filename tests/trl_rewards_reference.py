"""TRL's reward values for the built-in rewards' parity test (tests/test_rewards.py), written to
tests/data/trl_rewards_reference.json.

Run it in a throwaway environment with TRL (never a project requirement)::

    python3.11 -m venv /work/venv-trl
    /work/venv-trl/bin/pip install trl==1.12.0 torch==2.13.0 "math-verify==0.9.0"
    /work/venv-trl/bin/python tests/trl_rewards_reference.py

``trl.rewards`` scores the cases below: ``think_format_reward``, ``accuracy_reward`` and
``reasoning_accuracy_reward`` (on conversational completions ``[{"content": text}]``, TRL's
format), ``get_soft_overlong_punishment``, ``get_cosine_scaled_reward`` and
``get_repetition_penalty_reward`` (on token ids). Only the standard library is imported at module
level, so the test reads the cases from here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "data" / "trl_rewards_reference.json"

#: Completions for think_format (TRL's think_format_reward).
THINK_CASES: tuple[str, ...] = (
    "<think>\nI add them.\n</think>\nThe answer is 4.",
    "<think>\nI add them.\nThe answer is 4.",
    "The answer is 4.",
    "<think>a</think><think>b</think>c",
    "answer first <think>a</think>",
    "<think>a</think>",
    "<think>a</think>b</think>c",
    "  <think>a</think>b",
)

#: (completion, solution) for math_accuracy against accuracy_reward: no think block.
ACCURACY_CASES: tuple[tuple[str, str], ...] = (
    (r"My answer is \boxed{\frac{1}{3}}", r"\frac{1}{3}"),
    (r"My answer is \boxed{\frac{1}{2}}", r"\frac{1}{3}"),
    (r"So \boxed{0.5}", r"$\frac{1}{2}$"),
    (r"We get \boxed{(x+1)^2}", r"$x^2+2x+1$"),
    (r"The set is \boxed{\{1,2\}}", r"$\{2,1\}$"),
    (r"The answer is $\frac{3}{4}$.", r"$0.75$"),
    (r"\boxed{7}", r"$8$"),
    (r"\boxed{7}", "no math here"),
    ("The answer is 4.", "$4$"),
)

#: (completion, solution) for math_accuracy against reasoning_accuracy_reward: think blocks.
REASONING_CASES: tuple[tuple[str, str], ...] = (
    (r"<think>maybe \boxed{2}</think> The answer is \boxed{3}", "$3$"),
    (r"<think>maybe \boxed{3}</think> The answer is \boxed{2}", "$3$"),
    (r"<think>it is \boxed{3}", "$3$"),
    (r"<think>hm</think>\boxed{\frac{2}{4}}", r"$\frac{1}{2}$"),
)

#: (max_completion_len, soft_punish_cache) and the completion lengths in tokens.
SOFT_OVERLONG = (100, 20)
SOFT_OVERLONG_LENGTHS: tuple[int, ...] = (0, 50, 80, 81, 90, 100, 101, 300)

#: Cosine-scaled correctness: max_len, then (completion, solution, length in tokens).
COSINE_MAX_LEN = 100
COSINE_CASES: tuple[tuple[str, str, int], ...] = (
    (r"\boxed{\frac{1}{3}}", r"\frac{1}{3}", 50),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{3}", 50),
    (r"\boxed{5}", "$5$", 10),
    (r"\boxed{6}", "$5$", 10),
    (r"\boxed{5}", "$5$", 100),
    (r"\boxed{5}", "$5$", 250),
    (r"\boxed{6}", "$5$", 250),
    (r"\boxed{5}", "no math here", 20),
)

#: (text, ngram_size) for the repetition penalty, with max_penalty -1.
REPETITION_CASES: tuple[tuple[str, int], ...] = (
    ("the cat sat on the mat", 3),
    ("the the the the the", 2),
    ("a b a b a b a b", 2),
    ("One two. one two. ONE TWO.", 2),
    ("short", 3),
    ("", 3),
)


def word_ids(text: str) -> list[int]:
    """The text's lower-cased words as ids (first appearance order): TRL's penalty counts
    n-grams of token ids, open-r1's (and ours) of ``text.lower().split()``."""
    index: dict[str, int] = {}
    return [index.setdefault(w, len(index)) for w in text.lower().split()]


def main() -> None:
    import math_verify
    import trl
    from trl.rewards import (
        accuracy_reward,
        get_cosine_scaled_reward,
        get_repetition_penalty_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    def chat(texts: list[str]) -> list[list[dict[str, str]]]:
        return [[{"role": "assistant", "content": t}] for t in texts]

    out: dict[str, Any] = {
        "trl_version": trl.__version__,
        "math_verify_version": getattr(math_verify, "__version__", "unknown"),
    }
    out["think_format"] = think_format_reward(chat(list(THINK_CASES)))
    texts, solutions = zip(*ACCURACY_CASES)
    out["accuracy"] = accuracy_reward(chat(list(texts)), list(solutions))
    texts, solutions = zip(*REASONING_CASES)
    out["reasoning_accuracy"] = reasoning_accuracy_reward(chat(list(texts)), list(solutions))
    overlong = get_soft_overlong_punishment(*SOFT_OVERLONG)
    out["soft_overlong"] = overlong([[1] * n for n in SOFT_OVERLONG_LENGTHS])
    cosine = get_cosine_scaled_reward(max_len=COSINE_MAX_LEN)
    texts, solutions, lengths = zip(*COSINE_CASES)
    out["cosine"] = cosine(chat(list(texts)), list(solutions), [[1] * n for n in lengths])
    out["repetition"] = [
        get_repetition_penalty_reward(ngram_size=n, max_penalty=-1.0)([word_ids(text)])[0]
        for text, n in REPETITION_CASES
    ]
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
