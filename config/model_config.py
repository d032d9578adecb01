"""Which models a run uses and how they are adapted (policy, reference, reward, value; LoRA)."""

from dataclasses import dataclass
from typing import Literal

from config._fields import check_field_types, is_positive, require, require_model_name

Dtype = Literal["float32", "bfloat16", "float16"]
ValueInit = Literal["reward", "policy", "shared"]
ValueSource = Literal["value_model", "reward", "policy", "shared"]


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA adapters: low-rank updates of the linear layers, trained instead of all weights.

    Attributes:
        use_lora: Train LoRA adapters instead of all weights; when False the lora_* fields are
            ignored.
        lora_r: LoRA rank.
        lora_alpha: LoRA alpha; the adapter output is scaled by lora_alpha / lora_r (mlx-lm's
            ``scale``).
        lora_dropout: Dropout probability on the adapter input while training, in [0, 1); SFT
            and reward training only (PPO and GRPO run without dropout, as TRL's do).
        lora_layers: Number of last transformer blocks that get adapters; -1 = all blocks.
        lora_keys: Module paths inside a transformer block to adapt, e.g.
            ["self_attn.q_proj", "self_attn.v_proj"]; None = every linear layer of the block
            (mlx-lm's default set).
    """

    use_lora: bool = True
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_layers: int = -1
    lora_keys: list[str] | None = None

    def __post_init__(self) -> None:
        check_field_types(self, LoraConfig)
        if not self.use_lora:
            return
        require(self.lora_r >= 1, "lora_r", self.lora_r, ">= 1", "set a LoRA rank such as 8")
        require(
            is_positive(self.lora_alpha),
            "lora_alpha",
            self.lora_alpha,
            "> 0",
            "set a positive LoRA alpha such as 16 (scale = lora_alpha / lora_r)",
        )
        require(
            0.0 <= self.lora_dropout < 1.0,
            "lora_dropout",
            self.lora_dropout,
            "in [0, 1)",
            "set a dropout probability such as 0.0 or 0.05",
        )
        require(
            self.lora_layers == -1 or self.lora_layers >= 1,
            "lora_layers",
            self.lora_layers,
            "-1 (all blocks) or >= 1",
            "set the number of last blocks to adapt, or -1 for all (use_lora=false for none)",
        )
        if self.lora_keys is not None:
            require(
                len(self.lora_keys) > 0 and all(k.strip() for k in self.lora_keys),
                "lora_keys",
                self.lora_keys,
                "null or a non-empty list of non-empty module paths",
                'list module paths such as ["self_attn.q_proj", "self_attn.v_proj"], or null '
                "for mlx-lm's default set",
            )

    @property
    def lora_scale(self) -> float:
        """Scale of the LoRA update, ``lora_alpha / lora_r`` (mlx-lm's ``scale``)."""
        return self.lora_alpha / self.lora_r


@dataclass(kw_only=True)
class ModelConfig(LoraConfig):
    """The models of a PPO run (their LoRA adapters: :class:`LoraConfig`).

    Attributes:
        model_name: Local directory or Hugging Face repo id of the policy (required); the policy
            starts from these weights.
        sft_model_name: Local directory or repo id of the frozen reference (SFT) model that the KL
            penalty is measured against; None = the same weights as model_name.
        teacher_model_name: algorithm "distill": local directory or repo id of the frozen
            teacher (4-bit allowed; the same tokenizer as model_name), which takes the
            reference's place: the KL is measured against it.
        reward_model_name: Local directory or repo id of a *ForSequenceClassification checkpoint
            (one score per sequence); None = no reward model, so the trainer must be given a
            reward function.
        value_model_name: Local directory or repo id to initialise the value model from; None =
            decided by value_init.
        value_init: Where the value model starts when value_model_name is None: "reward" = the
            reward model's weights if there is a reward model, else the policy's backbone with a
            fresh scalar head; "policy" = always the policy's backbone with a fresh scalar head;
            "shared" = LoRA adapters of its own (the policy's lora_* settings) and a fresh head
            on the policy's frozen base weights, held once in memory for the policy, the
            reference and the value model (needs use_lora; the value optimiser holds only
            these adapters and the head).
        share_reward_base: Put the reward model's LoRA adapters and head (reward_model_name
            must be a reward adapter checkpoint, trained with use_lora: true on model_name's
            base) on the policy's frozen base weights instead of loading a second copy of the
            base: one copy serves the policy, the reference and the reward model, and the value
            model too with value_init: shared (value_init: reward would start a full-weight
            value model from the reward's weights, a copy of its own). The reward adapters stay
            frozen; the scores equal the reward model loaded on its own. Needs use_lora and
            reward_model_name.
        offload_frozen_models: Keep the frozen models that hold weights of their own (a
            reward model not on the policy's base, the reward_funcs' models, a reference or
            teacher that is a copy: full fine-tuning, sft_model_name, teacher_model_name) on
            disk outside the passes that use them, so that generation and the update do not
            hold them: each is written once to a hidden folder of output_dir and read again in
            every scoring phase (about a second per GB from the page cache; a teacher in GKD's
            loss at every optimiser step). The same results bit for bit. An error when the run
            has no such model.
        dtype: Parameter dtype of every model ("float32", "bfloat16" or "float16").
        fast_math: Run the models' SwiGLU, attention, RMSNorm and RoPE through the fast CPU
            functions of base_setup.fast_math (within float32 rounding of MLX's own; no effect
            on a GPU); false = mlx-lm's own layers. The environment variable
            PPO_MLX_FAST_MATH=0 turns them off whatever this says, as does plain_mlx
            (docs/environment.md).
    """

    model_name: str
    sft_model_name: str | None = None
    teacher_model_name: str | None = None
    reward_model_name: str | None = None
    value_model_name: str | None = None
    value_init: ValueInit = "reward"
    share_reward_base: bool = False
    offload_frozen_models: bool = False
    dtype: Dtype = "float32"
    fast_math: bool = True

    def __post_init__(self) -> None:
        LoraConfig.__post_init__(self)
        check_field_types(self, ModelConfig)
        require_model_name(self.model_name)
        for name in (
            "sft_model_name",
            "teacher_model_name",
            "reward_model_name",
            "value_model_name",
        ):
            value = getattr(self, name)
            require(
                value is None or bool(value.strip()),
                name,
                value,
                "a non-empty path or repo id, or null",
                f"set {name} to a model directory or repo id, or null to leave it unset",
            )
        if self.value_init == "shared":
            require(
                self.use_lora,
                "value_init",
                self.value_init,
                "not 'shared' when use_lora is false",
                "set use_lora: true (the shared base must stay frozen) or value_init: policy",
            )
            require(
                self.value_model_name is None,
                "value_model_name",
                self.value_model_name,
                "null with value_init: shared",
                "unset value_model_name, or choose another value_init",
            )

        if self.share_reward_base:
            require(
                self.use_lora,
                "share_reward_base",
                self.share_reward_base,
                "false when use_lora is false",
                "set use_lora: true (the shared base must stay frozen) or share_reward_base: false",
            )
            require(
                self.reward_model_name is not None,
                "share_reward_base",
                self.share_reward_base,
                "false without reward_model_name",
                "set reward_model_name to a reward adapter checkpoint (main.py reward with "
                "use_lora: true), or share_reward_base: false",
            )

    @property
    def ref_model_name(self) -> str:
        """Path or repo id of the reference model: ``teacher_model_name`` (distillation), else
        ``sft_model_name``, else ``model_name``."""
        if self.teacher_model_name is not None:
            return self.teacher_model_name
        return self.sft_model_name if self.sft_model_name is not None else self.model_name

    @property
    def value_source(self) -> tuple[ValueSource, str]:
        """Where the value model is initialised from, as ``(kind, path or repo id)``.

        ``("value_model", value_model_name)`` when that is set; otherwise, following
        ``value_init``, ``("reward", reward_model_name)`` if there is a reward model, else
        ``("policy", model_name)`` (the policy's backbone with a fresh scalar head);
        ``("shared", model_name)`` for adapters on the policy's own base.
        """
        if self.value_init == "shared":
            return "shared", self.model_name
        if self.value_model_name is not None:
            return "value_model", self.value_model_name
        if self.value_init == "reward" and self.reward_model_name is not None:
            return "reward", self.reward_model_name
        return "policy", self.model_name
