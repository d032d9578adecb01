"""Unit tests as the trusted process reads them: each test is parsed (``ast``) into checks, each
check into an expression the sandbox evaluates and an expected value that never leaves this
process; the sandbox's answers are decoded strictly and compared here.

Accepted forms (``EXPR`` is any expression without a comparison in it; ``LITERAL`` a Python
literal: numbers (negative too), strings, True/False/None, and lists, tuples, dicts and sets of
them, plus ``set(...)``, ``frozenset(...)``, ``tuple(...)``, ``list(...)`` of a literal and
``float("nan")``, ``float("inf")``, ``math.inf``, ``math.nan``)::

    assert EXPR == LITERAL          (or LITERAL == EXPR; likewise !=)
    assert EXPR < LITERAL           (<=, >, >=: numbers with numbers, strings with strings)
    assert EXPR in LITERAL          (not in; a list, tuple, set or dict's keys; a str: substring)
    assert EXPR is True             (is False, is None, is not None, ...)
    assert EXPR                     (EXPR must be exactly True)
    assert not EXPR                 (EXPR must be exactly False)
    assert abs(EXPR - LITERAL) < TOL        (or <=, or abs(LITERAL - EXPR); numbers)
    assert math.isclose(EXPR, LITERAL, rel_tol=..., abs_tol=...)

A test may hold several such asserts (all must hold) and statements before them, which run in the
sandbox first (``import math``, ``data = [...]``); statements may not contain ``assert``, since
their outcome would be decided in the candidate's interpreter. HumanEval's form, ``def
check(candidate): <asserts>`` followed by ``check(f)``, is unrolled into its asserts with
``candidate`` read as ``f``. Anything else raises ValueError, before any sandbox runs.

Values compare by type and value (:func:`sandbox.plain_data.strict_equal`: ``1 == 1.0``, but
``True != 1``, ``[1] != (1,)``, NaN equals NaN). ``assert EXPR`` needs exactly ``True`` and
``assert not EXPR`` exactly ``False`` (not a truthy 1, a non-empty list, 0 or None).
"""

from __future__ import annotations

import ast
import copy
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

from sandbox.plain_data import Budget, canonical, is_number, strict_equal
from sandbox.runner import MAX_VALUE_BYTES, NotPlainData, make_encoder

ACCEPTED_FORMS = (
    "assert EXPR == LITERAL (or !=, <, <=, >, >=, in, not in), assert EXPR is True / False / "
    "None (or is not), assert EXPR, assert not EXPR, assert abs(EXPR - LITERAL) < TOL (or <=), "
    "assert math.isclose(EXPR, LITERAL, ...); EXPR may not contain a comparison, LITERAL is a "
    "Python literal, and statements before an assert may not contain assert"
)
#: Largest expected value, encoded: leaves room for an honest answer's own encoding.
MAX_EXPECTED_BYTES = MAX_VALUE_BYTES // 4

_ORDER: dict[str, Callable[[Any, Any], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}
# LITERAL < EXPR is EXPR > LITERAL
_MIRROR: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.Gt,
    ast.LtE: ast.GtE,
    ast.Gt: ast.Lt,
    ast.GtE: ast.LtE,
}


