"""The value model (critic): a transformer backbone with a scalar head, ``V(s_t)`` at every
position.

It has the reward model's layout (a one-label ``*ForSequenceClassification``, see
:mod:`models.backbone`), so it usually starts from the reward model's weights (the choice of
"Fine-Tuning Language Models from Human Preferences" and summarize_from_feedback_details), or from
the policy's backbone with a fresh head.
"""

from __future__ import annotations

from pathlib import Path

import mlx.nn as nn

from models.backbone import DtypeLike, HeadInit, ScalarHeadModel

__all__ = ["ValueModel"]


class ValueModel(ScalarHeadModel):
    """``values = model(input_ids)``: (B, L) token ids -> (B, L) value estimates, ``values[b, t]``
    being the value of the state that ends with token t.

    Build it with :meth:`from_pretrained` (a reward-model or value-model checkpoint) or
    :meth:`from_policy_backbone`; save with :meth:`save_pretrained`.
    """

    @classmethod
    def from_policy_backbone(
        cls,
        path_or_model: str | Path | nn.Module,
        *,
        head_init: HeadInit = "zeros",
        seed: int = 0,
        dtype: DtypeLike = None,
        fast_math: bool = True,
    ) -> ValueModel:
        """The policy's backbone (``lm_head`` dropped) with a fresh scalar head.

        Args:
            path_or_model: the policy's checkpoint directory or repo id, or the in-memory mlx-lm
                causal LM (its weights are shared until the value model is trained; MLX arrays
                are immutable, so training one never changes the other).
            head_init: "zeros" (every value 0 at first; the first gradient then reaches only the
                head) or "normal" (N(0, 1/(D+1)) from ``seed``).
            seed: seed of the "normal" head.
            dtype: parameter dtype; None = float32.
            fast_math: run the layers through :mod:`base_setup.fast_math` (False: mlx-lm's).
        """
        return cls.from_causal_lm(
            path_or_model, head_init=head_init, seed=seed, dtype=dtype, fast_math=fast_math
        )
