"""How a run optimises, for how long, and where it writes (checkpoints, logs).

:class:`OptimConfig` is what every trainer of this project shares (SFT, reward model, PPO);
:class:`TrainingConfig` adds what only PPO has (a value model's learning rate, minibatches of a
rollout).
"""

import math
from dataclasses import dataclass
from typing import Literal

from config._fields import check_field_types, is_non_negative, is_positive, require

LRScheduler = Literal["constant", "linear", "cosine"]
Logger = Literal["none", "tensorboard", "wandb"]


@dataclass(kw_only=True)
class OptimConfig:
    """Optimisation, run length, checkpointing and logging, as every trainer reads them.

    A "step" is one optimiser update on ``batch_size`` examples for SFT and reward training, and
    one PPO iteration (generate ``batch_size`` prompts' rollouts, then the PPO epochs over them)
    for PPO.

    Attributes:
        learning_rate: AdamW learning rate (peak value when a schedule is used).
        batch_size: Examples per step. PPO / GRPO: prompts per iteration, each sampled
            group_size times, so an iteration has batch_size * group_size completions (TRL's
            GRPO counts completions: its batch of 16 with num_generations 4 is batch_size 4,
            group_size 4 here).
        gradient_accumulation_steps: Micro-batches each batch (PPO: each minibatch) is split
            into; their gradients are accumulated before the one update (same update, less
            memory).
        gradient_checkpointing: Recompute each transformer block's activations in the backward
            pass instead of keeping them (transformers' / TRL's option of that name): a
            training step then holds one block's activations at a time, for about one more
            forward pass of compute. Applies to the models a run trains (PPO: policy and value
            model). Same gradients.
        max_grad_norm: Clip the global gradient norm to this value before each update; must be
            > 0; .inf (YAML) / float("inf") disables clipping.
        lr_scheduler: Learning-rate schedule after warm-up: "constant", "linear" decay to 0, or
            "cosine" decay to 0, over the run's steps.
        warmup_steps: Steps of linear warm-up from 0 to the learning rate; 0 = none.
        weight_decay: Decoupled (AdamW) weight decay; 0 = plain Adam.
        adam_eps: Adam epsilon.
        adam_bias_correction: Divide Adam's moment estimates by (1 - beta^t) (bias correction), as
            PyTorch's torch.optim.AdamW does and as the learning rates of TRL and published
            PPO/GRPO/SFT recipes assume. MLX's AdamW does not by default, which makes its first
            updates several times larger; false restores that (this project's behaviour before
            the option existed).
        num_epochs: Passes over the training data (PPO: over the prompts).
        total_steps: Cap on the number of steps; None = num_epochs passes.
        seed: Seed of every random generator (data order, sampling, dropout, fresh weights);
            >= 0.
        output_dir: Directory for checkpoints, the saved config, metrics.jsonl and the curves.
        overwrite_output_dir: Let a fresh run replace an earlier run's files in output_dir
            (checkpoints, metrics, final model); False = refuse a folder that holds a run
            (resume it with --resume latest instead).
        save_every: Steps between checkpoints; 0 = save only at the end.
        keep_last_checkpoints: Number of most recent checkpoints kept on disk; 0 = keep all.
        eval_every: Steps between evaluations on held-out data; 0 = no periodic evaluation
            (SFT and reward training still evaluate after the last step).
        log_with: Metrics backend besides metrics.jsonl: "none", "tensorboard" or "wandb".
        wandb_project: Weights & Biases project when log_with is "wandb"; None = wandb's default.
        progress_bar: Show a tqdm progress bar over the steps.
        plain_mlx: Run on plain MLX: every speed trick of this project off at once (fast CPU
            math and layers, compiled AdamW, blockwise LM-head log-probs, merged sampling
            adapters, CPU streams, the buffer-cache policy, the adaptive BLAS threads), for
            the trainer's work; the same results within float rounding. The environment
            variable PPO_MLX_PLAIN=1 does the same for the whole process (docs/environment.md,
            "Speed tricks and how to turn them off").
    """

    learning_rate: float = 1e-5
    batch_size: int = 8
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = False
    max_grad_norm: float = 1.0
    lr_scheduler: LRScheduler = "linear"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_eps: float = 1e-5
    adam_bias_correction: bool = True
    num_epochs: int = 1
    total_steps: int | None = None
    seed: int = 0
    output_dir: str = "runs/ppo"
    overwrite_output_dir: bool = False
    save_every: int = 0
    keep_last_checkpoints: int = 3
    eval_every: int = 0
    log_with: Logger = "none"
    wandb_project: str | None = None
    progress_bar: bool = True
    plain_mlx: bool = False

    def __post_init__(self) -> None:
        check_field_types(self, OptimConfig)
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
        require(
            self.max_grad_norm > 0,  # inf allowed: no clipping; NaN fails
            "max_grad_norm",
            self.max_grad_norm,
            "> 0",
            "set e.g. 1.0, or .inf to disable clipping",
        )
        require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, ">= 0", "set 0 for none")
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
            is_non_negative(self.weight_decay),
            "weight_decay",
            self.weight_decay,
            ">= 0",
            "set 0.0 for none or a small value such as 0.01",
        )
        require(is_positive(self.adam_eps), "adam_eps", self.adam_eps, "> 0", "set e.g. 1e-5")
        require(self.num_epochs >= 1, "num_epochs", self.num_epochs, ">= 1", "set e.g. 1")
        require(self.seed >= 0, "seed", self.seed, ">= 0", "use a non-negative seed")
        require(
            bool(self.output_dir.strip()),
            "output_dir",
            self.output_dir,
            "a non-empty path",
            "set a directory such as runs/ppo",
        )
        require(
            self.save_every >= 0,
            "save_every",
            self.save_every,
            ">= 0",
            "set 0 to save only at the end",
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
            "set 0 for no periodic evaluation",
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
    def clips_gradients(self) -> bool:
        """Whether ``max_grad_norm`` is finite (clipping is on)."""
        return math.isfinite(self.max_grad_norm)


@dataclass(kw_only=True)
class TrainingConfig(OptimConfig):
    """PPO's optimisation: :class:`OptimConfig` plus the value model's learning rate and the
    minibatches of a rollout.

    Attributes:
        value_learning_rate: Adam learning rate of the value model; None = learning_rate.
        num_mini_batches: Minibatches the rollout batch is split into in every PPO epoch; one
            optimiser update per minibatch.
    """

    value_learning_rate: float | None = None
    num_mini_batches: int = 1

    def __post_init__(self) -> None:
        OptimConfig.__post_init__(self)
        check_field_types(self, TrainingConfig)
        require(
            self.value_learning_rate is None or is_positive(self.value_learning_rate),
            "value_learning_rate",
            self.value_learning_rate,
            "> 0 or null",
            "set a positive learning rate such as 1e-5, or null to use learning_rate",
        )
        require(
            self.num_mini_batches >= 1,
            "num_mini_batches",
            self.num_mini_batches,
            ">= 1",
            "set 1 to update once per PPO epoch on the whole batch",
        )

    @property
    def value_lr(self) -> float:
        """Learning rate of the value model: ``value_learning_rate``, else ``learning_rate``."""
        if self.value_learning_rate is not None:
            return self.value_learning_rate
        return self.learning_rate
