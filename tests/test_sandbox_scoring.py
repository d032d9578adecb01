"""Scoring that does not trust the candidate: tests are parsed in the trusted process, only plain
data comes back from the sandbox, and a program passes only by returning the expected value.

The hostile programs below each scored a full pass before the comparison moved out of the
sandbox (the always-equal object, the lying subclasses and the nonce forger scored 2/2).
"""

import json
import math
import os
from typing import Any

import pytest

from examples.code_generation import BUNDLED_DATA
from sandbox import ACCEPTED_FORMS, Isolation, SandboxLimits, TestResult, parse_tests, run_tests
from sandbox import run as sandbox_run
from sandbox import score_completions, strict_equal
from sandbox.plain_data import WireError, from_wire
from sandbox.runner import NotPlainData, make_encoder

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the sandbox needs a POSIX system")

# isolation="weak" lets the FALLBACK runs below run (tests/test_sandbox_hostile.py checks that a
# weak isolation is refused without it).
LIMITS = SandboxLimits(timeout_s=3.0, cpu_time_s=3, memory_mb=256, isolation="weak")
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(20, 22) == 42"]
# The weakest layers (no fresh uid, no namespaces): scoring must not depend on the isolation.
FALLBACK = Isolation(False, False, False, False, audit_hook=True)
BOTH_MODES = pytest.mark.parametrize("isolation", [None, FALLBACK], ids=["detected", "fallback"])


def run(code: str, tests: list[str], isolation: Isolation | None = None) -> TestResult:
    result = run_tests(code, tests, LIMITS, isolation)
    assert result.status in ("ok", "crashed"), result.detail
    return result


# --------------------------------------------------------------------------- hostile programs


@BOTH_MODES
def test_an_always_equal_object_scores_zero(isolation: Isolation | None) -> None:
    code = "class A:\n    __eq__ = lambda s, o: True\ndef add(a, b):\n    return A()\n"
    result = run(code, ADD_TESTS, isolation)
    assert (result.status, result.passed) == ("ok", 0)
    assert "a value of type A is not plain data" in result.detail


@pytest.mark.parametrize("base, value", [("int", "3"), ("str", "'3'"), ("list", "[3]")])
def test_subclasses_of_built_in_types_with_a_lying_eq_score_zero(base: str, value: str) -> None:
    code = (
        f"class Liar({base}):\n    def __eq__(self, other):\n        return True\n"
        "    __hash__ = None\n"
        f"def add(a, b):\n    return Liar({value})\n"
    )
    result = run(code, [*ADD_TESTS, "assert add(1, 2) is True", "assert not add(1, 2)"])
    assert (result.status, result.passed) == ("ok", 0), result.detail
    assert "a value of type Liar is not plain data" in result.detail


# The runner's frame holds the nonce and the result fd: a candidate that walks up its stack
# finds them and writes records of its own, then exits before the runner can write any.
FORGER = """
import os, sys
GUESS = {guess!r}

def add(a, b):
    frame = sys._getframe()
    while "nonce" not in frame.f_locals:
        frame = frame.f_back
    nonce, fd = frame.f_locals["nonce"], frame.f_locals["fd"]
    print("found the nonce", flush=True)
    for test in range(2):
        os.write(fd, f"{{nonce}} value {{test}} 0 {{GUESS}}\\n".encode())
    os.write(fd, f"{{nonce}} done -1 -1 \\n".encode())
    os._exit(0)
"""


@BOTH_MODES
def test_a_forger_that_found_the_nonce_passes_only_what_it_guessed(
    isolation: Isolation | None,
) -> None:
    wrong = run(FORGER.format(guess="7"), ADD_TESTS, isolation)
    assert "found the nonce" in wrong.output
    assert (wrong.status, wrong.passed) == ("ok", 0), wrong.detail
    assert "add(1, 2) gave 7" in wrong.detail
    # The control: the forged records are read (this forger "knows" the first answer).
    right_once = run(FORGER.format(guess="3"), ADD_TESTS, isolation)
    assert (right_once.status, right_once.passed) == ("ok", 1), right_once.detail


