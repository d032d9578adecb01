"""The TRL side of ``benchmarks.ppo_throughput``: TRL's PPOTrainer and GRPOTrainer on the same
checkpoints and settings (needs ``pip install -r requirements-bench.txt``).

Runs in its own process, without MLX (this module imports neither MLX nor ``base_setup``).
PyTorch gets ``spec.threads`` threads, the cores MLX's BLAS uses.

* PPO: ``trl.experimental.ppo.PPOTrainer`` (TRL 1.x keeps it under ``experimental``), with the
  policy and a separate reference loaded with ``AutoModelForCausalLM`` and the reward and value
  models with ``AutoModelForSequenceClassification`` from the same reward checkpoint the MLX
  side uses; ``stop_token=None`` so that every response has exactly ``response_length`` tokens;
  one PPO epoch, one minibatch, ``local_rollout_forward_batch_size`` = the whole batch.
* GRPO: ``trl.GRPOTrainer`` with the reward checkpoint as reward model, ``beta`` 0.04 (so it
  loads a reference model, as the MLX side does), ``generation_kwargs={"min_new_tokens": T}``
  with ``max_completion_length=T`` (EOS cannot end a completion early).

LoRA (when the spec asks for it, as the real shapes do): the policy is wrapped by TRL with PEFT's
``LoraConfig`` (``peft_config=``; the spec's rank, alpha and ``target_modules``, no dropout, no
bias), and no reference model is loaded: TRL then computes the reference log-probs with the
adapters disabled, as the MLX side does. The value model (PPO) trains all its weights, as on the
MLX side.

Both in float32 (``bf16=False``), on the CPU (``spec.device == "cpu"``) or on the CUDA device
("gpu": ``use_cpu=False``; TF32 matrix products only with ``spec.tf32``, PyTorch's default being
full float32). One iteration is the time between two ``on_step_end`` callbacks (the first from
``on_train_begin``). The split comes from timers wrapped around TRL's own functions: PPO's
``batch_generation`` (generation) and its no-gradient ``forward`` / ``get_reward`` calls
(scoring); GRPO's ``_generate`` (generation) and ``_generate_and_score_completions`` (generation
+ scoring). On the GPU every timer mark first waits for the device (``torch.cuda.synchronize``),
so that queued kernels count where they were launched.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Callable, cast

from benchmarks.throughput_spec import GRPO_BETA, CpuMonitor, RunResult, RunSpec, peak_rss_mb

LEARNING_RATE = 1e-6


class _Timers:
    """Seconds accumulated by the wrapped TRL functions in the current iteration."""

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda  # synchronize the CUDA device at every mark
        self.current: dict[str, float] = {"generation": 0.0, "scoring": 0.0, "rollout": 0.0}
        self.iterations: list[dict[str, float]] = []
        self.marks: list[float] = []
        self.widths: list[int] = []
        self.monitor = CpuMonitor()
        self.warmup = 0

    def wrap(self, fn: Callable[..., Any], key: str, when: Callable[[], bool]) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not when():
                return fn(*args, **kwargs)
            start = self.now()
            out = fn(*args, **kwargs)
            self.current[key] += self.now() - start
            return out

        return timed

    def now(self) -> float:
        """``time.perf_counter()`` once the device has run everything queued so far."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def step_end(self) -> None:
        self.marks.append(self.now())
        if len(self.marks) == self.warmup + 1:
            self.monitor.start()
            if self.cuda:
                import torch

                torch.cuda.reset_peak_memory_stats()
        self.iterations.append(dict(self.current))
        self.current = {k: 0.0 for k in self.current}


