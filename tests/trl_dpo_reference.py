"""TRL's numbers for the DPO parity test (tests/test_dpo.py), written to
tests/data/trl_dpo_reference.json.

Run it in a throwaway environment with PyTorch and TRL (never a project requirement)::

    python3.11 -m venv /tmp/trlvenv
    /tmp/trlvenv/bin/pip install trl==1.12.0 torch==2.13.0 numpy
    /tmp/trlvenv/bin/python tests/trl_dpo_reference.py

A tiny causal LM (embedding, tanh, causal running mean, linear head; weights drawn with NumPy from a
fixed seed, so the MLX side builds the same model) scores fixed preference pairs. For sigmoid, ipo,
hinge and robust, TRL's own ``DPOTrainer._compute_loss`` (its log-probs, reference path, loss and
metrics) runs on the policy and the reference model, and ``loss.backward()`` gives the gradients of
every policy weight. For simpo and orpo, TRL's ``CPOTrainer.cpo_loss`` (loss_type "simpo") and
``ORPOTrainer.odds_ratio_loss`` run on fixed length-averaged log-probs. Only NumPy is imported at
module level, so the test reads the model and the pairs from here.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

VOCAB, DIM, PAD = 13, 8, 0
OUT = Path(__file__).parent / "data" / "trl_dpo_reference.json"
#: (loss_type, beta, label_smoothing) compared through DPOTrainer._compute_loss.
DPO_CASES: tuple[tuple[str, float, float], ...] = (
    ("sigmoid", 0.1, 0.0),
    ("ipo", 0.1, 0.0),
    ("hinge", 0.5, 0.0),
    ("robust", 0.1, 0.1),
)
#: (beta, simpo_gamma) / beta of the reference-free losses.
SIMPO_CASE = (2.0, 0.5)
ORPO_BETA = 0.1
# Length-averaged log-probs (chosen, rejected) of 4 pairs, for simpo and orpo.
AVG_LOGPS = (
    [-0.7, -1.9, -0.05, -2.5],
    [-1.2, -0.8, -0.4, -2.6],
)


def tiny_weights(seed: int) -> dict[str, np.ndarray]:
    """float32 weights of the tiny LM: ``embed`` (V, D), ``head`` (V, D) and ``bias`` (V,)."""
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.normal(0.0, 1.0, (VOCAB, DIM)).astype(np.float32),
        "head": rng.normal(0.0, 0.5, (VOCAB, DIM)).astype(np.float32),
        "bias": rng.normal(0.0, 0.1, (VOCAB,)).astype(np.float32),
    }


def pairs() -> list[tuple[list[int], int, list[int], int]]:
    """Preference pairs as ``(chosen_ids, chosen_start, rejected_ids, rejected_start)``: prompt
    and answers of different lengths (padding and masks matter), token 0 never used (PAD)."""
    return [
        ([3, 4, 5, 6, 7, 2], 3, [3, 4, 5, 9, 2], 3),
        ([8, 1, 10, 11, 2], 2, [8, 1, 4, 4, 4, 12, 2], 2),
        ([5, 5, 9, 2], 2, [5, 5, 7, 7, 2], 2),
    ]


def batch_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, completion_mask)``, each (2B, L): chosen rows then rejected rows, padded on
    the right with PAD; the mask is 1 at answer tokens (TRL's ``completion_mask``)."""
    sides = [(c, cs) for c, cs, _, _ in pairs()] + [(r, rs) for _, _, r, rs in pairs()]
    width = max(len(ids) for ids, _ in sides)
    ids = np.full((len(sides), width), PAD, dtype=np.int64)
    mask = np.zeros((len(sides), width), dtype=np.int64)
    for row, (tokens, start) in enumerate(sides):
        ids[row, : len(tokens)] = tokens
        mask[row, start : len(tokens)] = 1
    return ids, mask


