"""TRL's numbers for the distillation-loss parity test (tests/test_distillation_loss.py),
written to tests/data/trl_gkd_reference.json.

Run it in a throwaway environment with PyTorch and TRL (never a project requirement)::

    python3.11 -m venv /tmp/trlvenv
    /tmp/trlvenv/bin/pip install trl==1.12.0 torch==2.13.0 numpy
    /tmp/trlvenv/bin/python tests/trl_gkd_reference.py

Fixed student and teacher logits (NumPy, a fixed seed, so the test builds the same arrays) and
labels with ignored positions go through TRL's own ``GKDTrainer.generalized_jsd_loss`` for each
case; ``backward()`` of the loss (of its sum with ``reduction="none"``) gives the gradient with
respect to the student's logits. Only NumPy is imported at module level.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

OUT = Path(__file__).parent / "data" / "trl_gkd_reference.json"
BATCH, TIME, VOCAB = 2, 5, 11
#: (beta, temperature, reduction, with labels)
CASES: tuple[tuple[float, float, str, bool], ...] = (
    (0.0, 1.0, "batchmean", True),
    (1.0, 1.0, "batchmean", True),
    (0.5, 1.0, "batchmean", True),
    (0.1, 2.0, "batchmean", True),
    (0.9, 0.7, "batchmean", False),
    (0.5, 1.0, "sum", True),
    (0.5, 1.0, "mean", True),
    (0.3, 1.0, "mean", False),
    (0.5, 1.5, "none", True),
    (1.0, 1.0, "none", False),
)


def logits() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 student and teacher logits (B, T, V) and int labels (B, T) with -100 at the
    ignored positions (the first one of row 0, the last two of row 1)."""
    rng = np.random.default_rng(7)
    student = rng.normal(0.0, 2.0, (BATCH, TIME, VOCAB)).astype(np.float32)
    teacher = rng.normal(0.0, 2.0, (BATCH, TIME, VOCAB)).astype(np.float32)
    labels = rng.integers(0, VOCAB, (BATCH, TIME))
    labels[0, 0] = labels[1, -2:] = -100
    return student, teacher, labels


def case_key(beta: float, temperature: float, reduction: str, with_labels: bool) -> str:
    return f"beta={beta} temperature={temperature} reduction={reduction} labels={with_labels}"


def record() -> dict[str, Any]:
    import torch
    import trl
    from trl.experimental.gkd import GKDTrainer

    student_np, teacher_np, labels_np = logits()
    cases = {}
    for beta, temperature, reduction, with_labels in CASES:
        student = torch.tensor(student_np, requires_grad=True)
        loss = GKDTrainer.generalized_jsd_loss(
            student,
            torch.tensor(teacher_np),
            labels=torch.tensor(labels_np) if with_labels else None,
            beta=beta,
            temperature=temperature,
            reduction=reduction,
        )
        loss.sum().backward()
        assert student.grad is not None
        cases[case_key(beta, temperature, reduction, with_labels)] = {
            "loss": loss.detach().numpy().astype(float).tolist(),
            "grad": student.grad.numpy().astype(float).tolist(),
        }
    return {"trl": trl.__version__, "torch": torch.__version__, "cases": cases}


if __name__ == "__main__":
    OUT.write_text(json.dumps(record()) + "\n")
    print(f"wrote {OUT}")
