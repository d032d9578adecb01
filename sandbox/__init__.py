"""Run untrusted generated code against unit tests, in a separate, limited, disposable process,
and judge the results outside it.

The code-generation task scores a completion by the fraction of its unit tests that pass. The
completion is untrusted: it may loop forever, fork, allocate all the memory it can, print without
end, delete files, open sockets, call ``sys.exit``, signal the trainer, or return objects built to
fool a test. Each call to :func:`run_tests` therefore:

1. parses every test in this process (:mod:`sandbox.tests_spec`) into the expression the sandbox
   evaluates (``add(1, 2)``) and the expected value (``3``), which never leaves this process;
2. starts ``python -I -S -B`` (isolated mode, stdlib only, no bytecode files) through a small
   launcher (:mod:`sandbox.launcher`) that sets up the isolation layers below and then ``exec``s
   the runner (:mod:`sandbox.runner`), with a fresh working directory (also ``HOME`` and
   ``TMPDIR``), a minimal environment, stdin from a payload file, and a wall-clock deadline;
3. reads each expression's value from a pipe of its own as plain data: the runner writes only
   values whose types are exactly ``None``, ``bool``, ``int``, ``float``, ``str``, ``list``,
   ``tuple``, ``dict``, ``set`` (an always-equal object, or a subclass of ``int`` with a lying
   ``__eq__``, fails the test as "not plain data"), and this process decodes them strictly and
   compares them with the expected values (:func:`sandbox.plain_data.strict_equal`); stdout and
   stderr are read into a buffer capped at ``max_output_bytes`` and never parsed;
4. kills every process the run left behind and deletes its files, whatever the outcome.

Layers, by platform (see :class:`Isolation`, and :func:`detect_isolation` for the one in use):

===========================  ===================================  ==============================
protection                   Linux as root (CAP_SYS_ADMIN)        fallback (macOS, non-root)
===========================  ===================================  ==============================
wall-clock timeout           SIGKILL of every process             SIGKILL of the process group
CPU, memory, file size       RLIMIT_CPU / AS / FSIZE              same, where the OS enforces it
processes (fork bomb)        RLIMIT_NPROC on a fresh uid          audit hook blocks fork/exec
signals to the trainer       invisible (PID namespace) and EPERM  audit hook blocks ``os.kill``
network                      empty network namespace              userns+netns if allowed, else
                                                                  the audit hook
files outside its directory  every mount read-only; /tmp,         audit hook blocks writes
                             /var/tmp, /dev/shm one private       outside its directory
                             tmpfs that vanishes with the run
SysV / POSIX IPC objects     private IPC namespace                RLIMIT_MSGQUEUE = 0
leftover processes           PID namespace dies with its pid 1;   process-group kill
                             /proc sweep of the uid
trainer killed mid-run       PDEATHSIG chain kills everything     the direct child dies (Linux)
===========================  ===================================  ==============================

Root without ``CAP_SYS_ADMIN`` (a plain container) gets the fresh uid with the audit hook, if
the interpreter is readable by other users (the strongest mode also works when it is not, e.g.
under ``/root/.pyenv``: it binds the interpreter's prefix into its own mount namespace). The
audit hook (PEP 578) is not a security boundary: it stops naive hostile code, not a determined
attacker (``ctypes`` and ``_posixsubprocess`` cannot be imported, so neither can modules that need
them, such as ``subprocess`` and ``asyncio``; other bypasses exist).

The candidate gets the standard library only (``-S``), runs with ``__name__ == "__sandbox__"``
(so an ``if __name__ == "__main__":`` block does not run), and its tests run in order in the
namespace it defined, under one wall-clock limit for the whole run.

Why a pass cannot be forged (in every mode): the records the runner writes carry a random nonce, but the argument
does not rest on it. A candidate that takes over the runner (finds the nonce through ``gc`` or
its frames, replaces the encoder, writes records of its own) can only send plain data, and a test
passes only if that data is the expected value, which it was never shown: forging a record is no
stronger than returning the value, which means solving the test. A check that receives two
records fails.

Residual risks, stated honestly:

* A test is only as strong as its expected value is hard to guess: ``assert is_even(4) is True``
  passes for a program that returns True always (half of a boolean task's tests), and ``!=``,
  ``is not None``, ``<`` or ``in`` tests accept many values. That is the test's weakness, not the
  sandbox's; write tests with specific expected values.
* The expression and any statements before an assert run in the candidate's interpreter, on its
  objects: a helper defined there that compares (``def same(a, b): return a == b`` then
  ``assert same(f(1), 2)``) is decided by the candidate and shows it the expected value. The
  parser rejects comparisons inside the evaluated expression, not inside helpers; keep every
  comparison in the assert itself.
* The candidate can read world-readable files: a task file that holds the tests or reference
  solutions, readable by the sandbox's uid, gives the answers away to a program that finds it (a
  checkout's ``examples/data/code_tasks.jsonl`` is world-readable unless you change its mode).
  With a fresh uid (running as root) keep such files unreadable to other users; in the fallback
  modes the candidate runs as the trainer's user and can read whatever the trainer can, and, where
  the kernel lets a process trace its parent (Yama ``ptrace_scope`` 0), the trainer's memory.
  (It has no network to send anything anywhere in the Linux root mode; it can print into its
  captured output.)
* Up to ``max_processes`` processes each get ``memory_mb`` of address space.
* Without the PID namespace, processes a candidate forks and that are killed are reparented to
  the host's init, which must reap them; and a trainer killed mid-run leaves grandchildren alive
  until their CPU limit.
* Kernel exploits are out of scope: the layers are ordinary kernel features, not a VM.
"""

from sandbox.limits import Isolation, SandboxLimits, Status, TestResult
from sandbox.plain_data import strict_equal
from sandbox.run import (
    WORKDIR_PREFIX,
    detect_isolation,
    extract_code,
    probe_isolation,
    run_tests,
    run_tests_many,
    score_completions,
)
from sandbox.tests_spec import ACCEPTED_FORMS, Check, parse_tests

__all__ = [
    "ACCEPTED_FORMS",
    "Check",
    "Isolation",
    "SandboxLimits",
    "Status",
    "TestResult",
    "WORKDIR_PREFIX",
    "detect_isolation",
    "extract_code",
    "parse_tests",
    "probe_isolation",
    "run_tests",
    "run_tests_many",
    "score_completions",
    "strict_equal",
]