def _timer_callback(timers: _Timers) -> Any:
    from transformers import TrainerCallback

    class IterationTimer(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            timers.marks = [timers.now()]
            timers.current = {k: 0.0 for k in timers.current}

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            timers.step_end()

    return IterationTimer()


def _common_args(spec: RunSpec, output_dir: str) -> dict[str, Any]:
    return {
        "output_dir": output_dir,
        "learning_rate": LEARNING_RATE,
        "bf16": False,
        "fp16": False,
        # GRPO's Trainer enables it on the policy; TRL's PPO ignores it (see _run_ppo).
        "gradient_checkpointing": spec.gradient_checkpointing,
        "use_cpu": spec.device == "cpu",
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 10**6,
        "disable_tqdm": True,
        "seed": spec.seed,
        "gradient_accumulation_steps": 1,
        "dataloader_num_workers": 0,
    }


def _peft_config(spec: RunSpec) -> Any:
    """PEFT's ``LoraConfig`` of the spec's LoRA, or None for full-weight training."""
    if not spec.uses_lora:
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=spec.lora_rank,
        lora_alpha=cast(Any, spec.lora_alpha),  # annotated int; PEFT scales by alpha / r either way
        lora_dropout=0.0,
        target_modules=list(spec.lora_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def _run_ppo(spec: RunSpec, output_dir: str, timers: _Timers) -> Any:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers import AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_module

    tokenizer = AutoTokenizer.from_pretrained(spec.policy_dir, padding_side="left")
    load = {"dtype": torch.float32}
    policy = AutoModelForCausalLM.from_pretrained(spec.policy_dir, **load)
    # With LoRA no reference is loaded: TRL disables the adapters for the reference log-probs.
    ref_policy = (
        None if spec.uses_lora else AutoModelForCausalLM.from_pretrained(spec.policy_dir, **load)
    )
    value_model = AutoModelForSequenceClassification.from_pretrained(
        spec.reward_dir, num_labels=1, **load
    )
    reward_model = AutoModelForSequenceClassification.from_pretrained(
        spec.reward_dir, num_labels=1, **load
    )
    if spec.gradient_checkpointing:
        # TRL's PPO does not act on the argument itself: enabled on the two trained models.
        for trained in (policy, value_model):
            trained.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    prompts = list(spec.prompts[: spec.batch_size])
    dataset = Dataset.from_dict(
        {"input_ids": [tokenizer.encode(p, add_special_tokens=False) for p in prompts]}
    )
    args = PPOConfig(
        **_common_args(spec, output_dir),
        per_device_train_batch_size=spec.batch_size,
        num_mini_batches=1,
        num_ppo_epochs=1,
        total_episodes=spec.batch_size * (spec.warmup + spec.iterations),
        local_rollout_forward_batch_size=spec.batch_size,
        response_length=spec.max_new_tokens,
        stop_token=None,
        temperature=1.0,
        num_sample_generations=0,
        missing_eos_penalty=None,
        sft_model_path=spec.policy_dir,
        reward_model_path=spec.reward_dir,
    )
    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=dataset,
        eval_dataset=dataset,
        callbacks=[_timer_callback(timers)],
        peft_config=_peft_config(spec),
    )

    original_generation = ppo_module.batch_generation

    def generation(*a: Any, **k: Any) -> Any:
        query_responses, logits = original_generation(*a, **k)
        timers.widths.append(int(logits.shape[1]))  # generated tokens (queries are left-padded)
        return query_responses, logits

    always = lambda: True  # noqa: E731
    no_grad = lambda: not torch.is_grad_enabled()  # noqa: E731
    ppo_module.batch_generation = timers.wrap(generation, "generation", always)
    ppo_module.forward = timers.wrap(ppo_module.forward, "scoring", no_grad)
    ppo_module.get_reward = timers.wrap(ppo_module.get_reward, "scoring", no_grad)
    return trainer


def _run_grpo(spec: RunSpec, output_dir: str, timers: _Timers) -> Any:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(spec.policy_dir, padding_side="left")
    load = {"dtype": torch.float32}
    policy = AutoModelForCausalLM.from_pretrained(spec.policy_dir, **load)
    reward_model = AutoModelForSequenceClassification.from_pretrained(
        spec.reward_dir, num_labels=1, **load
    )
    reward_tokenizer = AutoTokenizer.from_pretrained(spec.policy_dir, padding_side="right")
    dataset = Dataset.from_dict({"prompt": list(spec.prompts[: spec.batch_size])})
    args = GRPOConfig(
        **_common_args(spec, output_dir),
        per_device_train_batch_size=spec.rollout_size,
        num_generations=spec.group_size,
        max_completion_length=spec.max_new_tokens,
        generation_kwargs={"min_new_tokens": spec.max_new_tokens},
        temperature=1.0,
        beta=GRPO_BETA,
        num_iterations=1,
        max_steps=spec.warmup + spec.iterations,
        model_init_kwargs={"dtype": torch.float32},
    )
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=reward_model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        reward_processing_classes=reward_tokenizer,
        callbacks=[_timer_callback(timers)],
        peft_config=_peft_config(spec),
    )
    original_generate = trainer._generate

    def generate(prompts: list) -> Any:
        out = original_generate(prompts)
        timers.widths.extend(len(ids) for ids in out[1])  # completion_ids_list
        return out

    always = lambda: True  # noqa: E731
    # Instance attributes shadow the methods for this trainer only.
    setattr(trainer, "_generate", timers.wrap(generate, "generation", always))
    setattr(
        trainer,
        "_generate_and_score_completions",
        timers.wrap(trainer._generate_and_score_completions, "rollout", always),
    )
    return trainer


