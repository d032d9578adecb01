"""The runner: the candidate's interpreter, executed as a script by the launcher
(``python -I -S -B -c <this file's text> <result fd> <audit hook 0/1> <workdir>``).

It reads its payload (``{"nonce", "code", "tests"}``) from stdin, runs the candidate's code, then
for each check of each test (see :mod:`sandbox.tests_spec`) runs the check's setup statements,
evaluates its expression and writes the value to the result pipe as plain data
(:func:`make_encoder`). It never sees an expected value and never decides a pass: the trusted
process does. One line per record, ``<nonce> <kind> <test> <check> <text>``, kinds ``start``,
``value``, ``fail``, ``error`` (the code raised before any test), ``done``.

Everything it needs is bound to locals before the candidate runs, so that patching builtins or
modules does not change what it reports. A candidate that gets at the runner's state anyway (its
frames, ``gc``) can write records of its own; they carry plain data only, which passes only if it
is the right answer, so forging a record is no stronger than returning that value.
Standard library only: the interpreter runs with ``-S``.
"""

import builtins
import json.encoder
import os
import sys
from typing import Any, Callable

#: Largest encoded value, in bytes, and deepest nesting the runner reports.
MAX_VALUE_BYTES = 64 * 1024
MAX_DEPTH = 64


class NotPlainData(ValueError):
    """A value that is not made of exact built-in types, or too large to report."""


def make_encoder(
    max_bytes: int = MAX_VALUE_BYTES, max_depth: int = MAX_DEPTH
) -> Callable[[Any], str]:
    """A function that writes a value as the sandbox's wire format (JSON text), or raises
    :class:`NotPlainData`.

    Only values whose type is exactly ``None``, ``bool``, ``int``, ``float``, ``str``, ``list``,
    ``tuple``, ``dict``, ``set`` or ``frozenset`` (recursively) are written; a subclass, or any
    other object, raises. No method of the value is called (exact built-in types have no
    candidate code), so an object cannot choose what it reports. The format: JSON for None,
    booleans, integers, finite floats, strings and lists; ``{"float": "nan" | "inf" | "-inf"}``,
    ``{"tuple": [...]}``, ``{"set": [...]}``, ``{"frozenset": [...]}`` and
    ``{"dict": [[key, value], ...]}`` for the rest.
    """
    type_, len_, int_repr, float_repr = type, len, int.__repr__, float.__repr__
    type_name = vars(type)["__name__"].__get__  # a class's own name, whatever its metaclass
    quote = json.encoder.encode_basestring_ascii
    inf = float("inf")
    NotPlainData_ = NotPlainData

    def encode(value: Any) -> str:
        parts: list[str] = []
        size = [0]

        def put(text: str) -> None:
            size[0] += len_(text)
            if size[0] > max_bytes:
                raise NotPlainData_(f"the value is larger than {max_bytes} bytes")
            parts.append(text)

        def items(tag: str | None, values: Any, depth: int) -> None:
            put("[" if tag is None else '{"' + tag + '":[')
            first = True
            for item in values:
                if not first:
                    put(",")
                first = False
                walk(item, depth + 1)
            put("]" if tag is None else "]}")

        def walk(x: Any, depth: int) -> None:
            if depth > max_depth:
                raise NotPlainData_(f"the value is nested deeper than {max_depth}")
            kind = type_(x)
            if x is None:
                put("null")
            elif kind is bool:
                put("true" if x else "false")
            elif kind is int:
                put(int_repr(x))  # ValueError past sys.get_int_max_str_digits(): not reported
            elif kind is float:
                if x != x:
                    put('{"float":"nan"}')
                elif x == inf or x == -inf:
                    put('{"float":"inf"}' if x > 0 else '{"float":"-inf"}')
                else:
                    put(float_repr(x))
            elif kind is str:
                if len_(x) > max_bytes:
                    raise NotPlainData_(f"the value is larger than {max_bytes} bytes")
                put(quote(x))
            elif kind is list:
                items(None, x, depth)
            elif kind is tuple:
                items("tuple", x, depth)
            elif kind is set:
                items("set", x, depth)
            elif kind is frozenset:
                items("frozenset", x, depth)
            elif kind is dict:
                put('{"dict":[')
                first = True
                for key, item in x.items():
                    put("[" if first else ",[")
                    first = False
                    walk(key, depth + 1)
                    put(",")
                    walk(item, depth + 1)
                    put("]")
                put("]}")
            else:
                raise NotPlainData_(f"a value of type {type_name(kind)} is not plain data")

        walk(value, 0)
        return "".join(parts)

    return encode


