"""The built-in rewards, each ``fn(prompts, completions, **columns) -> list[float | None]``.

Parameters after the columns are keyword-only and set from the config
(``reward_funcs: [{name: soft_overlong, max_length: 512, cache: 64}]``). ``prompts`` are the
formatted prompts (after the chat template), so a template that opened ``<think>`` is seen.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from rewards.math_check import answer_source, verify_answer
from rewards.registry import register_reward
from rewards.text import (
    THINK_END,
    THINK_START,
    answer_text,
    final_answer,
    full_completion,
    last_boxed,
    stated_answer,
)
from sandbox import extract_code, score_completions


def _check_lengths(name: str, completions: Sequence[Any], **columns: Sequence[Any]) -> None:
    for column, values in columns.items():
        if len(values) != len(completions):
            raise ValueError(
                f"{name}: {len(completions)} completions but {len(values)} values of the "
                f"column {column!r}; pass one value per completion"
            )


@register_reward("think_format")
def think_format(
    prompts: list[str],
    completions: list[str],
    *,
    think_start: str = THINK_START,
    think_end: str = THINK_END,
    **_: Any,
) -> list[float | None]:
    """1 when the completion is one think block followed by a non-empty answer, else 0 (strict).

    ``c = prefix + completion`` (prefix = ``<think>`` when the prompt already opened it) must be
    ``\\s* <think> ... </think> \\s* answer`` with exactly one ``<think>`` and one ``</think>``,
    the think block first, and ``answer.strip() != ""``.
    """
    scores: list[float | None] = []
    for prompt, completion in zip(prompts, completions, strict=True):
        text = full_completion(prompt, completion, think_start, think_end)
        ok = (
            text.lstrip().startswith(think_start)
            and text.count(think_start) == 1
            and text.count(think_end) == 1
            and text.rpartition(think_end)[2].strip() != ""
        )
        scores.append(1.0 if ok else 0.0)
    return scores


@register_reward("think_format_soft")
def think_format_soft(
    prompts: list[str],
    completions: list[str],
    *,
    think_start: str = THINK_START,
    think_end: str = THINK_END,
    **_: Any,
) -> list[float | None]:
    """1 when the completion contains a closed think block followed by some answer text, else 0
    (soft: text before the block and several blocks are allowed).

    ``c = prefix + completion`` must contain ``<think> ... </think>`` with non-blank text after
    the last ``</think>``.
    """
    pattern = re.compile(re.escape(think_start) + ".*?" + re.escape(think_end), re.DOTALL)
    scores: list[float | None] = []
    for prompt, completion in zip(prompts, completions, strict=True):
        text = full_completion(prompt, completion, think_start, think_end)
        ok = pattern.search(text) is not None and text.rpartition(think_end)[2].strip() != ""
        scores.append(1.0 if ok else 0.0)
    return scores


def _gold(name: str, n: int, answer: Any, solution: Any) -> list[str]:
    gold = answer if answer is not None else solution
    if gold is None:
        raise ValueError(
            f"{name} reads the reference from an 'answer' (or 'solution') column: give each "
            "prompt record one"
        )
    _check_lengths(name, range(n), answer=gold)
    return [str(g) for g in gold]


def _correct(
    prompts: list[str],
    completions: list[str],
    gold: list[str],
    think_start: str,
    think_end: str,
    timeout_seconds: int,
    lenient: bool,
) -> list[bool | None]:
    """math-verify's verdict per completion (None: the reference does not parse), on the one
    answer :func:`rewards.text.stated_answer` reads, or (``lenient``) on the text after
    ``</think>`` as math-verify's plain-text extraction reads it."""
    verdicts: list[bool | None] = []
    for prompt, completion, reference in zip(prompts, completions, gold, strict=True):
        answer = answer_text(prompt, completion, think_start, think_end)
        if lenient:
            extracted = final_answer(prompt, completion, think_start, think_end)
            boxed = answer is not None and last_boxed(answer) is not None
            stated = None if extracted is None else (extracted, boxed)
        else:
            stated = None if answer is None else stated_answer(answer)
        if stated is None:
            # No (single) answer given: wrong, unless the reference itself cannot be checked.
            ok = verify_answer(reference, "", timeout_seconds)
            verdicts.append(None if ok is None else False)
            continue
        source = answer_source(stated[0], stated[1], strict=not lenient)
        verdicts.append(verify_answer(reference, source, timeout_seconds, strict=not lenient))
    return verdicts


