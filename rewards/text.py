"""Reading a reasoning completion: the think block, the answer after it, the last ``\\boxed{}``.

A prompt whose chat template already opened the think block (Qwen3 and DeepSeek-R1 templates end
the prompt with ``<think>``) counts as opened: the completion is read as ``<think>`` + completion.
"""

from __future__ import annotations

import re

THINK_START = "<think>"
THINK_END = "</think>"


def think_opened(prompt: str, start: str = THINK_START, end: str = THINK_END) -> bool:
    """Whether ``prompt`` ends inside an open think block (its last ``start`` after its last
    ``end``)."""
    last_start = prompt.rfind(start)
    return last_start >= 0 and last_start > prompt.rfind(end)


def full_completion(
    prompt: str, completion: str, start: str = THINK_START, end: str = THINK_END
) -> str:
    """The completion as if the prompt's open think tag were part of it."""
    return start + completion if think_opened(prompt, start, end) else completion


def answer_text(
    prompt: str, completion: str, start: str = THINK_START, end: str = THINK_END
) -> str | None:
    """The answer part of a completion: the text after the last ``end`` tag; the whole
    completion when it has no think block; None when a think block is opened and never closed
    (the model ran out of tokens while thinking)."""
    text = full_completion(prompt, completion, start, end)
    if end in text:
        return text.rpartition(end)[2]
    if start in text:
        return None
    return text


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces
    matched; None if there is none or it is not closed."""
    best = None
    for command in ("\\boxed{", "\\fbox{"):
        i = text.rfind(command)
        if i >= 0 and (best is None or i > best[0]):
            best = (i, command)
    if best is None:
        return None
    i = best[0] + len(best[1])
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def final_answer(
    prompt: str, completion: str, start: str = THINK_START, end: str = THINK_END
) -> str | None:
    """The answer a completion gives: the last ``\\boxed{}`` of its answer part, else that part
    stripped; None when there is no answer part or it is empty."""
    answer = answer_text(prompt, completion, start, end)
    if answer is None:
        return None
    boxed = last_boxed(answer)
    if boxed is not None:
        return boxed.strip() or None
    return answer.strip() or None


# Strict reading of the final answer (math_accuracy's default): one stated answer or none.

#: "the answer is", "final answer:", "Answer =", "the answer to the question is" (markdown
#: bold around it allowed).
_ANSWER_PHRASE = re.compile(
    r"\b(?:final\s+answer|answer)\b(?:\s+to\s+[^.\n:=]{1,60}?)?\s*\**\s*(?:is\b|:|=)\s*\**\s*:?",
    re.IGNORECASE,
)
#: A price: one ``$`` (or ``\$``) before a number, ``$18`` or ``\$1,250.50``.
_PRICE = re.compile(r"\\?\$\s*(-?\d[\d,]*(?:\.\d+)?)")
#: The one sentence allowed after a stated answer (math-verify's few-shot prompts end so).
_SIGN_OFF = re.compile(r"I hope it is correct\.?", re.IGNORECASE)
#: Math delimiters that may enclose the whole stated answer.
_DELIMITERS = (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$"))
#: Words that may appear in an expression written without a backslash (``sqrt(2)``, ``2 pi``).
_MATH_WORDS = frozenset(
    "sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log ln exp sqrt pi inf "
    "infty oo".split()
)
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")
_COMMAND = re.compile(r"\\(?:begin|end)\{[A-Za-z*]+\}|\\[A-Za-z]+")
_THOUSANDS = re.compile(r"\d{1,3}(?:,\d{3})+(?!\d)")
#: Two numbers side by side with only spaces between them: a list, not one expression.
_NUMBERS_APART = re.compile(r"\d\s+[-+]?\.?\d")


def single_expression(text: str) -> str | None:
    """``text`` as one math expression (its enclosing ``$...$``, ``\\(...\\)``, ``\\[...\\]``,
    markdown bold and final period removed; a price ``$18`` read as 18), or None when it is not
    one: prose (a word of two or more letters outside LaTeX commands, other than a function name
    such as ``sqrt``; a unit in ``\\text{}`` counts, so box an answer with units), several math
    environments, or several candidates (a comma or semicolon outside brackets that is not a
    thousands separator, numbers side by side).

    ``single_expression("$\\frac{3}{4}$.") == "\\frac{3}{4}"``;
    ``single_expression("14, 18, 19") is None``; ``single_expression("so 14") is None``.
    """
    inner = text.strip().strip("*").strip()
    if inner.endswith("."):
        inner = inner[:-1].rstrip()
    for opening, closing in _DELIMITERS:
        if len(inner) > len(opening) + len(closing) and (
            inner.startswith(opening) and inner.endswith(closing)
        ):
            inner = inner[len(opening) : -len(closing)].strip()
            break
    if inner.endswith("."):
        inner = inner[:-1].rstrip()
    price = _PRICE.fullmatch(inner)
    if price is not None:
        inner = price.group(1)
    if not inner or "$" in inner or "\\(" in inner or "\\[" in inner or "\n" in inner:
        return None
    bare = _COMMAND.sub("#", inner)  # "2 \\cdot 3": a command is not a gap between numbers
    if any(word.lower() not in _MATH_WORDS for word in _WORD.findall(bare)):
        return None
    if _NUMBERS_APART.search(bare):
        return None
    depth = 0
    for char in _THOUSANDS.sub("0", bare):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char in ",;" and depth <= 0:
            return None
    return inner


def stated_answer(answer: str) -> tuple[str, bool] | None:
    """The one final answer an answer region states, as ``(expression, boxed)``; None when it
    states none or several.

    In order: the content of the last ``\\boxed{}`` (``boxed=True``); else the text after the
    last explicit final-answer phrase ("the answer is", "final answer:", "answer:") to the end
    of its line or sentence, when that is a :func:`single_expression` and closes the region
    (only "I hope it is correct." may follow); else the whole region when it is one. The last
    phrase counts ("the answer is 14. No, the answer is 13." states 13); one followed by more
    words ("the answer is 14. Wait, that is wrong.") or by no single expression states none.
    """
    boxed = last_boxed(answer)
    if boxed is not None:
        return (boxed.strip(), True) if boxed.strip() else None
    phrases = list(_ANSWER_PHRASE.finditer(answer))
    if phrases:
        rest = answer[phrases[-1].end() :].lstrip()
        end = re.search(r"\n|\.\s", rest)
        stated, after = (rest, "") if end is None else (rest[: end.start()], rest[end.end() :])
        if after.strip() and not _SIGN_OFF.fullmatch(after.strip()):
            return None  # words after the answer: a retraction, a hedge, a second try
        expression = single_expression(stated)
    else:
        expression = single_expression(answer)
    return None if expression is None else (expression, False)