def test_forged_records_of_anything_but_plain_data_are_rejected() -> None:
    for forged in ('{"eq": "always"}', "NaN", "Infinity", '{"set": [[1]]}', "[1, 2", '"\\x"'):
        code = FORGER.format(guess=forged)
        result = run(code, ["assert add(1, 2) == 3", "assert add(1, 2) != 3"])
        assert result.passed == 0, (forged, result.detail)
        assert "the value is not plain data" in result.detail


def test_a_record_forged_next_to_the_runners_own_fails_the_check() -> None:
    # The right answer, forged before the runner reports its own (wrong) value: two records.
    code = """
import os, sys

def add(a, b):
    frame = sys._getframe()
    while "nonce" not in frame.f_locals:
        frame = frame.f_back
    os.write(frame.f_locals["fd"], f"{frame.f_locals['nonce']} value 0 0 3\\n".encode())
    return 0
"""
    result = run(code, ["assert add(1, 2) == 3"])
    assert (result.status, result.passed) == ("ok", 0), result.detail
    assert "more than one record" in result.detail


@BOTH_MODES
def test_replacing_the_encoder_and_json_changes_nothing_it_does_not_know(
    isolation: Isolation | None,
) -> None:
    # Patches json, and rewrites every record the runner writes (through the `write` the runner
    # bound at start, reached via gc) to carry the value 3: the runner's channel is the
    # candidate's, and still only the right value passes.
    code = """
import gc, json, json.encoder, os, re
json.dumps = lambda *args, **kwargs: "3"
json.encoder.encode_basestring_ascii = lambda s: '"3"'
real_write = os.write
def rewrite(fd, data):
    return real_write(fd, re.sub(rb" (value|fail) (\\d+) (\\d+) .*", rb" value \\2 \\3 3", data))
for f in gc.get_objects():
    if type(f).__name__ == "function" and f.__name__ == "report" and f.__closure__:
        for name, cell in zip(f.__code__.co_freevars, f.__closure__):
            if name == "write":
                cell.cell_contents = rewrite
                print("rewired", flush=True)
def add(a, b):
    return object()
"""
    result = run(code, [*ADD_TESTS, "assert add(0, 0) == 'x'"], isolation)
    assert "rewired" in result.output
    assert (result.status, result.passed) == ("ok", 1), result.detail
    assert "test 1: assert add(20, 22) == 42: add(20, 22) gave 3" in result.detail


def test_expected_values_never_reach_the_sandbox() -> None:
    # The candidate dumps everything the runner holds: the expressions, never the answers.
    code = """
import gc, sys
for obj in gc.get_objects():
    if type(obj) is dict and "tests" in obj and "nonce" in obj:
        print(repr(obj), flush=True)
frame = sys._getframe()
while frame is not None:
    print(repr(frame.f_locals)[:10000], flush=True)
    frame = frame.f_back
def add(a, b):
    return a + b
"""
    tests = ["assert add(1000003, 2) == 1000005", "assert add('x', 'y') in ['xyz', 'abc']"]
    result = run(code, tests)
    assert result.passed == 1
    assert "add(1000003, 2)" in result.output  # the dump worked
    assert "1000005" not in result.output and "xyz" not in result.output


# --------------------------------------------------------------------------- honest programs