@register_reward("math_accuracy", columns=("answer|solution",))
def math_accuracy(
    prompts: list[str],
    completions: list[str],
    answer: list[Any] | None = None,
    solution: list[Any] | None = None,
    *,
    think_start: str = THINK_START,
    think_end: str = THINK_END,
    timeout_seconds: int = 5,
    lenient: bool = False,
    **_: Any,
) -> list[float | None]:
    """1 when the final answer equals the reference by math-verify, else 0; None when the
    reference (``answer``, else TRL's ``solution``) does not parse.

    The answer region is the text after ``</think>`` (the whole completion without a think
    block; none when the block never closes). Its final answer (:func:`rewards.text.
    stated_answer`) is the last ``\\boxed{}``, else the expression after the last "the answer
    is" / "final answer:", else the whole region when it is a single expression (LaTeX read as
    LaTeX); a region that offers several candidates, or prose, states none and scores 0.
    ``lenient=True`` keeps the old rule: the text after ``</think>`` goes to math-verify's
    plain-text extraction, which takes a number from anywhere (``2^{10}`` reads as 2).
    Score = ``verify(parse(reference), parse(answer))``, each step bounded by
    ``timeout_seconds``; a timeout scores 0.
    """
    gold = _gold("math_accuracy", len(completions), answer, solution)
    verdicts = _correct(
        prompts, completions, gold, think_start, think_end, timeout_seconds, lenient
    )
    return [None if v is None else float(v) for v in verdicts]


_LETTER = re.compile(r"^\(?([A-Z])[).:]?$")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)?\s*:?\s*\(?([A-Z])\b\)?", re.IGNORECASE)


def choice_letter(text: str) -> str | None:
    """The option letter an answer names: the last ``\\boxed{X}``, else the last "answer is X" /
    "answer: X", else the whole answer when it is just a letter (``B``, ``(B)``, ``B.``)."""
    boxed = last_boxed(text)
    if boxed is not None:
        match = _LETTER.match(boxed.strip())
        return match.group(1) if match else None
    found = _ANSWER_IS.findall(text)
    if found:
        return str(found[-1]).upper()
    match = _LETTER.match(text.strip())
    return match.group(1) if match else None


@register_reward("mcq_accuracy", columns=("answer",))
def mcq_accuracy(
    prompts: list[str],
    completions: list[str],
    answer: list[Any],
    *,
    think_start: str = THINK_START,
    think_end: str = THINK_END,
    **_: Any,
) -> list[float | None]:
    """1 when the answer's option letter (:func:`choice_letter` of the text after ``</think>``)
    is the ``answer`` column's letter (``"B"`` or ``"(B)"``), else 0.
    """
    _check_lengths("mcq_accuracy", completions, answer=answer)
    scores: list[float | None] = []
    for i, (prompt, completion, gold) in enumerate(zip(prompts, completions, answer)):
        match = _LETTER.match(str(gold).strip().upper())
        if match is None:
            raise ValueError(
                f"mcq_accuracy: the answer of record {i} is {gold!r}, not an option letter; "
                "write the correct option as a letter such as 'B'"
            )
        text = answer_text(prompt, completion, think_start, think_end)
        letter = choice_letter(text) if text is not None else None
        scores.append(1.0 if letter == match.group(1) else 0.0)
    return scores


def soft_overlong_penalty(length: int, max_length: int, cache: int) -> float:
    """DAPO's soft overlong punishment of a response of ``length`` tokens:

    ``0`` if ``L <= L_max - L_cache``; ``((L_max - L_cache) - L) / L_cache`` if
    ``L_max - L_cache < L <= L_max``; ``-1`` if ``L > L_max``.
    """
    if length <= max_length - cache:
        return 0.0
    if length <= max_length:
        return ((max_length - cache) - length) / cache
    return -1.0


@register_reward("soft_overlong")
def soft_overlong(
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    *,
    max_length: int,
    cache: int,
    **_: Any,
) -> list[float | None]:
    """DAPO's soft overlong punishment of each completion's token count (TRL's
    ``get_soft_overlong_punishment``): 0 up to ``max_length - cache`` tokens, then falling
    linearly to -1 at ``max_length`` (:func:`soft_overlong_penalty`).

    ``max_length`` is usually the run's ``max_new_tokens``; ``cache`` the width of the ramp.
    """
    if not 0 < cache <= max_length:
        raise ValueError(
            f"soft_overlong needs 0 < cache <= max_length, got cache={cache}, "
            f"max_length={max_length}: set e.g. max_length: 512, cache: 64"
        )
    _check_lengths("soft_overlong", completions, completion_ids=completion_ids)
    return [soft_overlong_penalty(len(ids), max_length, cache) for ids in completion_ids]


