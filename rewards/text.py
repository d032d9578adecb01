"""Reading a reasoning completion: the think block, the answer after it, the last ``\\boxed{}``.

A prompt whose chat template already opened the think block (Qwen3 and DeepSeek-R1 templates end
the prompt with ``<think>``) counts as opened: the completion is read as ``<think>`` + completion.
"""

from __future__ import annotations

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