def test_an_honest_solution_passes_every_accepted_form() -> None:
    code = (
        "import math\n"
        "def add(a, b):\n    return a + b\n"
        "def stats(xs):\n    return {'n': len(xs), 'mean': sum(xs) / len(xs), 'set': set(xs)}\n"
        "def pair(x):\n    return (x, -x)\n"
        "def nothing():\n    return None\n"
        "def weird():\n    return [float('nan'), float('inf'), -math.inf, 10**30, 'é\\n']\n"
    )
    tests = [
        "assert add(1, 2) == 3",
        "assert 3 == add(1, 2)",
        "assert add(0.1, 0.2) != 0.3",
        "assert abs(add(0.1, 0.2) - 0.3) < 1e-9",
        "assert abs(0.3 - add(0.1, 0.2)) <= 1e-9",
        "import math\nassert math.isclose(add(0.1, 0.2), 0.3, rel_tol=1e-9)",
        "assert add(2, 2) == 4.0",
        "assert add(-1, -2) < -2",
        "assert 10 <= add(5, 5)",
        "assert add('a', 'b') == 'ab'",
        "assert add('a', 'b') in 'xaby'",
        "assert add(1, 1) in [1, 2, 3]",
        "assert add(1, 1) not in {1, 3}",
        "assert add([1], [2]) == [1, 2]",
        "assert pair(2) == (2, -2)",
        "assert stats([1, 2, 2]) == {'n': 3, 'mean': 5 / 3, 'set': {1, 2}}",
        "assert stats([1])['set'] == frozenset([1])",
        "assert nothing() is None",
        "assert pair(1) is not None",
        "assert add(True, False) == 1",  # True + False is the int 1
        "assert isinstance(add(1, 1), int)",
        "assert not isinstance(add(1, 1), str)",
        "assert weird() == [float('nan'), math.inf, -float('inf'), 10**30, 'é\\n']",
        "assert math.isnan(weird()[0])",
        "xs = [3, 4]\nassert add(*xs) == 7",
    ]
    result = run(code, tests)
    assert (result.status, result.passed, result.total) == (
        "ok",
        len(tests),
        len(tests),
    ), result.detail


def test_types_are_compared_strictly() -> None:
    code = (
        "def one():\n    return 1\n"
        "def yes():\n    return True\n"
        "def items():\n    return [1, 2]\n"
        "def nan():\n    return float('nan')\n"
        "def huge():\n    return 10**5000\n"
    )
    failing = [
        "assert one() is True",  # 1 is not True
        "assert one()",  # truthy is not True
        "assert yes() == 1",  # a bool is not a number
        "assert items() == (1, 2)",  # a list is not a tuple
        "assert nan() == 0.0",
        "assert abs(nan() - 1.0) < 10",
        "assert nan() < 1",
        "assert huge() > 0",  # too many digits to report: fails, cleanly
    ]
    result = run(code, failing)
    assert (result.status, result.passed) == ("ok", 0), result.detail
    passing = [
        "assert one() == 1.0",
        "assert nan() == float('nan')",
        "assert [nan()] == [math.nan]",
    ]
    assert run(code, passing).passed == 3


def test_every_bundled_test_parses() -> None:
    # That their solutions pass is tests/test_examples.py::test_bundled_code_solutions_pass_every_test.
    records = [json.loads(line) for line in BUNDLED_DATA.read_text().splitlines() if line]
    parsed = [parse_tests(record["tests"]) for record in records]
    assert sum(len(tests) for tests in parsed) == sum(len(r["tests"]) for r in records) > 0


# --------------------------------------------------------------------------- parsing


