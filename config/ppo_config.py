"""The composed run configuration: models + training + the policy-gradient algorithm itself
(PPO, GRPO and its loss variants, RLOO, REINFORCE++)."""

import copy
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from config._fields import (
    check_field_types,
    divisors,
    is_non_negative,
    is_positive,
    require,
    unknown_keys_message,
)
from config.agent_config import AgentConfig
from config.dpo_config import PreferenceLossType
from config.model_config import ModelConfig
from config.training_config import TrainingConfig
from algorithms.base import Algorithm as AlgorithmObject
from algorithms.registry import ALGORITHMS, get_algorithm

#: An algorithm's name: a key of :data:`algorithms.registry.ALGORITHMS`.
Algorithm = str
KLEstimator = Literal["k1", "k2", "k3"]
GRPOAdvantageScale = Literal["group", "batch", "none"]
RolloutLogprobs = Literal["sampling", "forward"]
LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo"]
ImportanceSamplingLevel = Literal["token", "sequence"]

# "package.module:function" or "path/to/file.py:function": a reward function; a plain word that
# is not a local directory: a reward of the registry (rewards/); anything else is a model.
_FUNCTION_SPEC = re.compile(r"^(?:[A-Za-z_][\w.]*|[^:]+\.py):[A-Za-z_]\w*$")
_REWARD_NAME = re.compile(r"^[A-Za-z_]\w*$")

#: A ``reward_funcs`` entry: a name or path, or ``{name: ..., <parameter>: ...}``.
RewardSpec = str | dict[str, Any]


def is_reward_function_spec(spec: RewardSpec) -> bool:
    """Whether a ``reward_funcs`` entry names a Python function rather than a reward model (a
    local directory or a Hugging Face repo id): an entry with parameters, a
    ``"package.module:function"`` or ``"path/to/file.py:function"``, or a plain word that is not
    a local directory (a reward of the registry, ``python main.py rewards``)."""
    if isinstance(spec, dict):
        return True
    spec = spec.strip()
    if _FUNCTION_SPEC.match(spec):
        return True
    return bool(_REWARD_NAME.match(spec)) and not Path(spec).is_dir()


def reward_func_name(spec: RewardSpec) -> str:
    """The name a ``reward_funcs`` entry is logged under (``rewards/<name>/mean``), as TRL names
    them: a function's or registered reward's name, or a model path's last component."""
    if isinstance(spec, dict):
        spec = str(spec.get("name", ""))
    spec = spec.strip()
    if _FUNCTION_SPEC.match(spec):
        return spec.rpartition(":")[2]
    return spec.rstrip("/\\").replace("\\", "/").rpartition("/")[2]


