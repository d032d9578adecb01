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
   stderr are read into a buffer capped at ``max_output_bytes`` and never parsed, and a pipe
   flooded past its cap is throttled (the flood waits on it, at no CPU cost to the trainer);
4. kills every process the run left behind and deletes its files, whatever the outcome, never
   following a link the candidate left and never raising.

Reading the result channel never raises because of the candidate: each record is matched by a
strict grammar (:data:`sandbox.records.RECORD`), anything else is counted as forged, and a value
that cannot be decoded or judged within its budget scores the program 0, with the reason.

Modes (see :class:`Isolation`, :func:`detect_isolation` for the one in use, and
docs/reliability.md for the table of what each guarantees):

* **root**: Linux as root with CAP_SYS_ADMIN. A fresh uid; mount, PID, IPC and network
  namespaces; an allowlisted root file system (the interpreter's installation and the shared
  libraries read-only, a private tmpfs at /tmp, /var/tmp and /dev/shm, a minimal /dev, a
  private /proc; no repository, task file, home directory, /etc, /run, /sys or host /tmp);
  a seccomp allowlist (:data:`sandbox.seccomp.ALLOWED`: no signals to other processes, ptrace,
  keyrings, namespaces, SysV IPC, sockets, mounts, AIO, io_uring, memfd, file locks, nor a call
  it does not name); Landlock on writes, and on signals where the kernel has scopes; SysV shared
  memory sysctls 0; a pid 1 with no capability, under the same seccomp and Landlock, in a
  session of its own.
* **user namespace**: the same layers, owned by a user namespace: a user without root gets it
  as itself, root without CAP_SYS_ADMIN (a container) as a fresh uid.
* **weak**: no namespaces (user namespaces disabled, macOS): rlimits, the audit hook and, on
  Linux, the seccomp filter (threads only, no new processes) and Landlock (reads and writes
  limited to the interpreter, the libraries and the run's directory; signals to the run only).
  Refused unless ``SandboxLimits(isolation="weak")``, which logs what it does not protect. On
  macOS it is no boundary (the candidate runs as the trainer's user): docs/reliability.md says
  what it guarantees there and what to use for untrusted code.

In every mode: RLIMIT_CPU / AS / FSIZE / NPROC / NOFILE, a wall-clock deadline, every process of
the run killed and its files deleted whatever the outcome, and a trainer marked non-dumpable (no
process of its user reads its memory or environment). The audit hook (PEP 578) is not a
boundary: a candidate turns it off from Python in a few lines; it is kept only where nothing
stronger exists.

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
* In the weak mode without Landlock (macOS, old kernels) the candidate reads whatever the
  trainer's user can read, the task file with the tests included, and writes its files.
* Up to ``max_processes`` processes each get ``memory_mb`` of address space.
* Without the PID namespace (weak mode) a trainer killed mid-run leaves the run's process
  alive until its CPU limit.
* The per-run memory limit is per process (RLIMIT_AS): no cgroup is used. SysV shared memory and
  ``memfd_create`` are denied and the tmpfs is sized, so no memory escapes it through them.
* Kernel exploits are out of scope: the layers are ordinary kernel features, not a VM.
"""

from sandbox.limits import Isolation, IsolationLevel, SandboxLimits, Status, TestResult
from sandbox.plain_data import strict_equal
from sandbox.run import (
    WORKDIR_PREFIX,
    candidate_isolations,
    detect_isolation,
    extract_code,
    probe_isolation,
    run_tests,
    run_tests_many,
    score_completions,
    weak_isolation_gaps,
)
from sandbox.tests_spec import ACCEPTED_FORMS, Check, parse_tests

__all__ = [
    "ACCEPTED_FORMS",
    "Check",
    "Isolation",
    "IsolationLevel",
    "SandboxLimits",
    "Status",
    "TestResult",
    "WORKDIR_PREFIX",
    "candidate_isolations",
    "detect_isolation",
    "extract_code",
    "parse_tests",
    "probe_isolation",
    "run_tests",
    "run_tests_many",
    "score_completions",
    "strict_equal",
    "weak_isolation_gaps",
]
