"""Reading a run back in the trusted process: the capped pipe readers, the runner's records, and
the verdict, each test judged here from the plain values the sandbox returned."""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass, field

from sandbox.limits import SandboxLimits, Status, TestResult
from sandbox.plain_data import Budget, WireError, from_wire
from sandbox.runner import MAX_VALUE_BYTES
from sandbox.tests_spec import Check

LAUNCH_ERROR = b"LAUNCH_ERROR "
_SHOWN_FAILURES = 3
#: CPU seconds the trusted process spends decoding and judging one candidate's values.
JUDGE_BUDGET_S = 1.0
#: One record, as the runner writes it: ``<nonce> <kind> <test> <check> <text>``, the nonce 32
#: lower-case hex digits, each index -1 or a non-negative decimal without leading zeros, the text
#: printable ASCII (the runner writes ``ascii()`` and JSON with ASCII escapes) of bounded length.
RECORD = re.compile(
    rb"([0-9a-f]{32}) (start|value|fail|error|done) (-1|0|[1-9][0-9]{0,8}) (-1|0|[1-9][0-9]{0,8}) "
    rb"([\x20-\x7e]{0,%d})" % MAX_VALUE_BYTES
)
#: Errors that decoding or judging a candidate's value may raise; each fails that check.
JUDGING_ERRORS = (ValueError, TypeError, ArithmeticError, RecursionError)


class Channel:
    """A pipe read into a capped buffer: bytes past ``cap`` are read and dropped (the writer never
    blocks on a full pipe, and the trainer's memory stays bounded)."""

    def __init__(self, fd: int, cap: int) -> None:
        self.fd, self.cap = fd, cap
        self.data = bytearray()
        self.dropped = 0
        self.open = True

    def read(self) -> None:
        chunk = os.read(self.fd, 65536)
        if not chunk:
            self.open = False
            return
        room = self.cap - len(self.data)
        self.data += chunk[: max(room, 0)]
        self.dropped += max(len(chunk) - max(room, 0), 0)

    def drain(self) -> None:
        """Read whatever is left without blocking (after every writer was killed)."""
        os.set_blocking(self.fd, False)
        while self.open:
            try:
                self.read()
            except BlockingIOError:
                return


@dataclass
class Records:
    """The runner's reports, parsed; a line without the nonce is counted, never trusted. Values
    stay in their wire form until judged."""

    launch_error: str | None = None
    started: bool = False
    done: bool = False
    code_error: str | None = None
    values: dict[tuple[int, int], str] = field(default_factory=dict)
    failures: dict[tuple[int, int], str] = field(default_factory=dict)
    repeated: set[tuple[int, int]] = field(default_factory=set)
    forged: int = 0


def parse_records(data: bytes, nonce: str, checks: list[tuple[Check, ...]]) -> Records:
    """The records in ``data``; each check gets one ``value`` or ``fail`` record, and a check
    with more than one (which the runner never writes) is marked as repeated."""
    records = Records()
    lines = data.split(b"\n")[:-1]  # a last line without "\n" is incomplete
    if lines and lines[0].startswith(LAUNCH_ERROR):
        # Only the launcher can write before the runner's "start" record.
        records.launch_error = lines[0][len(LAUNCH_ERROR) :].decode("ascii", "replace")
        return records
    for line in lines:
        match = RECORD.fullmatch(line)
        if match is None or match.group(1).decode() != nonce:
            records.forged += 1
            continue
        kind = match.group(2).decode()
        key = (int(match.group(3)), int(match.group(4)))
        text = match.group(5).decode()
        if kind == "start":
            records.started = True
        elif kind in ("value", "fail"):
            if not (0 <= key[0] < len(checks) and 0 <= key[1] < len(checks[key[0]])):
                records.forged += 1
            elif key in records.values or key in records.failures:
                records.repeated.add(key)
            elif kind == "value":
                records.values[key] = text
            else:
                records.failures[key] = text
        elif kind == "error" and records.code_error is None:
            records.code_error = text
        elif kind == "done":
            records.done = True
    return records


