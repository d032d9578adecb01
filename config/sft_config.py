"""The first stages of RLHF: what a supervised fine-tuning (SFT) run is.

:class:`FineTuneConfig` holds what the SFT and the reward-model trainers share (model, data,
optimisation, run length, checkpoints, logging); :class:`SFTConfig` adds LoRA. The reward trainer's
config is :class:`config.reward_config.RewardConfig`. Both build with ``load_config(path, overrides,
cls=SFTConfig)`` like the PPO config (flat YAML keys).
"""

import math
from dataclasses import dataclass

from config._fields import check_field_types, is_non_negative, is_positive, require
from config.model_config import Dtype
from config.training_config import Logger, LRScheduler


@dataclass(kw_only=True)
class FineTuneConfig:
    """Model, data, optimisation and bookkeeping of a supervised run (SFT or reward model).

    A "step" below is one optimiser update on ``batch_size`` examples (SFT: prompt/completion
    pairs or conversations; reward model: preference pairs).

    Attributes:
        model_name: Local directory or Hugging Face repo id of the causal LM to start from
            (required).
        dtype: Parameter dtype ("float32", "bfloat16" or "float16").
        fast_math: Run the model's SwiGLU, attention, RMSNorm and RoPE through the fast CPU
            functions of base_setup.fast_math (within float32 rounding of MLX's own; no effect
            on a GPU); false = mlx-lm's own layers. The environment variable
            PPO_MLX_FAST_MATH=0 turns them off whatever this says (docs/environment.md).
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
        learning_rate: Peak AdamW learning rate.
        batch_size: Examples per optimiser step.
        gradient_accumulation_steps: Micro-batches each step's batch is split into; the
            gradient is the same as for the whole batch (losses are weighted by their share of
            the batch's tokens or pairs), only peak memory shrinks.
        eval_batch_size: Examples per forward pass during evaluation; None = the micro-batch
            size (batch_size / gradient_accumulation_steps).
        max_grad_norm: Clip the global gradient norm to this value before each update; .inf
            (YAML) / float("inf") disables clipping.
        lr_scheduler: Learning-rate schedule after warm-up: "constant", "linear" decay to 0, or
            "cosine" decay to 0 over the run's steps.
        warmup_steps: Steps of linear warm-up from 0 to learning_rate; 0 = none.
        weight_decay: Decoupled (AdamW) weight decay; 0 = plain Adam.
        adam_eps: Adam epsilon.
        num_epochs: Passes over the training data.
        total_steps: Cap on the number of steps; None = num_epochs passes.
        bucket_window: Length bucketing: each epoch's shuffled examples are cut into windows of
            bucket_window * batch_size, sorted by length within a window and cut into batches
            (whose order is then shuffled), so a batch holds examples of similar length and
            little padding; 1 = plain shuffled batches.
        seed: Seed of the data order, the held-out split, dropout and any fresh weights; >= 0.
        output_dir: Directory for checkpoints, metrics.jsonl, training_curves.png and the final
            model (<output_dir>/model).
        save_every: Steps between checkpoints; 0 = save only at the end.
        keep_last_checkpoints: Number of most recent checkpoints kept on disk; 0 = keep all.
        eval_every: Steps between evaluations on the held-out data (also run before the first
            and after the last step); 0 = evaluate only at the end.
        log_with: Metrics backend besides metrics.jsonl: "none", "tensorboard" or "wandb".
        wandb_project: Weights & Biases project when log_with is "wandb"; None = wandb's default.
        progress_bar: Show a tqdm progress bar over the steps.
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
    learning_rate: float = 1e-5
    batch_size: int = 8
    gradient_accumulation_steps: int = 1
    eval_batch_size: int | None = None
    max_grad_norm: float = 1.0
    lr_scheduler: LRScheduler = "cosine"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_eps: float = 1e-8
    num_epochs: int = 1
    total_steps: int | None = None
    bucket_window: int = 32
    seed: int = 0
    output_dir: str = "runs/finetune"
    save_every: int = 0
    keep_last_checkpoints: int = 3
    eval_every: int = 0
    log_with: Logger = "none"
    wandb_project: str | None = None
    progress_bar: bool = True

    def __post_init__(self) -> None:
        check_field_types(self, FineTuneConfig)
        self._check_model_and_data()
        self._check_optimisation()
        self._check_bookkeeping()

    def _check_model_and_data(self) -> None:
        require(
            bool(self.model_name.strip()),
            "model_name",
            self.model_name,
            "a non-empty path or repo id",
            "set model_name to a local model directory or a Hugging Face repo id",
        )
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

    def _check_optimisation(self) -> None:
        require(
            is_positive(self.learning_rate),
            "learning_rate",
            self.learning_rate,
            "> 0",
            "set a positive learning rate such as 1e-5",
        )
        require(self.batch_size >= 1, "batch_size", self.batch_size, ">= 1", "set e.g. 8")
        require(
            self.gradient_accumulation_steps >= 1,
            "gradient_accumulation_steps",
            self.gradient_accumulation_steps,
            ">= 1",
            "set 1 for no accumulation",
        )
        if self.batch_size % self.gradient_accumulation_steps != 0:
            raise ValueError(
                f"batch_size={self.batch_size} cannot be split into gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps} equal micro-batches: set "
                f"gradient_accumulation_steps to one of {_divisors(self.batch_size)} or change "
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
            self.max_grad_norm > 0,  # inf allowed: no clipping; NaN fails
            "max_grad_norm",
            self.max_grad_norm,
            "> 0",
            "set e.g. 1.0, or .inf to disable clipping",
        )
        require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, ">= 0", "set 0 for none")
        require(
            is_non_negative(self.weight_decay),
            "weight_decay",
            self.weight_decay,
            ">= 0",
            "set 0.0 for none or a small value such as 0.01",
        )
        require(is_positive(self.adam_eps), "adam_eps", self.adam_eps, "> 0", "set e.g. 1e-8")
        require(self.num_epochs >= 1, "num_epochs", self.num_epochs, ">= 1", "set e.g. 1")
        if self.total_steps is not None:
            require(
                self.total_steps >= 1,
                "total_steps",
                self.total_steps,
                ">= 1 or null",
                "set a positive number of steps, or null to run num_epochs passes",
            )
            require(
                self.warmup_steps <= self.total_steps,
                "warmup_steps",
                self.warmup_steps,
                f"<= total_steps ({self.total_steps})",
                "shorten the warm-up or raise total_steps",
            )
        require(
            self.bucket_window >= 1,
            "bucket_window",
            self.bucket_window,
            ">= 1",
            "set e.g. 32, or 1 for plain shuffled batches",
        )

    def _check_bookkeeping(self) -> None:
        require(self.seed >= 0, "seed", self.seed, ">= 0", "use a non-negative seed")
        require(
            bool(self.output_dir.strip()),
            "output_dir",
            self.output_dir,
            "a non-empty path",
            "set a directory such as runs/sft",
        )
        require(
            self.save_every >= 0, "save_every", self.save_every, ">= 0", "set 0 to save at the end"
        )
        require(
            self.keep_last_checkpoints >= 0,
            "keep_last_checkpoints",
            self.keep_last_checkpoints,
            ">= 0",
            "set 0 to keep every checkpoint",
        )
        require(
            self.eval_every >= 0,
            "eval_every",
            self.eval_every,
            ">= 0",
            "set 0 to evaluate only at the end",
        )
        if self.wandb_project is not None:
            require(
                bool(self.wandb_project.strip()),
                "wandb_project",
                self.wandb_project,
                "a non-empty name or null",
                "set a project name, or null for wandb's default",
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

    @property
    def clips_gradients(self) -> bool:
        """Whether ``max_grad_norm`` is finite (clipping is on)."""
        return math.isfinite(self.max_grad_norm)


@dataclass(kw_only=True)
class SFTConfig(FineTuneConfig):
    """Supervised fine-tuning of the policy on demonstrations (the PPO policy's starting point).

    The loss is the cross-entropy of the completion tokens (and of assistant turns in chat data)
    only; prompt tokens are context. With LoRA the final model is saved with the adapters merged
    into the weights, so it loads like any model directory (as PPO's policy and reference).

    Attributes:
        use_lora: Train LoRA adapters instead of all weights; when False the lora_* fields are
            ignored.
        lora_r: LoRA rank.
        lora_alpha: LoRA alpha; the adapter output is scaled by lora_alpha / lora_r.
        lora_dropout: Dropout probability on the adapter input while training, in [0, 1).
        lora_layers: Number of last transformer blocks that get adapters; -1 = all blocks.
        lora_keys: Module paths inside a transformer block to adapt, e.g.
            ["self_attn.q_proj", "self_attn.v_proj"]; None = every linear layer of the block.
    """

    learning_rate: float = 2e-5
    output_dir: str = "runs/sft"
    use_lora: bool = False
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_layers: int = -1
    lora_keys: list[str] | None = None

    def __post_init__(self) -> None:
        FineTuneConfig.__post_init__(self)
        check_field_types(self, SFTConfig)
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
                "for every linear layer",
            )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
