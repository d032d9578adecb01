"""What an RL algorithm is to the rest of the package: one small protocol.

An algorithm owns its settings (which config keys apply to it, and its defaults where they
differ from the fields' own, which are PPO's), whether it learns a value model, where its KL
to the reference goes (the reward, weighted by ``kl_coef``, or the loss, weighted by ``beta``),
how it turns a rollout's scores into advantages and returns (calling the pure math of
``advantage/`` and ``reward_kl/``), and which policy loss the update uses. The trainer asks the
object; nothing branches on the algorithm's name.

The math is imported inside the methods: ``config/`` reads an algorithm's settings without
loading MLX (``python main.py config`` and a config check stay light).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import mlx.core as mx

    from base_setup.distributed import Group

#: The policy loss of an update: ``"token"`` the clipped surrogate on per-token advantages
#: (``training.policy_loss.ppo_policy_loss``), ``"grpo"`` GRPO's loss with its k3 KL term,
#: ``loss_type`` and ``importance_sampling_level`` (``grpo_policy_loss``), ``"sequence"`` the
#: clipped whole-sequence ratio averaged over sequences (``rloo_policy_loss``), ``"gkd"`` the
#: generalized JSD to the teacher over the whole vocabulary (``beta``, ``temperature``;
#: ``training.distillation_loss.chunked_generalized_jsd``) plus the clipped surrogate on the
#: score's token advantages.
PolicyLoss = Literal["token", "grpo", "sequence", "gkd"]


@dataclass(frozen=True)
class AdvantageInputs:
    """What an algorithm's advantages are made from: arrays of one rollout batch (constants:
    nothing is differentiated through them) and the run's current KL weight.

    Attributes:
        scores: (B,) sequence scores, after ``missing_eos_penalty``, per-action rewards summed
            in (sequence-level algorithms) and ``normalize_reward``.
        kl: (B, T) per-token KL to the reference, 0 after each response.
        rewards: (B, T) per-token rewards, ``-coef * kl`` plus the score at each response's last
            token (and per-action rewards at each turn's last token, for a value model).
        mask: (B, T) 1 on the policy's action tokens.
        values: (B, T) the value model's predictions, or None without a value model.
        kl_coef: the KL weight in the reward (the controller's current value).
        group: the data-parallel group whose global batch the statistics span (None: one
            process).
        log_ratio: (B, T) ``log pi_rollout - log pi_ref`` at the sampled tokens, 0 after each
            response (None: not given).
        logprobs: (B, T) the rollout policy's log-probs at the sampled tokens (None: not given).
        ended_with_stop: (B,) whether each response ended with a stop token (None: not given).
    """

    scores: mx.array
    kl: mx.array
    rewards: mx.array
    mask: mx.array
    values: mx.array | None
    kl_coef: float
    group: Group | None = None
    log_ratio: mx.array | None = None
    logprobs: mx.array | None = None
    ended_with_stop: mx.array | None = None


class AdvantageSettings(Protocol):
    """The run's settings an algorithm's advantages may read (``ExperienceSettings``)."""

    @property
    def gamma(self) -> float: ...

    @property
    def lam(self) -> float: ...

    @property
    def whiten_rewards(self) -> bool: ...

    @property
    def whiten_advantages(self) -> bool: ...

    @property
    def group_size(self) -> int: ...

    @property
    def grpo_advantage_scale(self) -> str: ...

    @property
    def beta(self) -> float: ...

    @property
    def loss_type(self) -> str: ...

    @property
    def reward_coef(self) -> float: ...


class Algorithm(Protocol):
    """One RL algorithm: its settings and its part of phases 4-5 of an iteration.

    Attributes:
        name: the config's ``algorithm`` value.
        title: what logs and docs call it ("GRPO").
        defaults: its defaults for config fields, where they differ from the fields' own
            (PPO's); a config takes them for every field it is not given, however it is built.
        keys: the config keys that apply to it among those that apply to only some algorithms
            (a key no algorithm lists applies to every one). ``python main.py config --kind
            <name>`` prints the others and these.
        value_model: whether it learns a value model (GAE advantages, the value loss); its
            per-action rewards then land on each turn's last token, else they add to the score.
        kl_in_reward: whether its KL to the reference is a penalty in the reward (``kl_coef``,
            the ``kl_estimator``, the adaptive controller) rather than a term of its loss
            (``beta``, k3).
        grouped: whether it compares the ``group_size`` (>= 2) responses to each prompt.
        policy_loss: the policy loss of its update (:data:`PolicyLoss`).
    """

    name: str
    title: str
    defaults: Mapping[str, Any]
    keys: frozenset[str]
    value_model: bool
    kl_in_reward: bool
    grouped: bool
    policy_loss: PolicyLoss

    def check(self, config: Any) -> None:
        """Raise ``ValueError`` saying what to change if ``config`` (a ``PPOConfig``) sets
        something this algorithm cannot run with; the checks every algorithm shares (keys,
        ``group_size`` of a group algorithm, ``vf_coef`` of a value model) are the config's."""
        ...

    def advantages(
        self, x: AdvantageInputs, settings: AdvantageSettings
    ) -> tuple[mx.array, mx.array | None]:
        """``(advantages, returns)``: advantages (B,) per sequence or (B, T) per token;
        returns (B, T) where the algorithm has them (the value model's targets), else None."""
        ...


@runtime_checkable
class AlgorithmMetrics(Protocol):
    """What an algorithm may add (most do not): ``metrics(x, settings)``, its own metrics of
    the batch, scalars logged with the step's (online DPO's pairs under TRL's names)."""

    def metrics(self, x: AdvantageInputs, settings: AdvantageSettings) -> dict[str, mx.array]:
        """The algorithm's metrics of the batch, named scalars."""
        ...


#: The keys that concern the KL penalty in the reward (``kl_in_reward`` algorithms).
KL_REWARD_KEYS: frozenset[str] = frozenset(
    {"kl_coef", "kl_estimator", "adaptive_kl", "kl_target", "kl_horizon"}
)
#: The keys of the group algorithms' options (DAPO's).
GROUP_KEYS: frozenset[str] = frozenset(
    {"mask_truncated_completions", "dynamic_sampling", "max_num_gen_batches"}
)
