"""The first stages of RLHF: what a supervised fine-tuning (SFT) run is.

:class:`FineTuneConfig` holds what the SFT and the reward-model trainers share (model, data) on top
of the optimisation every trainer shares (:class:`config.training_config.OptimConfig`);
:class:`SFTConfig` adds LoRA (:class:`config.model_config.LoraConfig`). The reward trainer's config
is :class:`config.reward_config.RewardConfig`. Both build with ``load_config(path, overrides,
cls=SFTConfig)`` like the PPO config (flat YAML keys).
"""

from dataclasses import dataclass

from config._fields import check_field_types, divisors, require, require_model_name
from config.model_config import Dtype, LoraConfig
from config.training_config import LRScheduler, OptimConfig


@dataclass(kw_only=True)
class FineTuneConfig(OptimConfig):
    """Model and data of a supervised run (SFT or reward model); optimisation, run length and
    bookkeeping are :class:`OptimConfig`'s (a step is one optimiser update on ``batch_size``
    examples: SFT prompt/completion pairs or conversations, reward-model preference pairs).

    Attributes:
        model_name: Local directory or Hugging Face repo id of the causal LM to start from
            (required).
        dtype: Parameter dtype ("float32", "bfloat16" or "float16").
        fast_math: Run the model's SwiGLU, attention, RMSNorm and RoPE through the fast CPU
            functions of base_setup.fast_math (within float32 rounding of MLX's own; no effect
            on a GPU); false = mlx-lm's own layers. The environment variable
            PPO_MLX_FAST_MATH=0 turns them off whatever this says, as does plain_mlx
            (docs/environment.md).
        dataset: Training data: a local JSON Lines file, or a Hugging Face Hub dataset name
            (needs network or the datasets cache); None = the caller passes records to the
            trainer itself (run_sft / run_reward_training need it set).
        dataset_split: Split of a Hub dataset to read (a local file is one "train" split).
        eval_dataset: Held-out data (a JSONL file or Hub dataset name); None = hold out
            eval_fraction of the training data instead.
        eval_dataset_split: Split of a Hub eval_dataset to read.
        eval_fraction: Fraction of the training data held out for evaluation when eval_dataset
            is None (chosen with seed); 0 = no evaluation.
        max_length: Most tokens per sequence (prompt + completion + EOS). SFT truncates longer
            examples on the right; the reward trainer drops longer pairs.
        eval_batch_size: Examples per forward pass during evaluation; None = the micro-batch
            size (batch_size / gradient_accumulation_steps).
        bucket_window: Length bucketing: each epoch's shuffled examples are cut into windows of
            bucket_window * batch_size, sorted by length within a window and cut into batches
            (whose order is then shuffled), so a batch holds examples of similar length and
            little padding; 1 = plain shuffled batches.
    """

    model_name: str
    dtype: Dtype = "float32"
    fast_math: bool = True
    dataset: str | None = None
    dataset_split: str = "train"
    eval_dataset: str | None = None
    eval_dataset_split: str = "test"
    eval_fraction: float = 0.05
    max_length: int = 1024
    eval_batch_size: int | None = None
    bucket_window: int = 32
    # Defaults of supervised training that differ from PPO's.
    lr_scheduler: LRScheduler = "cosine"
    adam_eps: float = 1e-8
    output_dir: str = "runs/finetune"

    def __post_init__(self) -> None:
        OptimConfig.__post_init__(self)
        check_field_types(self, FineTuneConfig)
        require_model_name(self.model_name)
        for name in ("dataset", "eval_dataset"):
            value = getattr(self, name)
            require(
                value is None or bool(value.strip()),
                name,
                value,
                "a non-empty path or dataset name, or null",
                f"set {name} to a JSONL file or a Hugging Face dataset name, or null",
            )
        for name in ("dataset_split", "eval_dataset_split"):
            value = getattr(self, name)
            require(
                bool(value.strip()),
                name,
                value,
                "a non-empty split name",
                'set e.g. "train" or "test"',
            )
        require(
            0.0 <= self.eval_fraction < 1.0,
            "eval_fraction",
            self.eval_fraction,
            "in [0, 1)",
            "set e.g. 0.05 to hold out 5% of the data, or 0 for no evaluation",
        )
        require(self.max_length >= 2, "max_length", self.max_length, ">= 2", "set e.g. 1024")
        if self.batch_size % self.gradient_accumulation_steps != 0:
            raise ValueError(
                f"batch_size={self.batch_size} cannot be split into gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps} equal micro-batches: set "
                f"gradient_accumulation_steps to one of {divisors(self.batch_size)} or change "
                "batch_size"
            )
        if self.eval_batch_size is not None:
            require(
                self.eval_batch_size >= 1,
                "eval_batch_size",
                self.eval_batch_size,
                ">= 1 or null",
                "set e.g. 16, or null for the micro-batch size",
            )
        require(
            self.bucket_window >= 1,
            "bucket_window",
            self.bucket_window,
            ">= 1",
            "set e.g. 32, or 1 for plain shuffled batches",
        )

    @property
    def micro_batch_size(self) -> int:
        """Examples per forward/backward pass: ``batch_size // gradient_accumulation_steps``."""
        return self.batch_size // self.gradient_accumulation_steps

    @property
    def eval_micro_batch_size(self) -> int:
        """Examples per evaluation forward pass: ``eval_batch_size``, else the micro-batch size."""
        if self.eval_batch_size is not None:
            return self.eval_batch_size
        return self.micro_batch_size


@dataclass(kw_only=True)
class SFTConfig(FineTuneConfig, LoraConfig):
    """Supervised fine-tuning of the policy on demonstrations (the PPO policy's starting point).

    The loss is the cross-entropy of the completion tokens (and of assistant turns in chat data)
    only; prompt tokens are context. With LoRA (:class:`LoraConfig`; off by default here) the final
    model is saved with the adapters merged into the weights, so it loads like any model
    directory (as PPO's policy and reference).
    """

    learning_rate: float = 2e-5
    output_dir: str = "runs/sft"
    use_lora: bool = False

    def __post_init__(self) -> None:
        FineTuneConfig.__post_init__(self)
        LoraConfig.__post_init__(self)
        check_field_types(self, SFTConfig)