def _audit_hook(workdir: str) -> None:
    """A best-effort layer (PEP 578): sockets, fork/exec, ctypes, signals to other processes and
    writes outside ``workdir`` raise PermissionError."""
    realpath, sep, getpid = os.path.realpath, os.sep, os.getpid
    root = realpath(workdir)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    blocked = (
        "socket.",
        "ctypes.",
        "subprocess.",
        "os.fork",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.system",
        "os.startfile",
        "os.killpg",
        "pty.",
        "signal.pidfd",
    )
    path_args = {
        "os.remove": (0,),
        "os.rmdir": (0,),
        "os.mkdir": (0,),
        "os.rename": (0, 1),
        "os.link": (0, 1),
        "os.symlink": (1,),
        "os.chmod": (0,),
        "os.chown": (0,),
        "os.truncate": (0,),
        "os.utime": (0,),
        "shutil.rmtree": (0,),
        "os.chflags": (0,),
        "os.lchflags": (0,),
        "os.setxattr": (0,),
        "os.removexattr": (0,),
    }
    modules = {"_ctypes", "_posixsubprocess"}  # their C calls raise no audit event
    busy: list[int] = []

    def inside(path: Any) -> bool:
        if isinstance(path, bytes):
            path = path.decode("utf-8", "surrogateescape")
        if not isinstance(path, str):
            return True  # a file descriptor: checked when it was opened
        full = realpath(path)
        return full == root or full.startswith(root + sep) or full == "/dev/null"

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if busy:
            return
        busy.append(1)
        try:
            if event == "open":
                flags = args[2]
                if isinstance(flags, int) and flags & write_flags and not inside(args[0]):
                    raise PermissionError(f"sandbox: writing {args[0]!r} is blocked")
            elif event in path_args:
                for i in path_args[event]:
                    if i < len(args) and not inside(args[i]):
                        raise PermissionError(f"sandbox: {event} on {args[i]!r} is blocked")
            elif event == "os.kill":
                if args[0] != getpid():
                    raise PermissionError("sandbox: signals to other processes are blocked")
            elif event == "import":
                if args[0] in modules:
                    raise PermissionError(f"sandbox: importing {args[0]} is blocked")
            elif event.startswith(blocked):
                raise PermissionError(f"sandbox: {event} is blocked")
        finally:
            busy.pop()

    sys.addaudithook(hook)


def _main() -> None:
    fd, hook, workdir = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
    payload = json.loads(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the payload (and its nonce) is no longer reachable through stdin
    os.close(null)
    os.set_inheritable(fd, False)
    nonce, code, tests = payload["nonce"], payload["code"], payload["tests"]
    del payload
    write, exit_, flushes = os.write, os._exit, (sys.stdout.flush, sys.stderr.flush)
    exec_, eval_, compile_, ascii_, type_, str_ = exec, eval, compile, ascii, type, str
    enumerate_, settrace, setprofile = enumerate, sys.settrace, sys.setprofile
    BaseException_ = BaseException
    encode = make_encoder()

    def report(kind: str, test: int, check: int, text: str = "") -> None:
        write(fd, f"{nonce} {kind} {test} {check} {text}\n".encode("ascii"))

    def describe(exc: BaseException) -> str:
        try:
            message = str_(exc)
            text = ascii_(type_(exc).__name__ + (": " + message if message else ""))[1:-1]
        except BaseException_:  # the candidate's own __str__ may raise anything
            text = "<unprintable exception>"
        return text[:300]

    def finish(kind: str, message: str = "") -> None:
        for flush in flushes:  # the interpreter's own stdout and stderr, bound at start
            try:
                flush()
            except BaseException_:  # a closed or broken stdout is the candidate's business
                pass
        report(kind, -1, -1, message)
        exit_(0)  # skip atexit handlers, finalizers and threads the candidate left behind

    namespace = {"__name__": "__sandbox__", "__builtins__": builtins}
    report("start", -1, -1)
    if hook:
        _audit_hook(workdir)
    try:
        exec_(compile_(code, "<candidate>", "exec"), namespace)
    except BaseException_ as exc:  # SyntaxError, any exception, SystemExit: the code is broken
        finish("error", describe(exc))
    for test, checks in enumerate_(tests):
        for check, (setup, expression) in enumerate_(checks):
            settrace(None)
            setprofile(None)
            try:  # a failing test never stops the others
                if setup:
                    exec_(compile_(setup, f"<test {test}>", "exec"), namespace)
                value = eval_(compile_(expression, f"<test {test}>", "eval"), namespace)
            except BaseException_ as exc:
                report("fail", test, check, describe(exc))
                break
            try:
                text = encode(value)
            except BaseException_ as exc:  # not plain data, too large, or changed meanwhile
                report("fail", test, check, describe(exc))
                break
            report("value", test, check, text)
    finish("done")


if __name__ == "__main__":
    _main()
