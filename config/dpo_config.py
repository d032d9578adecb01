"""What a direct preference optimisation (DPO) run is: the policy trained on preference pairs
without a reward model or rollouts, against a frozen reference (or none, for SimPO and ORPO).

The shared fields (model, data, optimisation, checkpoints) are
:class:`config.sft_config.FineTuneConfig`'s and LoRA is :class:`config.model_config.LoraConfig`;
``model_name`` is usually the SFT output. Build with ``load_config(path, overrides,
cls=DPOConfig)``. The names and meanings follow TRL's ``DPOConfig`` (``beta``, ``loss_type``,
``label_smoothing``) and ``CPOConfig`` (``simpo_gamma``).
"""

from dataclasses import dataclass
from typing import Literal

from config._fields import check_field_types, is_non_negative, is_positive, require
from config.model_config import LoraConfig
from config.sft_config import FineTuneConfig

#: The preference losses (see ``training.preference_loss``).
PreferenceLossType = Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "orpo"]
#: Losses that need no reference model.
REFERENCE_FREE_LOSSES: tuple[str, ...] = ("simpo", "orpo")


@dataclass(kw_only=True)
class DPOConfig(FineTuneConfig, LoraConfig):
    """Direct preference optimisation of the policy on ``{"prompt", "chosen", "rejected"}`` pairs.

    The loss (``loss_type``) compares the policy's log-probabilities of the chosen and the rejected
    answer (completion tokens and EOS only; the prompt is context), relative to the reference's for
    sigmoid, ipo, hinge and robust. The reference's log-probabilities are computed once before
    training and cached in ``<output_dir>/reference_logps``, so a resumed run reuses them. The
    final model is saved like SFT's (LoRA adapters merged), so it is a plain model directory that
    ``generate``, ``chat``, ``export`` and PPO load.

    Attributes:
        beta: Temperature of the implicit reward beta * log(pi / pi_ref) (TRL's beta; DPO paper's
            beta, typically 0.1 to 0.5); for ipo the regularisation tau (target margin
            1 / (2 * beta)); for orpo the weight lambda of the odds-ratio term; for simpo the
            reward scale.
        loss_type: "sigmoid" (DPO, Rafailov et al. 2023), "ipo" (Azar et al. 2023, length-averaged
            log-probs), "hinge" (SLiC, Zhao et al. 2023), "robust" (Chowdhury et al. 2024,
            unbiased under label noise label_smoothing), and the reference-free "simpo" (Meng
            et al. 2024) and "orpo" (Hong et al. 2024, NLL of the chosen answer plus an
            odds-ratio term).
        label_smoothing: Probability that a pair's label is flipped: the noise rate of robust
            (TRL's meaning), and, beyond TRL 1.12's DPOTrainer, conservative DPO (cDPO) for
            sigmoid and SimPO's smoothing as in TRL's CPOTrainer; 0 = trust every label. Must be
            below 0.5.
        simpo_gamma: SimPO's target reward margin gamma (the loss asks for
            beta * (avg logp_chosen - avg logp_rejected) > gamma); simpo only.
        ref_model_name: The reference model (a local directory or Hub id; it must use the
            policy's tokenizer); None = the policy's starting weights: the base under the LoRA
            adapters when use_lora, else a frozen copy of model_name. Not used by simpo and orpo.
    """

    learning_rate: float = 1e-6
    output_dir: str = "runs/dpo"
    use_lora: bool = False
    beta: float = 0.1
    loss_type: PreferenceLossType = "sigmoid"
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    ref_model_name: str | None = None

    def __post_init__(self) -> None:
        FineTuneConfig.__post_init__(self)
        LoraConfig.__post_init__(self)
        check_field_types(self, DPOConfig)
        require(
            is_positive(self.beta),
            "beta",
            self.beta,
            "> 0",
            "set e.g. 0.1 (larger keeps the policy closer to the reference)",
        )
        require(
            0.0 <= self.label_smoothing < 0.5,
            "label_smoothing",
            self.label_smoothing,
            "in [0, 0.5)",
            "set 0.0 to trust every label, or the fraction of flipped labels such as 0.1",
        )
        if self.label_smoothing and self.loss_type not in ("sigmoid", "robust", "simpo"):
            raise ValueError(
                f"label_smoothing={self.label_smoothing} has no effect with loss_type="
                f"{self.loss_type!r}: set label_smoothing to 0, or loss_type to 'sigmoid' "
                "(cDPO), 'robust' or 'simpo'"
            )
        require(
            is_non_negative(self.simpo_gamma),
            "simpo_gamma",
            self.simpo_gamma,
            ">= 0",
            "set e.g. 0.5 (SimPO's target reward margin)",
        )
        if self.ref_model_name is not None:
            require(
                bool(self.ref_model_name.strip()),
                "ref_model_name",
                self.ref_model_name,
                "a non-empty path or repo id, or null",
                "set it to the reference model's directory, or null for the policy's start",
            )

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares with a reference model (all but simpo and orpo)."""
        return self.loss_type not in REFERENCE_FREE_LOSSES
