"""The sandbox as a boundary: hostile candidates from a sweep of the earlier sandbox, each of which
crashed the trainer, read the answers, reached the host or outlived its run. Each now scores 0 (or
is refused) and leaves nothing behind, in every isolation mode this machine can run.

Parser and judging tests need no sandbox; the rest run real sandboxes (hang guards, not timings).
"""

from __future__ import annotations

import os
import random
import sys

import pytest

from sandbox import parse_tests
from sandbox.plain_data import MAX_SHARED_HASH, Budget, WireError, from_wire, strict_equal
from sandbox.records import RECORD, Records, judge_test, parse_records

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the sandbox needs a POSIX system")

LINUX = sys.platform.startswith("linux")
NONCE = "0123456789abcdef0123456789abcdef"
CHECKS = parse_tests(["assert add(1, 2) == 3", "assert {add(1, 1)} == {2}"])


# --------------------------------------------------------------------------- records and judging


@pytest.mark.parametrize(
    "line",
    [
        f"{NONCE} value --1 0 3",  # int("--1") raised through run_tests
        f"{NONCE} value 0 --0 3",
        f"{NONCE} value -0 0 3",
        f"{NONCE} value 00 0 3",
        f"{NONCE} value +1 0 3",
        f"{NONCE} value 0 0",  # no separator before the text
        f"{NONCE} value 0 0 3\r",
        f"{NONCE} value 0 0 \xe9",
        f"{NONCE} value 1_0 0 3",
        f"{NONCE} value \u0661 0 3",  # an Arabic-Indic digit: str.isdigit() says yes
        f"{NONCE} value 0  0 3",
        f"{NONCE} VALUE 0 0 3",
        f"{NONCE.upper()} value 0 0 3",
        f"{NONCE}0 value 0 0 3",
        f"{NONCE} value 99999999999999999999 0 3",
        f"{NONCE} value 0 0 " + "1" * 70_000,
    ],
)
def test_a_malformed_record_is_counted_as_forged_and_never_raises(line: str) -> None:
    data = (line + "\n").encode("utf-8")
    records = parse_records(data, NONCE, CHECKS)
    assert records.forged == 1 and not records.values and not records.failures


def test_the_record_grammar_accepts_what_the_runner_writes() -> None:
    data = (
        f"{NONCE} start -1 -1 \n{NONCE} value 0 0 3\n{NONCE} fail 1 0 KeyError: 'x'\n"
        f"{NONCE} done -1 -1 \n"
    ).encode()
    records = parse_records(data, NONCE, CHECKS)
    assert records.started and records.done and records.forged == 0
    assert records.values == {(0, 0): "3"} and records.failures == {(1, 0): "KeyError: 'x'"}
    assert RECORD.fullmatch(f"{NONCE} error -1 -1 ".encode()) is not None


def _hostile_line(rng: random.Random) -> bytes:
    pieces = [
        NONCE,
        rng.choice(["value", "fail", "start", "done", "error", "v", ""]),
        rng.choice(["0", "1", "-1", "--1", "-", "", "1e3", "0x1", " 1", "\u0663", "9" * 40]),
        rng.choice(["0", "1", "-1", "--1", "-0", "٣", "9" * 12]),
        rng.choice(['{"set": [1, 1]}', "NaN", "[" * 5000, '{"dict": [[1]]}', "3", "\x00", ""]),
    ]
    line = " ".join(pieces).encode("utf-8", "surrogatepass")
    raw = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
    return rng.choice([line, raw, line + raw, line[: rng.randrange(len(line) + 1)]])


def test_fuzzed_records_never_raise_and_judging_fails_or_passes() -> None:
    rng = random.Random(1234)
    for _ in range(3000):
        lines = [_hostile_line(rng) for _ in range(rng.randrange(1, 6))]
        records = parse_records(b"\n".join(lines) + b"\n", NONCE, CHECKS)
        for test, checks in enumerate(CHECKS):
            outcome = judge_test(test, checks, records)
            assert outcome is None or isinstance(outcome, str)


def _colliding_ints(n: int) -> list[int]:
    """Integers that all share one hash (hash(k * (2**61 - 1)) == 0 on 64-bit CPython)."""
    return [k * (2**61 - 1) for k in range(1, n + 1)]


@pytest.mark.parametrize("tag", ["set", "frozenset"])
def test_values_built_to_collide_in_hash_are_rejected_before_they_are_built(tag: str) -> None:
    ints = _colliding_ints(3000)
    assert len({hash(i) for i in ints}) == 1
    with pytest.raises(WireError, match="share a hash"):
        from_wire('{"%s": [%s]}' % (tag, ",".join(map(str, ints))))
    with pytest.raises(WireError, match="share a hash"):
        from_wire('{"dict": [%s]}' % ",".join(f"[{i}, 0]" for i in ints))
    # A few shared hashes are normal (hash(-1) == hash(-2)): those still decode.
    few = _colliding_ints(MAX_SHARED_HASH) + [-1, -2]
    assert from_wire('{"set": [%s]}' % ",".join(map(str, few))) == set(few)


def test_colliding_values_fail_their_check_with_a_reason() -> None:
    text = '{"set": [%s]}' % ",".join(map(str, _colliding_ints(3000)))
    records = Records(values={(1, 0): text})
    outcome = judge_test(1, CHECKS[1], records)
    assert outcome is not None and "share a hash" in outcome


def test_judging_stops_at_its_cpu_budget() -> None:
    value = [[i, str(i)] for i in range(20_000)]
    with pytest.raises(WireError, match="budget"):
        strict_equal(value, value, Budget(0.0))
    assert strict_equal(value, value, Budget(10.0))