@dataclass(frozen=True)
class Check:
    """One assert of a test.

    Attributes:
        setup: statements the sandbox runs before evaluating ``expression`` ("" for none).
        expression: evaluated in the sandbox; its value returns as plain data.
        op: how the value is judged: ``"=="``, ``"!="``, ``"<"``, ``"<="``, ``">"``, ``">="``,
            ``"in"``, ``"not in"``, ``"abs<"``, ``"abs<="`` (``abs(value - expected)`` against
            ``tolerance``) or ``"isclose"``.
        expected: the value compared with; never sent to the sandbox.
        tolerance: ``(tol,)`` for ``abs<``/``abs<=``; ``(rel_tol, abs_tol)`` for ``isclose``.
        source: the assert as written, for messages.
    """

    setup: str
    expression: str
    op: str
    expected: Any
    tolerance: tuple[float, ...] = ()
    source: str = ""

    def judge(self, value: Any, budget: Budget | None = None) -> bool:
        """True when the (decoded, plain) ``value`` satisfies the check.

        Raises:
            WireError: comparing went over ``budget`` (see :class:`sandbox.plain_data.Budget`).
        """
        op, expected = self.op, self.expected
        if op == "==":
            return strict_equal(value, expected, budget)
        if op == "!=":
            return not strict_equal(value, expected, budget)
        if op in ("in", "not in"):
            if isinstance(expected, str):
                found = type(value) is str and value in expected
            else:
                key = canonical(value, budget)  # once, not once per item
                found = any(key == canonical(item) for item in expected)
            return found == (op == "in")
        if op in ("<", "<=", ">", ">="):
            both_numbers = is_number(value) and is_number(expected)
            if not (both_numbers or (type(value) is str and type(expected) is str)):
                return False
            return _ORDER[op](value, expected)
        if not is_number(value):
            return False
        try:
            if op == "isclose":
                rel_tol, abs_tol = self.tolerance
                return math.isclose(value, expected, rel_tol=rel_tol, abs_tol=abs_tol)
            difference = abs(value - expected)
        except OverflowError:  # an integer too large for a float is not close to anything
            return False
        return difference < self.tolerance[0] if op == "abs<" else difference <= self.tolerance[0]


# --------------------------------------------------------------------------- parsing


def parse_tests(tests: list[str] | tuple[str, ...]) -> list[tuple[Check, ...]]:
    """Each test's checks, in order.

    Raises:
        ValueError: a test does not compile, or is not made of the accepted forms; the message
            names the test and lists the forms.
    """
    return [parse_test(test, i) for i, test in enumerate(tests)]


def parse_test(test: str, index: int = 0) -> tuple[Check, ...]:
    """The checks of one test (see :func:`parse_tests`)."""
    if not isinstance(test, str):
        raise ValueError(f"tests[{index}] must be a str, got {type(test).__name__}")
    try:
        module = ast.parse(test, f"<test {index}>")
    except SyntaxError as exc:
        raise ValueError(f"tests[{index}] does not compile ({exc}): fix the test {test!r}") from exc
    try:
        return _checks(_unroll_humaneval(module.body))
    except _Unsupported as exc:
        raise ValueError(
            f"tests[{index}] {test!r}: {exc}. The sandbox compares results outside the "
            f"candidate's process, so a test must be made of: {ACCEPTED_FORMS}"
        ) from None


class _Unsupported(Exception):
    pass


def _unroll_humaneval(body: list[ast.stmt]) -> list[ast.stmt]:
    """``def check(candidate): ...`` then ``check(f)`` -> the body, ``candidate`` read as ``f``."""
    last = body[-1] if body else None
    if not (
        isinstance(last, ast.Expr)
        and isinstance(last.value, ast.Call)
        and isinstance(last.value.func, ast.Name)
        and len(last.value.args) == 1
        and isinstance(last.value.args[0], ast.Name)
        and not last.value.keywords
    ):
        return body
    name, target = last.value.func.id, last.value.args[0].id
    defs = [s for s in body if isinstance(s, ast.FunctionDef) and s.name == name]
    if len(defs) != 1 or len(defs[0].args.args) != 1 or defs[0].decorator_list:
        return body
    parameter = defs[0].args.args[0].arg

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.Name:
            return ast.Name(target, node.ctx) if node.id == parameter else node

    inlined = [Rename().visit(copy.deepcopy(s)) for s in defs[0].body]
    return [s for s in body[:-1] if s is not defs[0]] + inlined


def _checks(body: list[ast.stmt]) -> tuple[Check, ...]:
    checks = []
    setup: list[ast.stmt] = []
    for statement in body:
        if not isinstance(statement, ast.Assert):
            if any(isinstance(node, ast.Assert) for node in ast.walk(statement)):
                raise _Unsupported(
                    "an assert inside a block or function would run in the sandbox, where its "
                    "outcome cannot be trusted; write each check as a top-level assert"
                )
            setup.append(statement)
            continue
        if isinstance(statement.test, ast.Constant):
            if statement.test.value is True:
                continue  # HumanEval's `assert True` checks nothing; skipping it changes nothing
            raise _Unsupported(f"'{ast.unparse(statement)}' checks nothing from the code")
        check = _check(statement.test)
        source = ast.unparse(statement)
        setup_source = ast.unparse(ast.Module(setup, [])) if setup else ""
        checks.append(Check(setup_source, *check, source=source))
        setup = []
    if setup and checks:
        raise _Unsupported("statements after the last assert would check nothing")
    if not checks:
        raise _Unsupported("it has no assert that checks the code")
    return tuple(checks)