def test_each_form_becomes_an_expression_and_an_expected_value() -> None:
    forms: dict[str, tuple[str, str, Any, tuple[float, ...]]] = {
        "assert f(1) == 3": ("f(1)", "==", 3, ()),
        "assert -3 == f(1)": ("f(1)", "==", -3, ()),
        "assert f(1) is True": ("f(1)", "==", True, ()),
        "assert f(1) is not None": ("f(1)", "!=", None, ()),
        "assert f(1)": ("f(1)", "==", True, ()),
        "assert not f(1)": ("f(1)", "==", False, ()),
        "assert f(1) > 2**31 - 1": ("f(1)", ">", 2**31 - 1, ()),
        "assert 0 < f(1)": ("f(1)", ">", 0, ()),
        "assert f(1) in {'a': 1}": ("f(1)", "in", ["a"], ()),
        "assert f(1) == set()": ("f(1)", "==", set(), ()),
        "assert f(1) == tuple([1, (2, 3)])": ("f(1)", "==", (1, (2, 3)), ()),
        "assert f(1) == {'k': [1.5, None, -2e3]}": ("f(1)", "==", {"k": [1.5, None, -2e3]}, ()),
        "assert abs(f(1) - 0.5) < 1e-6": ("f(1)", "abs<", 0.5, (1e-6,)),
        "assert abs(0.5 - f(1)) <= 0.1": ("f(1)", "abs<=", 0.5, (0.1,)),
        "assert math.isclose(f(1), 2.0, abs_tol=0.01)": ("f(1)", "isclose", 2.0, (1e-9, 0.01)),
        "assert f(1) == 4, 'a message'": ("f(1)", "==", 4, ()),
        "assert f(x=[1, 2])[0] == 'a'": ("f(x=[1, 2])[0]", "==", "a", ()),
    }
    for source, (expression, op, expected, tolerance) in forms.items():
        (check,) = parse_tests([source])[0]
        assert (check.setup, check.expression, check.op, check.tolerance) == (
            "",
            expression,
            op,
            tolerance,
        ), source
        assert strict_equal(check.expected, expected), source
    (check,) = parse_tests(["assert f(1) == float('-inf')"])[0]
    assert check.expected == -math.inf
    (check,) = parse_tests(["assert f(1) == math.nan"])[0]
    assert math.isnan(check.expected)


def test_setup_statements_and_humaneval_checks_are_unrolled() -> None:
    first, second = parse_tests(["import math\nxs = [1, 2]\nassert f(xs) == 3\nassert f([]) == 0"])[
        0
    ]
    assert (first.setup, first.expression, second.setup) == (
        "import math\nxs = [1, 2]",
        "f(xs)",
        "",
    )
    humaneval = (
        "METADATA = {}\n\ndef check(candidate):\n    assert candidate(1) == 2\n"
        "    assert True\n    assert abs(candidate(0.5) - 1.5) < 1e-6\n\ncheck(inc)"
    )
    checks = parse_tests([humaneval])[0]
    assert [(c.setup, c.expression, c.op) for c in checks] == [
        ("METADATA = {}", "inc(1)", "=="),
        ("", "inc(0.5)", "abs<"),
    ]