def cosine_scaled(
    correct: bool,
    length: int,
    max_length: int,
    min_value_wrong: float,
    max_value_wrong: float,
    min_value_correct: float,
    max_value_correct: float,
) -> float:
    """open-r1's cosine-scaled reward (Yeo et al., "Demystifying Long CoT"):

    ``r = lo + (hi - lo) * (1 + cos(pi * min(L / L_max, 1))) / 2``, with ``(lo, hi) =
    (min_value_correct, max_value_correct)`` when correct (short and right is best) and
    ``(max_value_wrong, min_value_wrong)`` when wrong (a long wrong answer is punished less).
    ``L`` beyond ``L_max`` counts as ``L_max`` (as TRL's ``get_cosine_scaled_reward``): the
    cosine would otherwise climb back and reward very long completions.
    """
    cosine = math.cos(min(length / max_length, 1.0) * math.pi)
    if correct:
        lo, hi = min_value_correct, max_value_correct
    else:
        lo, hi = max_value_wrong, min_value_wrong
    return lo + 0.5 * (hi - lo) * (1.0 + cosine)


@register_reward("cosine_length", columns=("answer|solution",))
def cosine_length(
    prompts: list[str],
    completions: list[str],
    answer: list[Any] | None = None,
    solution: list[Any] | None = None,
    *,
    max_length: int = 1000,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
    think_start: str = THINK_START,
    think_end: str = THINK_END,
    timeout_seconds: int = 5,
    lenient: bool = False,
    **_: Any,
) -> list[float | None]:
    """Length-scaled correctness (open-r1's ``cosine_scaled``; :func:`cosine_scaled`) with
    correctness by :func:`math_accuracy`'s rule (``lenient`` as there) and ``L`` the
    completion's length in characters (as open-r1); None where the reference does not parse.
    """
    gold = _gold("cosine_length", len(completions), answer, solution)
    verdicts = _correct(
        prompts, completions, gold, think_start, think_end, timeout_seconds, lenient
    )
    return [
        (
            None
            if v is None
            else cosine_scaled(
                v,
                len(c),
                max_length,
                min_value_wrong,
                max_value_wrong,
                min_value_correct,
                max_value_correct,
            )
        )
        for v, c in zip(verdicts, completions)
    ]


def repetition_score(text: str, ngram_size: int, max_penalty: float) -> float:
    """open-r1's n-gram repetition penalty of one text: with ``words = text.lower().split()``
    and its ``N = len(words) - n + 1`` n-grams, ``max_penalty * (1 - distinct / N)``; 0 for a
    text shorter than ``n`` words."""
    words = text.lower().split()
    if len(words) < ngram_size:
        return 0.0
    ngrams = [tuple(words[i : i + ngram_size]) for i in range(len(words) - ngram_size + 1)]
    return max_penalty * (1.0 - len(set(ngrams)) / len(ngrams))


@register_reward("repetition_penalty")
def repetition_penalty(
    prompts: list[str],
    completions: list[str],
    *,
    ngram_size: int = 3,
    max_penalty: float = -1.0,
    **_: Any,
) -> list[float | None]:
    """n-gram repetition penalty (open-r1's ``repetition_penalty``; :func:`repetition_score`):
    0 for no repeated n-gram, down to ``max_penalty`` (<= 0) as the share of repeats grows."""
    if ngram_size < 1 or not max_penalty <= 0:
        raise ValueError(
            f"repetition_penalty needs ngram_size >= 1 and max_penalty <= 0, got "
            f"ngram_size={ngram_size}, max_penalty={max_penalty}: set e.g. 3 and -1.0"
        )
    return [repetition_score(c, ngram_size, max_penalty) for c in completions]


@register_reward("code_tests", columns=("tests",))
def code_tests(
    prompts: list[str],
    completions: list[str],
    tests: list[Sequence[str]],
    *,
    max_workers: int | None = None,
    think_start: str = THINK_START,
    think_end: str = THINK_END,
    **_: Any,
) -> list[float | None]:
    """Fraction of its ``tests`` the completion's program passes, run in the code sandbox.

    ``tests`` holds each record's asserts (``["assert add(1, 2) == 3"]``), run by
    :func:`sandbox.score_completions`.

    The program is the first fenced Python block of the answer (the text after ``</think>``),
    else the answer itself; a completion whose think block never closes has no program and
    scores 0.
    """
    _check_lengths("code_tests", completions, tests=tests)
    programs = []
    for prompt, completion in zip(prompts, completions):
        answer = answer_text(prompt, completion, think_start, think_end)
        programs.append(extract_code(answer) if answer is not None else "")
    scores = score_completions(programs, [list(t) for t in tests], max_workers=max_workers)
    return [float(s) for s in scores]