def _check(test: ast.expr) -> tuple[str, str, Any, tuple[float, ...]]:
    """(expression, op, expected, tolerance) of an assert's test."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _expression(test.operand), "==", False, ()
    if isinstance(test, ast.Call) and _is_isclose(test.func):
        return _isclose(test)
    if not isinstance(test, ast.Compare):
        return _expression(test), "==", True, ()
    if len(test.ops) != 1:
        raise _Unsupported("chained comparisons are not supported; write one assert per bound")
    op, left, right = test.ops[0], test.left, test.comparators[0]
    if isinstance(op, (ast.Is, ast.IsNot)):
        # by identity: `1 in (True, False, None)` holds, since 1 == True
        if not (
            isinstance(right, ast.Constant) and any(right.value is v for v in (True, False, None))
        ):
            raise _Unsupported("'is' compares with True, False or None only")
        return _expression(left), "==" if isinstance(op, ast.Is) else "!=", right.value, ()
    if isinstance(op, (ast.Lt, ast.LtE)) and _is_abs_difference(left):
        expression, target = _abs_difference(left)
        tolerance = _number(right, "the tolerance")
        return expression, "abs<" if isinstance(op, ast.Lt) else "abs<=", target, (tolerance,)
    symbols: dict[type[ast.cmpop], str] = {ast.Eq: "==", ast.NotEq: "!=", ast.In: "in"}
    symbols.update({ast.NotIn: "not in", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="})
    if type(op) not in symbols:
        raise _Unsupported(f"the comparison {type(op).__name__} is not supported")
    expected = _try_literal(right)
    if expected is not _NOT_LITERAL:
        node, kind = left, type(op)
    else:
        expected = _try_literal(left)
        if expected is _NOT_LITERAL:
            raise _Unsupported("one side of the comparison must be a literal (the expected value)")
        if isinstance(op, (ast.In, ast.NotIn)):
            raise _Unsupported("'LITERAL in EXPR' is not supported; write 'EXPR in LITERAL'")
        node, kind = right, _MIRROR.get(type(op), type(op))
    if kind in (ast.In, ast.NotIn):
        if not isinstance(expected, (list, tuple, set, frozenset, dict, str)):
            raise _Unsupported("'in' needs a list, tuple, set, dict or str literal")
        expected = list(expected) if isinstance(expected, dict) else expected
    return _expression(node), symbols[kind], expected, ()


def _expression(node: ast.expr) -> str:
    """The source the sandbox evaluates; it holds no comparison (which the candidate's objects
    would decide, and whose other side it would see)."""
    if any(isinstance(n, ast.Compare) for n in ast.walk(node)):
        raise _Unsupported(
            f"'{ast.unparse(node)}' compares inside the expression the sandbox evaluates; compare "
            "its result in the assert instead"
        )
    if _try_literal(node) is not _NOT_LITERAL:
        raise _Unsupported(f"'{ast.unparse(node)}' is a constant: it checks nothing from the code")
    return ast.unparse(node)


def _is_isclose(func: ast.expr) -> bool:
    """``math.isclose`` or ``isclose`` (``from math import isclose``)."""
    if isinstance(func, ast.Attribute):
        return (
            func.attr == "isclose" and isinstance(func.value, ast.Name) and func.value.id == "math"
        )
    return isinstance(func, ast.Name) and func.id == "isclose"


def _isclose(call: ast.Call) -> tuple[str, str, Any, tuple[float, ...]]:
    if len(call.args) != 2:
        raise _Unsupported("isclose takes two arguments: the expression and a literal")
    tolerances = {"rel_tol": 1e-9, "abs_tol": 0.0}
    for keyword in call.keywords:
        if keyword.arg not in tolerances:
            raise _Unsupported(f"isclose's keyword {keyword.arg!r} is not supported")
        tolerances[keyword.arg] = _number(keyword.value, keyword.arg)
    first, second = call.args
    if _try_literal(second) is _NOT_LITERAL:
        first, second = second, first
    expected = _number(second, "isclose's expected value")
    return _expression(first), "isclose", expected, (tolerances["rel_tol"], tolerances["abs_tol"])


def _is_abs_difference(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "abs"
        and len(node.args) == 1
        and not node.keywords
        and isinstance(node.args[0], ast.BinOp)
        and isinstance(node.args[0].op, ast.Sub)
    )


def _abs_difference(node: ast.expr) -> tuple[str, float]:
    assert isinstance(node, ast.Call) and isinstance(node.args[0], ast.BinOp)
    first, second = node.args[0].left, node.args[0].right
    if _try_literal(second) is _NOT_LITERAL:
        first, second = second, first
    return _expression(first), _number(second, "the expected value")


def _number(node: ast.expr, what: str) -> Any:
    value = _try_literal(node)
    if not is_number(value):
        raise _Unsupported(f"{what} must be a number literal, got '{ast.unparse(node)}'")
    return value


_NOT_LITERAL: Any = object()
_CONSTRUCTORS: dict[str, Callable[[Any], Any]] = {
    "set": set,
    "frozenset": frozenset,
    "tuple": tuple,
    "list": list,
}
_ARITHMETIC: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_MAX_LITERAL_BITS = 4096
_NON_FINITE = ("nan", "inf", "infinity")
_encode_expected = make_encoder()


def _try_literal(node: ast.expr) -> Any:
    """The plain value a literal denotes, or ``_NOT_LITERAL``."""
    try:
        value = _literal(node)
    except (_Unsupported, TypeError, ValueError):  # TypeError: {[1]: 2}, an unhashable key
        return _NOT_LITERAL
    try:
        too_large = len(_encode_expected(value)) > MAX_EXPECTED_BYTES
    except NotPlainData:  # nested too deep
        too_large = True
    if too_large:
        raise _Unsupported(f"the expected value is larger than {MAX_EXPECTED_BYTES} bytes")
    return value


def _literal(node: ast.expr) -> Any:
    """Python literals, recursively, plus NaN/inf spellings and constructors of literals; no
    name is looked up and nothing is called (set/tuple/... are applied here to plain data)."""
    if isinstance(node, ast.Constant):
        if node.value is None or type(node.value) in (bool, int, float, str):
            return node.value
        raise _Unsupported(f"a {type(node.value).__name__} literal is not plain data")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if not is_number(value):
            raise _Unsupported("a sign needs a number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        return _arithmetic(node)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [_literal(item) for item in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
        if any(key is None for key in node.keys):
            raise _Unsupported("** in a dict literal")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values) if k is not None}
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        if node.value.id == "math" and node.attr in ("inf", "nan"):
            return float(node.attr)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        name, args = node.func.id, node.args
        if name == "float" and len(args) == 1 and isinstance(args[0], ast.Constant):
            text = args[0].value
            if isinstance(text, str) and text.strip().lower().lstrip("+-") in _NON_FINITE:
                return float(text)
        if name in _CONSTRUCTORS and len(args) <= 1:
            return _CONSTRUCTORS[name](_literal(args[0]) if args else ())
    raise _Unsupported(f"'{ast.unparse(node)}' is not a literal")


def _arithmetic(node: ast.BinOp) -> Any:
    """``2**31 - 1``, ``1 / 3``, ``1e9 + 7``: arithmetic on number literals, kept small."""
    left, right = _literal(node.left), _literal(node.right)
    if not (is_number(left) and is_number(right)):
        raise _Unsupported("arithmetic needs numbers")
    if isinstance(node.op, ast.Pow) and type(left) is int and type(right) is int:
        if right > _MAX_LITERAL_BITS or left.bit_length() * right > _MAX_LITERAL_BITS:
            raise _Unsupported("the power is too large for a literal")
    try:
        value = _ARITHMETIC[type(node.op)](left, right)
    except (ArithmeticError, ValueError) as exc:  # 1 / 0, float overflow
        raise _Unsupported(f"'{ast.unparse(node)}': {exc}") from None
    if not is_number(value) or (type(value) is int and value.bit_length() > _MAX_LITERAL_BITS):
        raise _Unsupported(f"'{ast.unparse(node)}' is not a number of at most 4096 bits")
    return value


__all__ = ["ACCEPTED_FORMS", "Check", "parse_test", "parse_tests"]