def main() -> None:
    import torch
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer
    from trl.trainer.dpo_trainer import DPOTrainer
    from collections import defaultdict

    import trl

    class TinyLM(torch.nn.Module):
        is_gradient_checkpointing = False

        def __init__(self, weights: dict[str, np.ndarray]) -> None:
            super().__init__()
            self.embed = torch.nn.Parameter(torch.tensor(weights["embed"]))
            self.head = torch.nn.Parameter(torch.tensor(weights["head"]))
            self.bias = torch.nn.Parameter(torch.tensor(weights["bias"]))

        def forward(self, input_ids: Any, **_: Any) -> Any:
            h = torch.tanh(self.embed[input_ids])  # (N, L, D)
            steps = torch.arange(1, input_ids.shape[1] + 1, dtype=h.dtype)[None, :, None]
            h = torch.cumsum(h, dim=1) / steps  # causal running mean
            return SimpleNamespace(logits=h @ self.head.T + self.bias)  # (N, L, V)

    ids, mask = batch_arrays()
    inputs = {
        "input_ids": torch.tensor(ids),
        "attention_mask": torch.tensor((ids != PAD).astype(np.int64)),
        "completion_mask": torch.tensor(mask),
    }
    out: dict[str, Any] = {"trl": trl.__version__, "torch": torch.__version__, "dpo": {}}
    for loss_type, beta, label_smoothing in DPO_CASES:
        policy, ref = TinyLM(tiny_weights(1)), TinyLM(tiny_weights(2))
        accelerator = SimpleNamespace(
            device="cpu", gather=lambda x: x, gather_for_metrics=lambda x: x
        )
        fake = SimpleNamespace(
            model=policy,
            ref_model=ref,
            accelerator=accelerator,
            aux_loss_enabled=False,
            ld_alpha=None,
            precompute_ref_logps=False,
            f_divergence_type="reverse_kl",
            loss_types=[loss_type],
            loss_weights=[1.0],
            beta=beta,
            label_smoothing=label_smoothing,
            use_weighting=False,
            _metrics=defaultdict(lambda: defaultdict(list)),
            _total_train_tokens=0,
            args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        )
        loss = DPOTrainer._compute_loss(fake, policy, inputs, False)
        loss.backward()
        metrics = {k: v[-1] for k, v in fake._metrics["train"].items() if "/" in k}
        out["dpo"][loss_type] = {
            "beta": beta,
            "label_smoothing": label_smoothing,
            "loss": float(loss),
            "metrics": metrics,
            "grads": {
                name: p.grad.numpy().astype(float).tolist() for name, p in policy.named_parameters()
            },
        }

    chosen = torch.tensor(AVG_LOGPS[0], dtype=torch.float64)
    rejected = torch.tensor(AVG_LOGPS[1], dtype=torch.float64)
    beta, gamma = SIMPO_CASE
    cpo = SimpleNamespace(
        alpha=0.0,
        loss_type="simpo",
        simpo_gamma=gamma,
        beta=beta,
        label_smoothing=0.0,
        accelerator=SimpleNamespace(device="cpu"),
    )
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(cpo, chosen, rejected)
    out["simpo"] = {
        "beta": beta,
        "simpo_gamma": gamma,
        "losses": losses.tolist(),
        "chosen_rewards": chosen_rewards.tolist(),
        "rejected_rewards": rejected_rewards.tolist(),
    }
    orpo = SimpleNamespace(beta=ORPO_BETA, accelerator=SimpleNamespace(device="cpu"))
    losses, chosen_rewards, rejected_rewards, ratio, _ = ORPOTrainer.odds_ratio_loss(
        orpo, chosen, rejected
    )
    out["orpo"] = {
        "beta": ORPO_BETA,
        "losses": losses.tolist(),  # beta * log sigmoid(log odds ratio), per pair
        "chosen_rewards": chosen_rewards.tolist(),
        "rejected_rewards": rejected_rewards.tolist(),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
