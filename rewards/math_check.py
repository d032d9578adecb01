"""Checking a math answer against the reference with ``math-verify`` (the checker of open-r1 and
TRL), in bounded time.

math-verify bounds its own parsing and comparison with ``signal.alarm``, which works only in the
main thread (elsewhere it refuses to run). In the main thread its own timeouts are used; in any
other thread (a reward computed in a worker thread) the check runs in a helper process that is
killed when it overruns, and is started afresh for the next check. Either way a check that runs
out of time counts as wrong.
"""

from __future__ import annotations

import multiprocessing
import threading
from multiprocessing.connection import Connection
from typing import Any

_lock = threading.Lock()
_worker: tuple[Any, Connection] | None = None  # (process, connection) of the helper process


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError as err:
        raise ImportError(
            "math_accuracy and cosine_length check answers with math-verify: "
            "pip install math-verify"
        ) from err
    return math_verify


def answer_source(answer: str, boxed: bool, strict: bool = False) -> str:
    """The string math-verify parses for an extracted answer: ``\\boxed{answer}`` when it came
    from a box (so that LaTeX inside is read as LaTeX); else, strict, ``$answer$`` (one
    expression, read as LaTeX), lenient, the answer text itself."""
    if boxed:
        return f"\\boxed{{{answer}}}"
    return f"${answer}$" if strict else answer


def verify_in_process(
    gold: str, answer: str, timeout_seconds: int, strict: bool = False
) -> bool | None:
    """math-verify's verdict ``verify(parse(gold), parse(answer))`` in this (main) thread, each
    step bounded by ``timeout_seconds``; None when the reference itself does not parse.

    Strict, ``answer`` (from :func:`answer_source`) is read by the LaTeX extraction alone
    (``LatexExtractionConfig``: its box or its ``$...$``) without math-verify's fallback to the
    matched string; lenient, by ``parse``'s defaults (LaTeX, then numbers and expressions
    anywhere in plain text).

    The reference parses when math-verify finds an expression in it (not only its fallback
    string); a bare LaTeX reference (``\\frac{1}{2}``, as datasets' ``answer`` columns hold) that
    does not is tried once more as ``$gold$``."""
    mv = _math_verify()
    gold_parsed = mv.parse(gold, parsing_timeout=timeout_seconds)
    if not _has_expression(gold_parsed) and "\\" in gold:
        gold_parsed = mv.parse(f"${gold}$", parsing_timeout=timeout_seconds)
    if not _has_expression(gold_parsed):
        return None
    if strict:
        answer_parsed = mv.parse(
            answer,
            extraction_config=[mv.LatexExtractionConfig()],
            fallback_mode="no_fallback",
            parsing_timeout=timeout_seconds,
        )
    else:
        answer_parsed = mv.parse(answer, parsing_timeout=timeout_seconds)
    return bool(mv.verify(gold_parsed, answer_parsed, timeout_seconds=timeout_seconds))


def _has_expression(parsed: list[Any]) -> bool:
    return any(not isinstance(item, str) for item in parsed)


def _serve(conn: Connection) -> None:
    """The helper process: verify each ``(gold, answer, timeout, strict)`` it receives."""
    while True:
        try:
            gold, answer, timeout_seconds, strict = conn.recv()
        except EOFError:
            return
        conn.send(verify_in_process(gold, answer, timeout_seconds, strict))


def _helper() -> tuple[Any, Connection]:
    global _worker
    if _worker is None or not _worker[0].is_alive():
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(target=_serve, args=(child,), daemon=True)
        process.start()
        child.close()
        _worker = (process, parent)
    return _worker


def _kill_helper() -> None:
    global _worker
    if _worker is not None:
        process, conn = _worker
        process.kill()
        process.join()
        conn.close()
        _worker = None


#: Seconds the helper process may take to start (import sympy) before its first check.
_STARTUP_SECONDS = 60.0


def verify_answer(
    gold: str, answer: str, timeout_seconds: int, strict: bool = False
) -> bool | None:
    """Whether ``answer`` equals ``gold`` by math-verify (``strict``: see
    :func:`verify_in_process`); None when ``gold`` does not parse. A check that exceeds
    ``timeout_seconds`` (per step in the main thread, in all in another) is False."""
    if threading.current_thread() is threading.main_thread():
        return verify_in_process(gold, answer, timeout_seconds, strict)
    with _lock:
        fresh = _worker is None or not _worker[0].is_alive()
        process, conn = _helper()
        conn.send((gold, answer, timeout_seconds, strict))
        # Three timed steps (two parses, one comparison); the first call also imports sympy.
        deadline = 3 * timeout_seconds + 1 + (_STARTUP_SECONDS if fresh else 0.0)
        if conn.poll(deadline):
            verdict: bool | None = conn.recv()
            return verdict
        _kill_helper()
        return False
