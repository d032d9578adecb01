"""What a reward-model training run is: a causal LM's backbone plus a scalar head, trained on
preference pairs with the Bradley-Terry loss.

The shared fields (model, data, optimisation, checkpoints) are :class:`config.sft_config.FineTuneConfig`'s;
``model_name`` is usually the SFT output. Build with ``load_config(path, overrides,
cls=RewardConfig)``.
"""

from dataclasses import dataclass
from typing import Literal

from config._fields import check_field_types, is_non_negative, require
from config.model_config import LoraConfig
from config.sft_config import FineTuneConfig

#: How the fresh scalar head starts (see ``models.backbone.HeadInit``).
RewardHeadInit = Literal["zeros", "normal"]


@dataclass(kw_only=True)
class RewardConfig(FineTuneConfig, LoraConfig):
    """Reward-model training: ``loss = -log sigmoid(r(x, y_chosen) - r(x, y_rejected) - margin)``
    over preference pairs, plus an optional reward-centering term.

    Every weight trains (backbone and head), and the final model is saved in the Hugging Face
    ``*ForSequenceClassification`` layout with one label, which loads as PPO's reward model and
    as the start of its value model. With LoRA (:class:`LoraConfig`; off by default here) the
    base stays frozen, the adapters and the head train, and the final model is an adapter
    checkpoint (adapters, head, and the base's path and fingerprint) that loads as the reward
    model too, on its own or on the PPO policy's base (share_reward_base).

    Attributes:
        head_init: How the scalar head starts: "normal" (N(0, 1/(D+1)) from seed, as in
            OpenAI's lm-human-preferences) or "zeros" (every reward 0 at first).
        margin: Margin m in the loss, applied to every pair that has no "margin" field of its
            own (a per-pair "margin" in the data wins); 0 = the plain Bradley-Terry loss.
        center_rewards_coefficient: Weight of the centering term mean((r_chosen + r_rejected)^2),
            which keeps rewards near zero mean (TRL's center_rewards_coefficient; e.g. 0.01);
            0 = off.
    """

    learning_rate: float = 1e-5
    output_dir: str = "runs/reward"
    head_init: RewardHeadInit = "normal"
    margin: float = 0.0
    center_rewards_coefficient: float = 0.0
    use_lora: bool = False

    def __post_init__(self) -> None:
        FineTuneConfig.__post_init__(self)
        LoraConfig.__post_init__(self)
        check_field_types(self, RewardConfig)
        require(
            is_non_negative(self.margin),
            "margin",
            self.margin,
            ">= 0",
            "set 0.0 for the plain Bradley-Terry loss, or a positive reward gap such as 0.5",
        )
        require(
            is_non_negative(self.center_rewards_coefficient),
            "center_rewards_coefficient",
            self.center_rewards_coefficient,
            ">= 0",
            "set 0.0 to turn centering off, or a small weight such as 0.01",
        )