@dataclass(kw_only=True)
class PPOConfig(ModelConfig, TrainingConfig, AgentConfig):
    """Everything a PPO (or GRPO) RLHF run needs, as one flat set of keyword fields.

    Inherits every field of :class:`ModelConfig`, :class:`TrainingConfig` and
    :class:`AgentConfig` (tool calling); components receive
    only their part via :meth:`model_config` / :meth:`training_config`.

    Defaults follow "The N+ Implementation Details of RLHF with PPO: A Case Study on TL;DR
    Summarization" (Huang et al., 2024) where they apply: gamma 1, lam 0.95, 4 PPO epochs,
    kl_coef 0.05 (k1 estimator, fixed), sampling temperature 0.7, cliprange 0.2,
    cliprange_value 0.2, vf_coef 0.1, Adam eps 1e-5, whitened advantages and un-whitened rewards.
    An algorithm whose defaults differ (its object's ``defaults``, :mod:`algorithms`: GRPO takes
    TRL's) has them for every field the config is not given, however the config is built
    (Python, a config file, ``--set``, TRL's names): a setting means the same every way.

    KL estimators, with ``log_ratio = logp_policy - logp_ref`` per response token and
    ``r = exp(-log_ratio)`` (Schulman, "Approximating KL divergence"): k1 = log_ratio,
    k2 = log_ratio ** 2 / 2, k3 = (r - 1) - log r.

    Attributes:
        algorithm: "ppo" (clipped PPO with a learned value model and GAE); "grpo" (group-relative
            advantages from group_size samples per prompt, no value model); "rloo" (TRL's RLOO:
            the summed KL in the sequence reward, a leave-one-out baseline over the group, a
            clipped sequence-level loss); "reinforce_pp" (REINFORCE++: per-token KL in the
            reward, discounted returns whitened over the batch, the clipped PPO loss, no value
            model); "reinforce_pp_baseline" (REINFORCE++-baseline: the group's mean score
            subtracted first); "distill" (on-policy distillation from teacher_model_name: the
            per-token reverse KL to the teacher); "gkd" (TRL's GKD: the generalized JSD to
            teacher_model_name over the vocabulary, on the student's samples or, a share 1 -
            lmbda of the steps, the data's completions); "online_dpo" (DPO's loss on two samples per
            prompt ranked by the reward). Each is an object of algorithms/ (its settings, defaults,
            advantages and loss), found by name in algorithms/registry.py. See
            docs/algorithms.md.
        max_new_tokens: Most tokens generated per response.
        max_prompt_length: Most tokens in a prompt.
        use_chat_template: Whether a plain-text prompt goes through the tokenizer's chat template
            (as one user message, ending with the assistant's header) before generation: "auto"
            = when the tokenizer has one, the rule of mlx_lm.generate and of this package's
            generate and chat commands, so that training and generation agree; false = the text
            as it is (models trained on plain prompts, like the demo's); true = required. Chat
            messages always use it; a trainer that overrides format_prompt decides itself.
        temperature: Sampling temperature of the rollouts (> 0). GRPO's default: TRL's 1.0.
        top_p: Nucleus-sampling mass of the rollouts, in (0, 1]; 1 = off.
        top_k: Sample among the k most likely tokens; 0 = off.
        stop_token_ids: Token ids that end a response; None = the tokenizer's EOS ids (those of
            config.json and generation_config.json, plus the chat template's end-of-turn token);
            [] = never stop before max_new_tokens.
        chat_template_kwargs: Variables passed to the chat template with chat prompts (messages),
            as apply_chat_template's keyword arguments, e.g. {enable_thinking: false} for
            Qwen3 (thinking off); None = none.
        system_prompt: A system message put first in every chat prompt that has none; None =
            none. Plain-text prompts are used as they are.
        stop_strings: Strings that end a response, as transformers' generate(stop_strings=...):
            a response stops at the token that completes the first of them; the stop string
            stays in the completion the reward reads (any text after it in that token is cut),
            and the tokens up to it are trained as a stop token is. vLLM drops it unless
            include_stop_str_in_output; here it is kept, so a format reward can see it. None
            = only stop_token_ids stop. With tools or an environment, a stop string ends the
            current turn as the end-of-turn token does (e.g. "</tool_call>"). Not with
            async_rollout.
        rollout_logprobs: Where the rollout policy's log-probs (PPO's "old" log-probs, and the
            KL's policy side) come from: "sampling" keeps those the sampler computed from the
            same logits, the same function of the same weights, saving one forward pass of the
            policy per iteration; "forward" recomputes them with a forward pass over the whole
            sequences. They agree to float rounding (about 1e-6; tests check 1e-4).
        merge_adapters_for_sampling: Whether a LoRA policy on a float32 base samples with each
            adapter merged into its layer's weight (W + scale * B^T A^T: one matmul per layer
            and decoding step instead of three) at the cost of a merged copy of every adapted
            weight while sampling (as much memory as those base weights). "auto" = merge where
            it pays and the copy is small: the adapted matrices average at most 4 MiB (small
            layers, where the adapter's two extra products are a large share of a layer's
            cost; SmolLM2-135M's average 1.9 MiB, Qwen3-0.6B's 8.6 MiB) and the copy is at
            most an eighth of MLX's memory limit; true = always; false = never (the plain LoRA
            forward). Both sample the same function to float32 rounding. No effect under
            plain_mlx or on a GPU (never merged there), nor without LoRA. The measurements
            behind the rule are in docs/performance.md.
        async_rollout: Overlap generation with the update, one step off-policy (asynchronous
            RLHF, Noukhovitch et al. 2024): a second process generates batch k+1 with the
            policy of before update k while the trainer scores and updates batch k; PPO's ratio
            against those behaviour log-probs corrects for the lag. The first step (and the
            first after a resume) generates synchronously. Needs rollout_logprobs "sampling"
            and one process (no data parallelism); the worker holds a second copy of the
            policy. Whether it pays depends on the model and the cores (docs/performance.md).
        kl_coef: Weight of the KL penalty in the reward, reward - kl_coef * kl, per token for
            "ppo" and "reinforce_pp*", summed over the response for "rloo" (TRL's RLOO beta);
            the initial value when adaptive_kl is on. Unused by "grpo" (see beta).
        kl_estimator: Per-token KL estimator of that reward penalty: "k1", "k2" or "k3".
        adaptive_kl: Adapt kl_coef towards kl_target (Ziegler et al., 2019) instead of keeping it
            fixed.
        kl_target: Target sequence KL (nats) of the adaptive controller.
        kl_horizon: Horizon (in rollout sequences) of the adaptive controller.
        gamma: Discount factor, in [0, 1].
        lam: GAE lambda, in [0, 1].
        clip_epsilon: PPO's policy-ratio clip range (the paper's epsilon, TRL's cliprange); also
            readable as ``cliprange``. The lower one when clip_epsilon_high is set.
        clip_epsilon_high: Upper clip range of the policy ratio, which is clipped to
            [1 - clip_epsilon, 1 + clip_epsilon_high] (DAPO's clip-higher; the paper uses 0.28;
            TRL's epsilon_high); None = clip_epsilon (symmetric). Every algorithm.
        cliprange_value: Clip range of the value-function update around the rollout values.
        vf_coef: Weight of the value loss in the PPO loss (> 0 for "ppo"; unused by "grpo").
        num_ppo_epochs: Optimisation passes over each rollout batch (TRL's num_iterations).
            GRPO's default: TRL's 1.
        whiten_rewards: Whiten the per-token rewards over the batch before computing advantages.
        whiten_advantages: Whiten the advantages over the batch (PPO).
        normalize_reward: Normalise the scores by their running mean and standard deviation
            over every batch so far, (score - mean) / std, before they make rewards and
            advantages (OpenRLHF's normalize_reward, TRL's use_score_norm): learning then does
            not depend on the reward's scale or offset. The statistics are checkpointed;
            metrics report the raw scores. Every algorithm. "auto" (the default) = on for
            "ppo" when its value model starts with a fresh head (value_init "policy" or
            "shared", or "reward" with no reward model to start from, as with reward
            functions), off otherwise (a value model started from the reward model predicts
            the reward's own scale, as in TRL; group advantages are already relative). Why:
            docs/algorithms.md, "PPO and the reward's offset". :attr:`normalizes_reward` is
            the resolved setting.
        value_warmup_steps: Steps at the start of a PPO run in which only the value model
            trains (the policy keeps its weights), so that its values catch up with the returns
            before they shape the policy's advantages; 0 = none. "ppo" only.
        missing_eos_penalty: Subtracted from the score of a response that ends without a stop
            token (>= 0); None = no penalty.
        reward_funcs: Several rewards, summed with reward_weights (TRL's GRPO reward_funcs): each
            entry a built-in reward by name (math_accuracy, think_format, ...: ``python main.py
            rewards`` lists them and the record columns they read), a Python function
            "package.module:function" or "path/to/file.py:function" (prompts, completions,
            **columns) -> list[float | None] (None where it does not apply), a reward model
            (local directory or repo id), or a reward with parameters ({name: soft_overlong,
            max_length: 512, cache: 64}). Each is logged as rewards/<name>/mean and /std, name
            = the reward's or function's name or the model path's last component. None = the
            single reward of reward_model_name or the trainer's reward function.
        reward_weights: Weight of each of reward_funcs, in order (finite, not all 0); None = 1.0
            each.
        group_size: Responses sampled per prompt; "grpo", "rloo" and "reinforce_pp_baseline"
            need >= 2.
        beta: Weight of GRPO's k3 KL term in its loss (>= 0; TRL's beta). 0 loads and runs no
            reference model. GRPO's default: TRL's 0. "online_dpo": DPO's beta (TRL's 0.1).
            "gkd": the generalized JSD's beta, in [0, 1] (0 = forward KL(teacher || student),
            1 = reverse KL(student || teacher); TRL's GKD default 0.5).
        lmbda: "gkd" only: the share of steps whose completions are the student's own samples
            (TRL's lmbda, default 0.5); the other steps train on the data's completions (prompt
            records with a "completion" column, or chat messages whose last turn is the
            assistant's: docs/learning_from_models.md). Which a step takes is drawn from (seed,
            step), so a resumed run draws the same. In [0, 1]; below 1 every training prompt
            needs its completion.
        reward_coef: "distill" and "gkd": the weight of the verifiable reward's score beside the
            teacher's signal ("distill": each token's advantage is -kl_coef * (log pi - log
            pi_teacher) + reward_coef * score; "gkd": the loss adds reward_coef times the
            clipped policy-gradient loss with the score as every token's advantage). The scores
            are those of reward_funcs (each weighted by reward_weights), reward_model_name or
            the trainer's reward; without a reward they are 0 and it does nothing.
        grpo_advantage_scale: GRPO advantage = (score - group mean) / std, with std over the
            "group", over the whole "batch", or "none" (no division, Dr. GRPO).
        loss_type: How GRPO's per-token losses make the loss (TRL's loss_type): "bnpo" = token
            mean of each micro-batch (the behaviour before the option existed; TRL's "bnpo" on
            one process), "dapo" = token mean of the whole batch of an update (TRL's default),
            "grpo" = mean over sequences of each one's token mean (the GRPO paper), "dr_grpo" =
            token sum / (sequences * max_new_tokens) (Dr. GRPO; pair with grpo_advantage_scale
            "none"). GRPO's default: TRL's "dapo". For "online_dpo", DPO's loss on each pair
            (as the dpo stage's loss_type): "sigmoid" (DPO; its default), "ipo" (on per-token
            averaged log-ratios) or "hinge" (SLiC). "grpo" and "online_dpo" only.
        importance_sampling_level: "token" (one ratio per token) or "sequence" (GSPO: one ratio
            per response, exp of its mean token log-ratio; pair with loss_type "grpo"). "grpo"
            algorithm only.
        entropy_coef: Weight of an entropy bonus in the policy loss, loss - entropy_coef * (token
            mean of the current policy's entropy) (OpenRLHF's entropy_loss_coef); 0 = off.
            Every algorithm.
        think_loss_weight: Weight of each token of a think block (``<think>`` ... ``</think>``,
            both tags included; a completion whose prompt opened the block, as Qwen3's and R1's
            templates do, starts inside it) in the policy loss; it multiplies the token's loss
            before the loss's normalisation, whose denominators still count every action token
            (docs/algorithms.md says how, per loss_type). 1.0 = the plain loss. Needs a model
            whose vocabulary, chat template or system_prompt has the ``<think>`` tag. Every
            algorithm.
        answer_loss_weight: The same weight for every other action token (the answer after the
            think block). 1.0 = the plain loss.
        top_entropy_quantile: Train only on the highest-entropy tokens (the 80/20 paper;
            TRL's option and meaning): tokens whose entropy under the current policy is below
            the (1 - top_entropy_quantile) quantile of the micro-batch's action tokens get
            weight 0 in the policy loss. 1.0 = every token (off); 0.2 = the top 20%. In (0, 1];
            every algorithm.
        sft_coef: Weight of a supervised loss mixed into every policy update (OpenRLHF's
            ptx_coef): policy loss + sft_coef * NLL, the token-mean cross-entropy of the
            completions of one batch of sft_data examples (the next in a shuffled pass over the
            file; a resumed run continues where it stopped). Keeps the policy close to
            demonstrations (e.g. the answer format) while RL trains it. 0 = off; > 0 needs
            sft_data.
        sft_data: The SFT records mixed in with sft_coef: a JSONL file or Hub dataset in the
            format of the sft command (prompt/completion, or messages), truncated to
            max_prompt_length + max_new_tokens tokens.
        sft_batch_size: SFT examples per policy update; None = micro_batch_size (one more
            forward and backward pass of a micro-batch's size per update).
        mask_truncated_completions: Leave responses that hit max_new_tokens without a stop
            token out of the policy loss (DAPO; TRL's option); their scores still enter the
            group statistics. Not for "ppo" (its value model trains on every token).
        dynamic_sampling: Drop the groups whose group_size scores are all equal (their
            advantages are 0: they teach nothing) and refill the batch with groups of the next
            prompts, generating further batches of batch_size prompts (DAPO's dynamic sampling,
            verl's filter_groups). A batch still short after max_num_gen_batches is completed
            with dropped groups, with a warning. Group algorithms only; one process, not with
            async_rollout.
        max_num_gen_batches: Most generation batches per step with dynamic_sampling, the first
            included (verl's filter_groups.max_num_gen_batches; >= 1).
        eval_temperature: Sampling temperature at evaluation; 0 = greedy.
        eval_max_new_tokens: Most tokens generated per evaluation response; None = max_new_tokens.
        log_rollouts_every: Steps between rollout records (rollouts/step_NNNNNN.jsonl in
            output_dir, per token: log-probs, KL, entropy, value, reward, advantage, return),
            written also at the first and last steps and at each evaluation;
            ``python main.py inspect RUN`` renders them as a page; 0 = no records.
        rollout_records_per_step: Most responses recorded per step (spread over the batch, whole
            groups when group_size > 1); each is kept whole (at most max_new_tokens tokens).
    """

    algorithm: Algorithm = "ppo"
    max_new_tokens: int = 64
    max_prompt_length: int = 512
    use_chat_template: bool | Literal["auto"] = "auto"
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: list[int] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    system_prompt: str | None = None
    stop_strings: list[str] | None = None
    rollout_logprobs: RolloutLogprobs = "sampling"
    merge_adapters_for_sampling: bool | Literal["auto"] = "auto"
    async_rollout: bool = False
    kl_coef: float = 0.05
    kl_estimator: KLEstimator = "k1"
    adaptive_kl: bool = False
    kl_target: float = 6.0
    kl_horizon: int = 10000
    gamma: float = 1.0
    lam: float = 0.95
    clip_epsilon: float = 0.2
    clip_epsilon_high: float | None = None
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    num_ppo_epochs: int = 4
    whiten_rewards: bool = False
    whiten_advantages: bool = True
    normalize_reward: bool | Literal["auto"] = "auto"
    value_warmup_steps: int = 0
    missing_eos_penalty: float | None = None
    reward_funcs: list[RewardSpec] | None = None
    reward_weights: list[float] | None = None
    group_size: int = 1
    beta: float = 0.04
    lmbda: float = 0.5
    reward_coef: float = 1.0
    grpo_advantage_scale: GRPOAdvantageScale = "group"
    loss_type: LossType | PreferenceLossType = "bnpo"
    importance_sampling_level: ImportanceSamplingLevel = "token"
    mask_truncated_completions: bool = False
    dynamic_sampling: bool = False
    max_num_gen_batches: int = 10
    entropy_coef: float = 0.0
    think_loss_weight: float = 1.0
    answer_loss_weight: float = 1.0
    top_entropy_quantile: float = 1.0
    sft_coef: float = 0.0
    sft_data: str | None = None
    sft_batch_size: int | None = None
    eval_temperature: float = 0.0
    eval_max_new_tokens: int | None = None
    log_rollouts_every: int = 10
    rollout_records_per_step: int = 16

    def __new__(cls, *args: Any, **values: Any) -> "PPOConfig":
        unknown = [key for key in values if key not in _init_fields(cls)]
        if unknown:  # a typo: the CLI's "did you mean" rather than a bare TypeError
            raise TypeError(unknown_keys_message(cls.__name__, unknown, _init_fields(cls)))
        config = super().__new__(cls)
        # The fields the caller gave; __post_init__ gives the others their algorithm's defaults.
        config.__dict__["_given_fields"] = frozenset(values)
        return config

    def __post_init__(self) -> None:
        given = self.__dict__.get("_given_fields", frozenset())
        for name, value in get_algorithm(self.algorithm).defaults.items():
            if name not in given:
                setattr(self, name, value)
        ModelConfig.__post_init__(self)
        TrainingConfig.__post_init__(self)
        AgentConfig.__post_init__(self)
        check_field_types(self, PPOConfig)
        self._check_generation()
        self._check_algorithm()
        self._check_algorithm_options()
        self._check_rewards()
        self._check_batch_split()
        self._check_rollout_records()

    def _check_generation(self) -> None:
        require(
            self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, ">= 1", "set e.g. 64"
        )
        require(
            self.max_prompt_length >= 1,
            "max_prompt_length",
            self.max_prompt_length,
            ">= 1",
            "set e.g. 512",
        )
        require(
            is_positive(self.temperature),
            "temperature",
            self.temperature,
            "> 0",
            "set a positive sampling temperature such as 0.7 (greedy rollouts do not explore)",
        )
        require(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]", "set 1.0 to turn it off")
        require(self.top_k >= 0, "top_k", self.top_k, ">= 0", "set 0 to turn it off")
        if self.stop_token_ids is not None:
            require(
                all(t >= 0 for t in self.stop_token_ids),
                "stop_token_ids",
                self.stop_token_ids,
                "a list of non-negative token ids or null",
                "list valid token ids, or null for the tokenizer's EOS",
            )
        require(
            is_non_negative(self.eval_temperature),
            "eval_temperature",
            self.eval_temperature,
            ">= 0",
            "set 0.0 for greedy evaluation or a positive temperature",
        )
        if self.eval_max_new_tokens is not None:
            require(
                self.eval_max_new_tokens >= 1,
                "eval_max_new_tokens",
                self.eval_max_new_tokens,
                ">= 1 or null",
                "set a positive number of tokens, or null to use max_new_tokens",
            )
        if self.stop_strings is not None:
            require(
                all(isinstance(s, str) and s for s in self.stop_strings),
                "stop_strings",
                self.stop_strings,
                "a list of non-empty strings or null",
                'list the strings that end a response, e.g. ["</answer>"], or null for none',
            )
            require(
                not self.async_rollout,
                "stop_strings",
                self.stop_strings,
                "null when async_rollout is on",
                "the generation worker stops at stop_token_ids only: set async_rollout: false",
            )
        if self.async_rollout:
            require(
                self.rollout_logprobs == "sampling",
                "rollout_logprobs",
                self.rollout_logprobs,
                '"sampling" when async_rollout is on',
                "a forward pass would take the old log-probs from the updated policy, not the "
                "one that generated the batch, and PPO's ratio would no longer correct for the "
                "lag: set rollout_logprobs: sampling, or async_rollout: false",
            )

    def _check_algorithm(self) -> None:
        require(
            is_non_negative(self.kl_coef),
            "kl_coef",
            self.kl_coef,
            ">= 0",
            "set e.g. 0.05, or 0.0 for no KL penalty",
        )
        require(is_positive(self.kl_target), "kl_target", self.kl_target, "> 0", "set e.g. 6.0")
        require(self.kl_horizon >= 1, "kl_horizon", self.kl_horizon, ">= 1", "set e.g. 10000")
        require(0.0 <= self.gamma <= 1.0, "gamma", self.gamma, "in [0, 1]", "set e.g. 1.0")
        require(0.0 <= self.lam <= 1.0, "lam", self.lam, "in [0, 1]", "set e.g. 0.95")
        require(
            is_positive(self.clip_epsilon),
            "clip_epsilon",
            self.clip_epsilon,
            "> 0",
            "set e.g. 0.2",
        )
        require(
            is_positive(self.cliprange_value),
            "cliprange_value",
            self.cliprange_value,
            "> 0",
            "set e.g. 0.2",
        )
        algorithm = self.algorithm_object
        if algorithm.value_model:
            require(
                is_positive(self.vf_coef),
                "vf_coef",
                self.vf_coef,
                f'> 0 when algorithm is "{self.algorithm}"',
                "set e.g. 0.1 (with 0 the value model never learns and GAE is meaningless)",
            )
        else:
            require(is_non_negative(self.vf_coef), "vf_coef", self.vf_coef, ">= 0", "set e.g. 0.1")
        require(
            self.num_ppo_epochs >= 1, "num_ppo_epochs", self.num_ppo_epochs, ">= 1", "set e.g. 4"
        )
        require(
            self.value_warmup_steps >= 0,
            "value_warmup_steps",
            self.value_warmup_steps,
            ">= 0",
            "set the steps in which only the value model trains, or 0",
        )
        if self.teacher_model_name is not None and "teacher_model_name" not in algorithm.keys:
            raise ValueError(
                f"teacher_model_name is for on-policy distillation (algorithm: distill or gkd), "
                f"not {self.algorithm!r}: set algorithm: distill, or leave teacher_model_name "
                "unset (sft_model_name sets the reference of the KL penalty)"
            )
        if self.value_warmup_steps and not algorithm.value_model:
            raise ValueError(
                f"value_warmup_steps={self.value_warmup_steps} needs a value model: it is for "
                f'algorithm "ppo" ({self.algorithm!r} has none); set it to 0'
            )
        if self.missing_eos_penalty is not None:
            require(
                is_non_negative(self.missing_eos_penalty),
                "missing_eos_penalty",
                self.missing_eos_penalty,
                ">= 0 or null",
                "set the amount subtracted from the score (e.g. 1.0), or null for none",
            )
        require(self.group_size >= 1, "group_size", self.group_size, ">= 1", "set e.g. 1")
        if algorithm.grouped:
            require(
                self.group_size >= 2,
                "group_size",
                self.group_size,
                f'>= 2 when algorithm is "{self.algorithm}"',
                f"{self.algorithm} compares responses to the same prompt; set group_size to "
                f"e.g. 4",
            )
        require(is_non_negative(self.beta), "beta", self.beta, ">= 0", "set e.g. 0.04")
        require(
            is_non_negative(self.entropy_coef),
            "entropy_coef",
            self.entropy_coef,
            ">= 0",
            "set 0.0 for no entropy bonus, or a small weight such as 0.001",
        )
        self._check_loss_weights()
        algorithm.check(self)

    def _check_loss_weights(self) -> None:
        """The token weights and the mixed-in SFT loss (their data is loaded by the trainer)."""
        for name in ("think_loss_weight", "answer_loss_weight"):
            value = getattr(self, name)
            require(
                is_non_negative(value),
                name,
                value,
                ">= 0",
                "set a finite weight such as 0.5, or 1.0 for the plain loss",
            )
        require(
            0.0 < self.top_entropy_quantile <= 1.0,
            "top_entropy_quantile",
            self.top_entropy_quantile,
            "in (0, 1]",
            "set 1.0 to train on every token, or e.g. 0.2 for the top 20% by entropy",
        )
        require(
            is_non_negative(self.sft_coef),
            "sft_coef",
            self.sft_coef,
            ">= 0",
            "set 0.0 for no SFT loss, or a weight such as 0.05",
        )
        if self.sft_coef > 0:
            require(
                bool(self.sft_data),
                "sft_data",
                self.sft_data,
                "an SFT data file when sft_coef > 0",
                "set sft_data to a JSONL file of prompt/completion (or messages) records, as "
                "the sft command reads, or set sft_coef: 0",
            )
        elif self.sft_data is not None:
            raise ValueError(
                f"sft_data={self.sft_data!r} is set but sft_coef is 0, so it would never be "
                "read: set sft_coef > 0 (e.g. 0.05) to mix its SFT loss in, or remove sft_data"
            )
        if self.sft_batch_size is not None:
            require(
                self.sft_batch_size >= 1,
                "sft_batch_size",
                self.sft_batch_size,
                ">= 1 or null",
                "set the SFT examples per update, or null for micro_batch_size",
            )

    def _check_algorithm_options(self) -> None:
        """Options of one algorithm are refused with the others, where they would do nothing."""
        if self.clip_epsilon_high is not None:
            require(
                is_positive(self.clip_epsilon_high),
                "clip_epsilon_high",
                self.clip_epsilon_high,
                "> 0 or null",
                "set e.g. 0.28 (DAPO), or null to clip symmetrically with clip_epsilon",
            )
        keys = self.algorithm_object.keys
        if "loss_type" not in keys:
            require(
                self.loss_type == "bnpo",
                "loss_type",
                self.loss_type,
                f'"bnpo" (the default) when algorithm is "{self.algorithm}"',
                "loss_type chooses among GRPO's and online DPO's loss variants; set algorithm: "
                "grpo or online_dpo, or remove loss_type",
            )
        if "importance_sampling_level" not in keys:
            require(
                self.importance_sampling_level == "token",
                "importance_sampling_level",
                self.importance_sampling_level,
                f'"token" (the default) when algorithm is "{self.algorithm}"',
                "sequence-level ratios (GSPO) are a GRPO variant; set algorithm: grpo, or "
                "remove importance_sampling_level",
            )
        if "mask_truncated_completions" not in keys:
            require(
                not self.mask_truncated_completions,
                "mask_truncated_completions",
                self.mask_truncated_completions,
                f'false when algorithm is "{self.algorithm}"',
                f"{self.algorithm} trains on every response (PPO's value model learns from "
                "every token); use it with one of "
                f"{', '.join(n for n, a in ALGORITHMS.items() if 'mask_truncated_completions' in a.keys)}, or set "
                "missing_eos_penalty to discourage truncation",
            )
        for name, default, what in (
            ("lmbda", 0.5, "the share of gkd's batches sampled by the student"),
            ("reward_coef", 1.0, "the weight of a reward beside a distillation teacher"),
        ):
            if name not in keys:
                require(
                    getattr(self, name) == default,
                    name,
                    getattr(self, name),
                    f"{default} (the default) when algorithm is {self.algorithm!r}",
                    f"it is {what}; use it with one of "
                    f"{', '.join(n for n, a in ALGORITHMS.items() if name in a.keys)}, or remove "
                    f"{name}",
                )
        require(
            self.max_num_gen_batches >= 1,
            "max_num_gen_batches",
            self.max_num_gen_batches,
            ">= 1",
            "set the most generation batches per step, e.g. 10 (verl's 0, no bound, is not "
            "offered: a reward equal on every response would generate forever)",
        )
        if self.dynamic_sampling:
            grouped = [name for name, a in ALGORITHMS.items() if a.grouped]
            require(
                self.algorithm_object.grouped,
                "dynamic_sampling",
                self.dynamic_sampling,
                f"false when algorithm is {self.algorithm!r}",
                "it drops groups of responses to one prompt whose scores are all equal; use "
                f"it with one of {', '.join(grouped)}",
            )
            require(
                not self.async_rollout,
                "dynamic_sampling",
                self.dynamic_sampling,
                "false when async_rollout is on",
                "the worker generates the next batch before this one is filtered: set "
                "async_rollout: false",
            )

    def _check_rewards(self) -> None:
        if self.reward_funcs is None:
            require(
                self.reward_weights is None,
                "reward_weights",
                self.reward_weights,
                "null when reward_funcs is not set",
                "list the rewards in reward_funcs, one weight each, or remove reward_weights",
            )
            return
        require(
            len(self.reward_funcs) > 0
            and all(reward_func_name(spec) for spec in self.reward_funcs),
            "reward_funcs",
            self.reward_funcs,
            "null or a non-empty list of non-empty entries (an entry with parameters has a name)",
            'list reward names (python main.py rewards), "package.module:function" specs, '
            "reward model paths, or names with parameters such as {name: soft_overlong, "
            "max_length: 512, cache: 64}; or null for the single reward of reward_model_name",
        )
        require(
            self.reward_model_name is None,
            "reward_model_name",
            self.reward_model_name,
            "null when reward_funcs is set",
            "list the reward model in reward_funcs instead (value_model_name can still "
            "initialise the value model from it)",
        )
        names = self.reward_func_names
        repeated = sorted({name for name in names if names.count(name) > 1})
        require(
            not repeated,
            "reward_funcs",
            self.reward_funcs,
            f"entries with distinct names (the metrics rewards/<name>/...), but {repeated} repeat",
            "list each reward once and give it one weight in reward_weights",
        )
        if self.reward_weights is not None:
            require(
                len(self.reward_weights) == len(self.reward_funcs),
                "reward_weights",
                self.reward_weights,
                f"one weight per entry of reward_funcs ({len(self.reward_funcs)})",
                "give one weight per reward function, in the same order, or null for 1.0 each",
            )
            require(
                all(math.isfinite(w) for w in self.reward_weights)
                and any(w != 0 for w in self.reward_weights),
                "reward_weights",
                self.reward_weights,
                "finite numbers, not all 0",
                "set finite weights such as [1.0, 0.5]",
            )

    def _check_batch_split(self) -> None:
        rollout = self.rollout_batch_size
        if rollout % self.num_mini_batches != 0:
            raise ValueError(
                f"batch_size * group_size = {self.batch_size} * {self.group_size} = {rollout} "
                f"rollout sequences cannot be split into num_mini_batches={self.num_mini_batches}"
                f" equal minibatches: set num_mini_batches to one of {divisors(rollout)} or "
                f"change batch_size"
            )
        mini = rollout // self.num_mini_batches
        if mini % self.gradient_accumulation_steps != 0:
            raise ValueError(
                f"each minibatch has {rollout} / num_mini_batches={self.num_mini_batches} = {mini}"
                f" sequences, which cannot be split into gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps} equal micro-batches: set "
                f"gradient_accumulation_steps to one of {divisors(mini)} or change batch_size "
                f"or num_mini_batches"
            )

    def _check_rollout_records(self) -> None:
        require(
            self.log_rollouts_every >= 0,
            "log_rollouts_every",
            self.log_rollouts_every,
            ">= 0",
            "set the steps between rollout records (e.g. 10), or 0 to write none",
        )
        require(
            self.rollout_records_per_step >= 1,
            "rollout_records_per_step",
            self.rollout_records_per_step,
            ">= 1",
            "set how many responses to record per step (e.g. 16); log_rollouts_every=0 turns "
            "the records off",
        )

    @property
    def cliprange(self) -> float:
        """PPO's policy clip range (TRL / OpenAI name for ``clip_epsilon``)."""
        return self.clip_epsilon

    @property
    def normalizes_reward(self) -> bool:
        """``normalize_reward`` resolved: "auto" is on for PPO with a value model that starts
        with a fresh head (it predicts 0 whatever the reward's offset)."""
        if self.normalize_reward != "auto":
            return bool(self.normalize_reward)
        learns_values = self.algorithm_object.value_model
        return learns_values and self.value_source[0] in ("policy", "shared")

    @property
    def uses_reference_model(self) -> bool:
        """Whether the KL to the reference enters the run: ``beta > 0`` where it is a term of the
        loss ("grpo"), ``kl_coef > 0`` or ``adaptive_kl`` where it is in the reward (the others);
        always with a distillation teacher, which is the reference. Without it no reference
        model is loaded or run (TRL's ``beta: 0``), and the KL is measured against the rollout
        policy (0 at each rollout)."""
        if self.teacher_model_name is not None:
            return True  # distillation: the teacher is the reference
        if not self.algorithm_object.kl_in_reward:
            return self.beta > 0
        return self.kl_coef > 0 or self.adaptive_kl

    @property
    def algorithm_object(self) -> AlgorithmObject:
        """The algorithm ``algorithm`` names (:func:`algorithms.registry.get_algorithm`): its
        settings, advantages and loss."""
        return get_algorithm(self.algorithm)

    @property
    def reward_func_names(self) -> list[str]:
        """The name of each entry of ``reward_funcs`` (see :func:`reward_func_name`); [] when
        unset."""
        return [reward_func_name(spec) for spec in self.reward_funcs or []]

    @property
    def rollout_batch_size(self) -> int:
        """Sequences generated per PPO iteration: ``batch_size * group_size``."""
        return self.batch_size * self.group_size

    @property
    def mini_batch_size(self) -> int:
        """Sequences per optimiser update: ``rollout_batch_size // num_mini_batches``."""
        return self.rollout_batch_size // self.num_mini_batches

    @property
    def micro_batch_size(self) -> int:
        """Sequences per forward/backward pass: mini_batch_size // gradient_accumulation_steps."""
        return self.mini_batch_size // self.gradient_accumulation_steps

    @property
    def eval_tokens(self) -> int:
        """Most tokens per evaluation response: ``eval_max_new_tokens``, else ``max_new_tokens``."""
        if self.eval_max_new_tokens is not None:
            return self.eval_max_new_tokens
        return self.max_new_tokens

    def model_config(self) -> ModelConfig:
        """The :class:`ModelConfig` part of this config (a new, independent object)."""
        return ModelConfig(**_field_values(self, ModelConfig))

    def training_config(self) -> TrainingConfig:
        """The :class:`TrainingConfig` part of this config (a new, independent object)."""
        return TrainingConfig(**_field_values(self, TrainingConfig))


def _init_fields(cls: type) -> list[str]:
    return [f.name for f in fields(cls) if f.init]


def _field_values(obj: object, cls: type) -> dict[str, Any]:
    # deepcopy so that the part does not share list fields (lora_keys) with the whole.
    return {f.name: copy.deepcopy(getattr(obj, f.name)) for f in fields(cls)}
