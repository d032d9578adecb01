"""A ready tool that runs Python code in the sandbox (:mod:`sandbox`): ``tools=[python_code]``.

The model's program runs in a separate, limited, disposable process (its own namespaces where
the kernel allows, resource limits, a wall-clock deadline after which every process of the run
is killed), so a program that loops, forks or fills the memory costs the trainer nothing but
the deadline. The tool returns what the program printed (stdout and stderr, capped); a program
that raises, exits or runs out of time gives the model an error message (``ok=False``).
"""

from __future__ import annotations

from agents.execution import ToolError
from agents.tools import Tool, make_tools
from sandbox import SandboxLimits, run_tests

#: The sandbox's limits for the default ``python_code`` tool: a deadline under the default
#: ``tool_timeout_s``, so the sandbox's own deadline, which kills the program, comes first.
DEFAULT_LIMITS = SandboxLimits(timeout_s=5.0, cpu_time_s=5, memory_mb=512)
# The sandbox runs a program and then its tests; this one checks nothing about the program and
# only makes the run complete (the tool reads the program's output, not a pass).
_NO_TEST = ['assert len("") == 0']


def run_python(code: str, limits: SandboxLimits) -> str:
    """What ``code`` prints, run in the sandbox under ``limits``.

    Raises:
        ToolError: the program raised or exited before finishing, or ran out of time or
            memory; the message (with whatever it printed) is what the model reads.
    """
    result = run_tests(code, _NO_TEST, limits)
    output = result.output
    if result.status == "ok":
        return output if output else "(the program printed nothing)"
    reasons = {
        "error": result.detail.replace(
            "the code raised before any test ran: ", "the program raised "
        ),
        "timeout": f"the program did not finish within {limits.timeout_s:g} s and was stopped",
        "crashed": f"the program was killed ({result.detail})",
    }
    text = f"Error: {reasons.get(result.status, result.detail)}"
    raise ToolError(f"{output}\n{text}" if output else text)


def make_python_code_tool(limits: SandboxLimits | None = None, name: str = "python_code") -> Tool:
    """A ``python_code(code)`` tool whose programs run in the sandbox under ``limits``
    (:data:`DEFAULT_LIMITS` when None). Pass ``SandboxLimits(isolation="weak")`` where the
    kernel has no namespaces (macOS), after reading what that does not protect (docs/reliability.md).
    """
    chosen = DEFAULT_LIMITS if limits is None else limits

    def python_code(code: str) -> str:
        """Run a Python program (standard library only) and return what it prints.

        Args:
            code: The complete program; print every value you need to see.
        """
        return run_python(code, chosen)

    python_code.__name__ = python_code.__qualname__ = name
    return make_tools([python_code])[0]


def python_code(code: str) -> str:
    """Run a Python program (standard library only) and return what it prints.

    Args:
        code: The complete program; print every value you need to see.
    """
    return run_python(code, DEFAULT_LIMITS)


__all__: list[str] = ["DEFAULT_LIMITS", "make_python_code_tool", "python_code", "run_python"]