def run_trl(spec: RunSpec) -> RunResult:
    """Time ``spec.warmup + spec.iterations`` iterations of TRL's PPO or GRPO trainer."""
    if spec.system != "trl":
        raise ValueError(f"run_trl runs system 'trl', got {spec.system!r}")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers
    import trl

    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    cuda = spec.device == "gpu"
    # TRL's PPOTrainer builds its own Accelerator, which does not see use_cpu but reads this.
    os.environ["ACCELERATE_USE_CPU"] = "false" if cuda else "true"
    if cuda:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"--device gpu: PyTorch {torch.__version__} sees no CUDA device (a CPU build, or "
                "no GPU here)"
            )
        torch.backends.cuda.matmul.allow_tf32 = spec.tf32
        torch.backends.cudnn.allow_tf32 = spec.tf32
    timers = _Timers(cuda)
    timers.warmup = spec.warmup
    if spec.warmup == 0:
        timers.monitor.start()
    with tempfile.TemporaryDirectory() as output_dir:
        build = _run_ppo if spec.algorithm == "ppo" else _run_grpo
        trainer = build(spec, output_dir, timers)
        policy = trainer.policy_model if spec.algorithm == "ppo" else trainer.model
        policy_params = sum(  # the base model's, without PEFT's adapters
            p.numel() for name, p in policy.named_parameters() if ".lora_" not in name
        )
        trainable = [(name, p) for name, p in policy.named_parameters() if p.requires_grad]
        if spec.uses_lora and any(".lora_" not in name for name, _ in trainable):
            raise ValueError("with LoRA, only the policy's adapters may train")
        if spec.uses_lora and (trainer.ref_model is not None or not trainable):
            raise ValueError("with LoRA, TRL must train adapters and load no reference model")
        device = trainer.accelerator.device
        if device.type != ("cuda" if cuda else "cpu"):
            raise RuntimeError(f"TRL's trainer runs on {device}, not the spec's {spec.device}")
        trainer.train()
        other_load = timers.monitor.other_cores()
    total = spec.warmup + spec.iterations
    if len(timers.marks) != total + 1:
        raise ValueError(f"TRL ran {len(timers.marks) - 1} iterations, expected {total}")
    bad = sorted({w for w in timers.widths if w != spec.max_new_tokens})
    if bad:
        raise ValueError(
            f"TRL generated responses of {bad} tokens, not max_new_tokens={spec.max_new_tokens}"
        )
    seconds: list[float] = []
    split: dict[str, list[float]] = {k: [] for k in ("generation", "scoring", "update", "other")}
    for i in range(spec.warmup, total):
        wall = timers.marks[i + 1] - timers.marks[i]
        parts = timers.iterations[i]
        generation = parts["generation"]
        if spec.algorithm == "ppo":
            scoring = parts["scoring"]
        else:
            scoring = parts["rollout"] - generation
        rest = wall - generation - scoring
        seconds.append(wall)
        split["generation"].append(generation)
        split["scoring"].append(scoring)
        # TRL's loops interleave the advantage and metric code with the update; count it there.
        split["update"].append(rest)
        split["other"].append(0.0)
    return RunResult(
        spec=spec,
        seconds=seconds,
        split=split,
        peak_rss_mb=peak_rss_mb(),
        mlx_peak_mb=None,
        params_millions=policy_params / 1e6,
        trainable_millions=sum(p.numel() for _, p in trainable) / 1e6,
        other_load=other_load,
        versions={
            "torch": torch.__version__,
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            **({"cuda": str(torch.version.cuda)} if cuda else {}),
        },
        torch_peak_mb=torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
    )
