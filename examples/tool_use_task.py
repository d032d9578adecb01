"""The task side of the tool-use example (``python -m examples.tool_use``): arithmetic the tiny
model cannot do in its head, a ``calculator`` tool that can, the reward, and demonstrations for
the SFT warm-up.

* :func:`problems`: every question ``a * b`` with a 2-digit ``a`` and a 1-digit ``b`` (2-9),
  results of 2-3 digits (few to copy), shuffled by the seed; records
  ``{"prompt": [user message], "answer": "<integer>"}``, a held-out part kept apart (products
  the model never saw: beyond what it can compute).
* :func:`calculator`: the tool (type hints and a Google docstring: TRL's contract), an
  arithmetic evaluator over integers that runs nothing but arithmetic; its result echoes the
  expression, ``"37 * 8 = 296"``, the line the model's answer copies.
* :func:`answer_reward`: 1.0 when the final assistant turn (after the last tool result) gives
  the right integer, else 0.0; a TRL-style reward ``(completions, answer, **kwargs)``.
* :func:`demonstrations`: SFT conversations in the chat format: :func:`demonstration` (the
  user's question, the assistant's ``<tool_call>`` (Hermes/Qwen format), the tool's result, the
  answer) or :func:`direct_answer` (the answer without the tool); with the tools' schemas under
  ``"tools"`` (TRL's SFT column), so the warm-up sees the prompt the rollouts see.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

#: Problems kept apart from training (evaluated only).
HELD_OUT = 40
#: Problems in all (training + held out): every 2-digit times 1-digit product.
NUM_PROBLEMS = 90 * 8
_MAX_DIGITS = 60  # longest integer the calculator returns (no 10**10**10)

_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        result = int(_OPERATORS[type(node.op)](left, right))
        if len(str(abs(result))) > _MAX_DIGITS:
            raise ValueError(f"the result has more than {_MAX_DIGITS} digits")
        return result
    raise ValueError(
        "only integers, parentheses and the operators + - * // % are allowed, got "
        f"{ast.dump(node)[:60]}"
    )


def evaluate_arithmetic(expression: str) -> int:
    """The value of an integer arithmetic expression (integers, parentheses, ``+ - * // %``),
    computed on its syntax tree: nothing but arithmetic runs.

    Raises:
        ValueError: anything else (names, calls, powers, floats), a division by zero, or a
            result of more than 60 digits.
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _evaluate(tree)


def calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression exactly; the answer echoes the expression.

    Args:
        expression: The expression, with integers, parentheses and + - * // %, e.g. "4821 * 397".
    """
    return f"{' '.join(expression.split())} = {evaluate_arithmetic(expression)}"


def problems(seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(training, held_out)`` prompt records ``{"prompt": [{"role": "user", ...}], "answer"}``:
    every question ``a * b`` with a 2-digit ``a`` and a 1-digit ``b`` from 2 to 9
    (:data:`NUM_PROBLEMS`), shuffled by ``seed``; the last :data:`HELD_OUT` are held out."""
    pairs = [(a, b) for a in range(10, 100) for b in range(2, 10)]
    random.Random(seed).shuffle(pairs)
    records = [
        {"prompt": [{"role": "user", "content": f"What is {a} * {b}?"}], "answer": str(a * b)}
        for a, b in pairs
    ]
    return records[:-HELD_OUT], records[-HELD_OUT:]


def expression_of(record: Mapping[str, Any]) -> str:
    """The arithmetic of a problem record (``"82 * 18"``)."""
    question = str(record["prompt"][-1]["content"])
    return question.removeprefix("What is ").removesuffix("?")


_FINAL_TURN_MARKERS = ("</tool_response>", "</tool_call>")
_INTEGER = re.compile(r"-?\d[\d,]*")


def final_turn(completion: str | Sequence[Mapping[str, Any]]) -> str:
    """The model's last turn: the last assistant message of a conversation, or, in a text
    transcript, what follows the last tool result or tool call (nothing when the episode ended
    on a call)."""
    if not isinstance(completion, str):
        turns = [m for m in completion if m.get("role") == "assistant"]
        return str(turns[-1].get("content") or "") if turns else ""
    cut = max(completion.rfind(m) + len(m) if m in completion else 0 for m in _FINAL_TURN_MARKERS)
    return completion[cut:]


def final_answer(completion: str | Sequence[Mapping[str, Any]]) -> int | None:
    """The last integer of the model's last turn (thousands separators allowed), or None."""
    found = _INTEGER.findall(final_turn(completion))
    return int(found[-1].replace(",", "")) if found else None


def answer_reward(
    completions: Sequence[str | Sequence[Mapping[str, Any]]],
    answer: Sequence[str],
    **kwargs: Any,
) -> list[float]:
    """1.0 where the final answer (:func:`final_answer`) equals the record's ``answer``, else
    0.0: the task's correctness, whatever the tool calls were."""
    if len(completions) != len(answer):
        raise ValueError(f"{len(completions)} completions but {len(answer)} answers")
    return [
        1.0 if final_answer(c) == int(a) else 0.0 for c, a in zip(completions, answer, strict=True)
    ]


def tool_call_text(expression: str) -> str:
    """The assistant turn that calls the calculator, as Qwen's template writes a call."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def demonstration(record: Mapping[str, Any]) -> dict[str, Any]:
    """One SFT conversation solving ``record`` with the calculator, plus the tools' schemas."""
    from agents.tools import make_tools

    expression = expression_of(record)
    result = calculator(expression)
    messages = [
        *[dict(m) for m in record["prompt"]],
        {"role": "assistant", "content": tool_call_text(expression)},
        {"role": "tool", "name": "calculator", "content": result},
        {"role": "assistant", "content": f"{result}."},
    ]
    return {"messages": messages, "tools": [t.schema for t in make_tools([calculator])]}


def direct_answer(record: Mapping[str, Any]) -> dict[str, Any]:
    """One SFT conversation answering ``record`` without the calculator (the right answer,
    stated), plus the tools' schemas: what a model that does not rely on the tool writes."""
    from agents.tools import make_tools

    messages = [
        *[dict(m) for m in record["prompt"]],
        {"role": "assistant", "content": f"{expression_of(record)} = {record['answer']}."},
    ]
    return {"messages": messages, "tools": [t.schema for t in make_tools([calculator])]}


def demonstrations(
    records: Sequence[Mapping[str, Any]], n: int, call_share: float = 1.0
) -> list[dict[str, Any]]:
    """SFT conversations for the first ``n`` records: a share ``call_share`` of them, spread
    evenly, :func:`demonstration` (the calculator), the others :func:`direct_answer`."""
    return [
        demonstration(r) if int((i + 1) * call_share) > int(i * call_share) else direct_answer(r)
        for i, r in enumerate(records[:n])
    ]
