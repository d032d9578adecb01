"""The rollout inspector: one self-contained HTML page of a run's rollout records.

``python main.py inspect RUN`` (or :func:`write_inspector`) reads ``RUN/rollouts/*.jsonl``
(:mod:`ppo_trainer.rollout_records`) and writes ``RUN/rollouts/inspect.html``: every recorded
response with its tokens coloured by a chosen quantity (advantage, KL, reward, value, return,
entropy, log-probs), the numbers of a token on hover, sorting by score or KL, a step selector,
the same prompt at two steps side by side, the mean KL and advantage by token position, and under
each response what its rewards logged (a judge's score, the distribution it was read from and
its prompt, opened with ``#judge=1``). The
records are embedded in the page and drawn by its own script: it opens from disk, offline.
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Any

from ppo_trainer.rollout_records import ROLLOUTS_DIR, StepRecords, read_rollout_records

PAGE_FILE = "inspect.html"
_TEMPLATE = Path(__file__).with_name("inspector_page.html")
_DATA_SLOT = "/*__DATA__*/"
_TITLE_SLOT = "__TITLE__"


def embed_json(value: Any) -> str:
    """``value`` as JSON that is safe inside ``<script type="application/json">``: every ``<``
    (so ``</script>`` and ``<!--`` in a prompt cannot end the script) and ``>``/``&`` written as
    ``\\u003c``-style escapes, which JSON strings allow and ``JSON.parse`` turns back."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return (
        text.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def inspector_html(steps: list[StepRecords], *, initial: int, title: str) -> str:
    """The page for ``steps``, opening on ``steps[initial]``; ``title`` names the run."""
    if not steps:
        raise ValueError("no rollout records to show")
    if not 0 <= initial < len(steps):
        raise ValueError(f"initial={initial} is not an index of the {len(steps)} steps")
    data = {
        "run": title,
        "initial": initial,
        "steps": [{"step": s.step, "source": s.source, "records": s.records} for s in steps],
    }
    page = _TEMPLATE.read_text(encoding="utf-8")
    page = page.replace(_TITLE_SLOT, html.escape(title))
    # The data goes in last, so nothing in it is mistaken for a slot.
    head, slot, tail = page.partition(_DATA_SLOT)
    if not slot:
        raise RuntimeError(f"{_TEMPLATE} has lost its data slot {_DATA_SLOT}")
    return head + embed_json(data) + tail


def write_inspector(
    run_dir: str | Path, step: int | None = None, out: str | Path | None = None
) -> Path:
    """Write the inspector page of the run in ``run_dir`` and return its path.

    Args:
        run_dir: the run folder (a trainer's ``output_dir``) holding ``rollouts/``.
        step: the step the page opens on (its training records, else its evaluation records);
            default: the latest. Every recorded step is in the page either way.
        out: where to write the page; default ``<run_dir>/rollouts/inspect.html``.

    Raises:
        FileNotFoundError: the run has no rollout records.
        ValueError: ``step`` was not recorded (the message lists those that were).
    """
    run_dir = Path(run_dir)
    steps = read_rollout_records(run_dir)
    if step is None:
        initial = len(steps) - 1
    else:
        matches = [i for i, s in enumerate(steps) if s.step == step]
        if not matches:
            recorded = sorted({s.step for s in steps})
            raise ValueError(
                f"step {step} has no rollout records in {run_dir / ROLLOUTS_DIR}; recorded steps: "
                f"{recorded}"
            )
        initial = matches[0]  # training records sort before the evaluation ones of a step
    path = Path(out) if out is not None else run_dir / ROLLOUTS_DIR / PAGE_FILE
    page = inspector_html(steps, initial=initial, title=str(run_dir))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