class Unjudgeable(Exception):
    """A value that could not be judged: not plain data, over the judging budget, or one that
    made comparing fail. The runner never writes one: it is a forged record or a value built
    against the judge, and the whole candidate scores 0."""


def judge_test(
    test: int, checks: tuple[Check, ...], records: Records, budget: Budget | None = None
) -> str | None:
    """None when every check of the test holds, else why not ("" when it was not reported).

    Raises:
        Unjudgeable: a value is not plain data, goes over ``budget``, or makes comparing fail;
            the message names the check and the reason.
    """
    budget = Budget(JUDGE_BUDGET_S) if budget is None else budget
    for index, check in enumerate(checks):
        key = (test, index)
        if key in records.repeated:
            return f"{check.source}: more than one record for it (forged)"
        if key in records.failures:
            return records.failures[key]
        if key not in records.values:
            return ""
        try:
            value = from_wire(records.values[key], budget)
        except WireError as exc:
            raise Unjudgeable(f"{check.source}: the value is not plain data ({exc})") from None
        try:
            if check.judge(value, budget):
                continue
            shown = repr(value)
        except JUDGING_ERRORS as exc:  # WireError (over budget) included
            reason = f"{type(exc).__name__}: {exc}"
            raise Unjudgeable(f"{check.source}: judging the value failed ({reason})") from None
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        return f"{check.source}: {check.expression} gave {shown}"
    return None


def signal_name(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def summarize(
    output: Channel,
    results: Channel,
    nonce: str,
    checks: list[tuple[Check, ...]],
    limits: SandboxLimits,
    timed_out: bool,
    returncode: int,
    stray: list[int],
) -> TestResult | str:
    """The run's :class:`TestResult`, or the reason the sandbox could not be set up (a str)."""
    records = parse_records(bytes(results.data), nonce, checks)
    text = output.data.decode("utf-8", "replace")
    if records.launch_error is not None:
        return records.launch_error
    total = len(checks)
    budget = Budget(JUDGE_BUDGET_S)  # one allowance for all of this candidate's values
    unjudgeable = None
    outcomes: list[str | None]
    try:
        outcomes = [judge_test(i, tc, records, budget) for i, tc in enumerate(checks)]
    except Unjudgeable as exc:
        unjudgeable = str(exc)
        outcomes = [unjudgeable] * total
    passed = sum(1 for outcome in outcomes if outcome is None)
    notes = []
    if output.dropped:
        notes.append(
            f"{output.dropped} output bytes past the {limits.max_output_bytes} cap dropped"
        )
    if records.forged:
        notes.append(f"{records.forged} result lines without the nonce, or malformed, ignored")
    if stray:
        notes.append(f"processes {stray} could not be killed")
    status: Status
    if records.code_error is not None:
        status, passed = "error", 0
        detail = f"the code raised before any test ran: {records.code_error}"
    elif unjudgeable is not None:
        status = "ok" if records.done else "timeout" if timed_out else "crashed"
        detail = f"0/{total}: a value could not be judged, so the program scores 0: {unjudgeable}"
    elif records.done:
        status = "ok"
        failures = [
            f"test {i}: {m or 'not reported'}" for i, m in enumerate(outcomes) if m is not None
        ]
        detail = f"{passed}/{total} tests passed" + "".join(
            f"; {f}" for f in failures[:_SHOWN_FAILURES]
        )
    elif timed_out:
        status = "timeout"
        detail = f"wall-clock limit of {limits.timeout_s} s reached; {passed}/{total} tests passed"
    elif not records.started:
        return f"the runner ended before starting ({signal_name(returncode)}): {text[-2000:]}"
    else:
        status = "crashed"
        detail = (
            f"the process ended before reporting every test ({signal_name(returncode)}); "
            f"{passed}/{total} tests passed"
        )
    if notes:
        detail += " (" + "; ".join(notes) + ")"
    return TestResult(passed=passed, total=total, status=status, detail=detail, output=text)