@pytest.mark.parametrize(
    "test, reason",
    [
        ("print(f(1))", "no assert"),
        ("assert f(1) == g(2)", "must be a literal"),
        ("assert f(1) == expected", "must be a literal"),
        ("assert f(1) > g(1)", "must be a literal"),
        ("assert 1 < f(1) < 3", "chained"),
        ("assert all(f(x) == x for x in [1, 2])", "compares inside"),
        ("assert f(1 == 1) == 2", "compares inside"),
        ("for x in range(3):\n    assert f(x) == x", "assert inside a block"),
        ("def check(c):\n    assert c(1) == 2\ncheck(f, 1)", "assert inside a block"),
        ("assert f(1) == 2\nprint('done')", "after the last assert"),
        ("assert True", "no assert that checks"),
        ("assert 1 == 1", "constant"),
        ("assert f(1) is 3", "'is' compares with True, False or None"),
        ("assert f(1) is 1", "'is' compares with True, False or None"),
        ("assert f(1) == b'x'", "must be a literal"),
        ("assert f(1) == 1j", "must be a literal"),
        ("assert 3 in f(1)", "'LITERAL in EXPR'"),
        ("assert f(1) in 3", "'in' needs"),
        ("assert f(1) == 10**100000", "must be a literal"),
        ("assert f(1) == " + repr(list(range(10_000))), "larger than"),
        ("assert abs(f(1) - 2) < eps", "tolerance must be a number"),
        ("assert f(1) == 2 if x else 3", "compares inside"),
    ],
)
def test_unsupported_forms_raise_before_any_sandbox_runs(
    test: str, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_run(*args: object) -> None:
        raise AssertionError("a sandbox ran before the tests were checked")

    monkeypatch.setattr(sandbox_run, "_run_once", no_run)
    with pytest.raises(ValueError) as error:
        score_completions(
            ["def f(x): return x"] * 2, [["assert f(1) == 1"], ["assert f(2) == 2", test]]
        )
    message = str(error.value)
    assert message.startswith(f"tests[1] {test!r}: "), message
    assert reason in message and ACCEPTED_FORMS in message


# --------------------------------------------------------------------------- plain data


def test_the_wire_format_round_trips_plain_data_exactly() -> None:
    encode = make_encoder()
    values: list[Any] = [
        None,
        True,
        0,
        -(10**40),
        1.5,
        -0.0,
        1e308,
        float("inf"),
        -math.inf,
        "",
        'é"\\\n\x00\ud800',
        [],
        [1, [2, (3,)]],
        (),
        {"a": 1, 2: [None], (1, "x"): {frozenset({1}): True}},
        {1, 2.5, "x", (1, 2)},
        frozenset(),
    ]
    for value in values:
        decoded = from_wire(encode(value))
        assert typed(decoded) == typed(value), value
    assert math.isnan(from_wire(encode(float("nan"))))


def typed(x: Any) -> Any:
    """``x`` with every type spelled out (a frozenset reads as a set, which it equals)."""
    if isinstance(x, (set, frozenset)):
        return ("set", sorted(repr(typed(item)) for item in x))
    if isinstance(x, dict):
        return ("dict", [(typed(k), typed(v)) for k, v in x.items()])
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [typed(item) for item in x])
    return (type(x).__name__, repr(x))


def test_the_encoder_writes_exact_built_in_types_only() -> None:
    encode = make_encoder(max_bytes=1000)

    class Int(int):
        pass

    class Always:
        def __eq__(self, other: object) -> bool:
            return True

    deep: list[Any] = []
    for _ in range(100):
        deep = [deep]
    looped: list[Any] = []
    looped.append(looped)
    for value in [
        Int(3),
        Always(),
        [1, Always()],
        {"k": Int(1)},
        b"x",
        1j,
        deep,
        looped,
        "x" * 1001,
    ]:
        with pytest.raises((NotPlainData, RecursionError)):
            encode(value)
    with pytest.raises(NotPlainData, match="larger than 1000"):
        encode(list(range(1000)))


def test_the_decoder_builds_plain_data_or_raises() -> None:
    for text in [
        "NaN",
        "[Infinity]",
        '{"eq": 1}',
        '{"tuple": [1], "set": []}',
        '{"tuple": 1}',
        '{"set": [[1]]}',
        '{"set": [1, 1.0]}',
        '{"dict": [[1, 2], [1, 3]]}',
        '{"dict": [[[1], 2]]}',
        '{"dict": [1]}',
        '{"float": "1.5"}',
        "[" * 100_000 + "]" * 100_000,
        "1" * 5000,
        "",
        "1 2",
    ]:
        with pytest.raises(WireError):
            from_wire(text)


def test_strict_equality() -> None:
    equal = [
        (1, 1.0),
        ([1, (2,)], [1.0, (2,)]),
        ({1, 2}, frozenset({2, 1})),
        ({"a": 1}, {"a": 1.0}),
    ]
    equal += [(float("nan"), float("nan")), ([math.nan], [float("nan")]), (None, None)]
    unequal: list[tuple[Any, Any]] = [
        (True, 1),
        (False, 0),
        (0, None),
        ([1], (1,)),
        ("1", 1),
        ({1: "a"}, {True: "a"}),
    ]
    unequal += [({"a": 1}, {"a": 1, "b": 2}), ([], set()), (1, 1.5), (math.inf, -math.inf)]
    assert all(strict_equal(a, b) and strict_equal(b, a) for a, b in equal)
    assert not any(strict_equal(a, b) or strict_equal(b, a) for a, b in unequal)
