"""On-policy distillation, offline: a teacher learns a task by SFT, a smaller student that does it
badly is distilled from it on prompts alone, and the student's task score and its per-token KL
to the teacher are compared before and after.

1. A seeded task with an exact checker: reverse three words (``Reverse: film taco menu`` ->
   ``menu taco film``), the words drawn from :data:`WORDS`; ``HELD_OUT`` word triples are kept
   apart for evaluation only.
2. The teacher: the embedded tiny model ("demo" size) fine-tuned (SFT) on the demonstrations
   until it reverses held-out triples almost always.
3. The student: a smaller model with the same tokenizer (:data:`STUDENT_SIZE`), given a short SFT
   on the same demonstrations, so that it knows the format and the outer words but often gets
   the middle one wrong.
4. Distillation on-policy: the student samples its answers to training prompts (no answers
   given) and moves toward the frozen teacher at every token, by one of two losses (``--loss``,
   :data:`LOSSES`): ``reverse_kl`` (``algorithm: distill``: the sampled token's log-ratio
   ``log pi_teacher - log pi`` as its advantage, the reverse KL's one-sample estimate) or ``gkd``
   (``algorithm: gkd`` with ``lmbda`` 1: the generalized JSD between the two next-token
   distributions over the whole vocabulary).
5. On the held-out triples, for the student before and after and for the teacher: the task score
   (the share of exactly right answers) of samples at temperature 1 (the distribution the
   distillation matches) and of greedy answers, the mean per-token KL to the teacher, and the
   share of greedy answers right at each word.

Run ``python -m examples.distill_task --seed 0 --loss gkd``; ``--quick`` runs every stage at toy
scale (tests).
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: MLX's fast BLAS before anything imports mlx
    from base_setup import setup_blas

    setup_blas()

import argparse
import dataclasses
import logging
import random
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


from config.ppo_config import PPOConfig
from examples.task_common import clearly_rose, epochs_for_steps, set_values, sft_stage
from fixtures.tiny_model import TINY_SIZES, TinyModelSpec, build_checkpoint
from ppo_trainer.ppo_trainer import PPOTrainer

logger = logging.getLogger("ppo_mlx")

#: One token each in the tiny model's tokenizer (with a leading space).
WORDS = (
    "film phone food price sound screen service time great bad coffee pizza movie music plot "
    "lamp laptop camera kettle menu staff sushi taco drama"
).split()
#: Word triples kept apart from every training stage (evaluated only).
HELD_OUT = 100
#: Training triples: the SFT demonstrations, and the distillation's prompts (without answers).
TRAINING = 3000
#: Samples per held-out prompt at temperature 1 (the sampled score and the KL).
SAMPLES_PER_PROMPT = 4

#: The student: the "demo" size's tokenizer (same vocabulary and corpus, so the same tokenizer),
#: a quarter of its width and half its depth (about 0.5M parameters against 3.4M).
STUDENT_SIZE = dataclasses.replace(
    TINY_SIZES["demo"],
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=384,
)
SFT_SETTINGS: dict[str, Any] = dict(
    learning_rate=3e-3,
    batch_size=16,
    warmup_steps=10,
    lr_scheduler="cosine",
    eval_fraction=0.0,
    progress_bar=False,
)
#: The teacher reverses held-out triples almost always after 300 steps; the student, after 200,
#: gets the outer words and about a third of the middle ones (greedy).
TEACHER_STEPS = 300
STUDENT_STEPS = 200
#: The distillation for both losses: all the student's weights, 32 training prompts a step.
DISTILL_SETTINGS: dict[str, Any] = dict(
    use_lora=False,  # the student is small: all its weights train
    learning_rate=1e-3,
    batch_size=32,
    num_mini_batches=1,
    total_steps=300,
    max_new_tokens=8,
    use_chat_template=False,  # the SFT stages taught plain "Reverse: ..." prompts
    log_rollouts_every=0,
    progress_bar=False,
)
#: Each loss's own settings (``--loss``), beside :data:`DISTILL_SETTINGS`.
LOSSES: dict[str, dict[str, Any]] = {
    # kl_coef 1, temperature 1, one update per batch: the algorithm's defaults
    "reverse_kl": dict(algorithm="distill"),
    "gkd": dict(
        algorithm="gkd",
        lmbda=1.0,  # on-policy: the student's own samples only (the prompts carry no answers)
        beta=0.5,
        temperature=1.0,
    ),
}
#: Toy scale: the test-size tokenizer and models, a few steps of each stage.
QUICK: dict[str, Any] = dict(
    teacher=TINY_SIZES["test"],
    student=dataclasses.replace(
        TINY_SIZES["test"],
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
    ),
    teacher_steps=40,
    student_steps=5,
    held_out=16,
    distill={"total_steps": 30, "batch_size": 8, "learning_rate": 3e-3},
)


def problems(
    seed: int, held_out: int = HELD_OUT
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """``(training, held_out)`` records ``{"prompt", "answer"}``: word triples of three distinct
    :data:`WORDS`, shuffled by ``seed``; the first ``held_out`` are held out, the next
    :data:`TRAINING` are for training."""
    triples = [(a, b, c) for a in WORDS for b in WORDS for c in WORDS if len({a, b, c}) == 3]
    random.Random(seed).shuffle(triples)
    records = [
        {"prompt": f"Reverse: {' '.join(t)}\n", "answer": " ".join(reversed(t))} for t in triples
    ]
    return records[held_out : held_out + TRAINING], records[:held_out]


def is_right(record: dict[str, str], completion: str) -> float:
    """The exact checker: 1.0 when the completion is the reversed words (surrounding whitespace
    aside), else 0.0."""
    return float(completion.strip() == record["answer"])


def words_right(record: dict[str, str], completion: str) -> list[float]:
    """Per word of the answer (first, middle, last): 1.0 where the completion's word at that
    place is right, else 0.0 (where the student goes wrong)."""
    said = completion.split()
    return [float(i < len(said) and said[i] == w) for i, w in enumerate(record["answer"].split())]


def evaluate(trainer: PPOTrainer, records: Sequence[dict[str, str]]) -> dict[str, Any]:
    """The trainer's policy on ``records``: the sampled score (:data:`SAMPLES_PER_PROMPT`
    samples each at temperature 1; per record, the share right), the greedy score (per record),
    and the mean per-token KL to the teacher (the run's reference) of the sampled answers
    (``log pi - log pi_teacher`` at each sampled token, the end-of-text token included: an
    unbiased estimate of the reverse KL)."""
    prompts = [r["prompt"] for r in records]
    sampled = trainer.evaluate(
        prompts * SAMPLES_PER_PROMPT, temperature=1.0, num_samples=len(prompts) * SAMPLES_PER_PROMPT
    )
    per_sample = [
        is_right(records[i % len(records)], s["completion"])
        for i, s in enumerate(sampled["samples"])
    ]
    sampled_score = [
        sum(per_sample[i :: len(records)]) / SAMPLES_PER_PROMPT for i in range(len(records))
    ]
    greedy = trainer.evaluate(prompts, temperature=0.0, num_samples=len(prompts))
    greedy_score = [is_right(r, s["completion"]) for r, s in zip(records, greedy["samples"])]
    return {
        "sampled": sampled_score,
        "greedy": greedy_score,
        # eval/kl is the mean over samples of each sample's summed KL: / the mean length = per token
        "kl_per_token": sampled["eval/kl"] / sampled["eval/response_length"],
        "greedy_samples": [s["completion"] for s in greedy["samples"]],
        "greedy_words": [  # the share of greedy answers right at each word
            mean(column)
            for column in zip(
                *(words_right(r, s["completion"]) for r, s in zip(records, greedy["samples"]))
            )
        ],
    }


def build_models(output_dir: Path, quick: bool) -> tuple[Path, Path]:
    """The teacher's and the student's random-weight checkpoints, with the same tokenizer."""
    teacher_size: TinyModelSpec = QUICK["teacher"] if quick else TINY_SIZES["demo"]
    student_size: TinyModelSpec = QUICK["student"] if quick else STUDENT_SIZE
    # The tokenizer is trained from (vocab_size, corpus_size, seed): equal for both checkpoints.
    teacher = build_checkpoint(output_dir / "teacher_base", teacher_size, seed=0)
    student = build_checkpoint(output_dir / "student_base", student_size, seed=0)
    if (teacher / "tokenizer.json").read_bytes() != (student / "tokenizer.json").read_bytes():
        raise ValueError(
            "the teacher's and the student's tokenizers differ: distillation needs one"
        )
    return teacher, student


def run(
    output_dir: Path,
    seed: int,
    *,
    quick: bool = False,
    loss: str = "reverse_kl",
    steps: int | None = None,
    overrides: dict[str, Any] | None = None,
    fresh: bool = False,
) -> dict[str, Any]:
    """The five stages under ``output_dir`` (the SFT stages cached there unless ``fresh``), the
    distillation by ``loss`` (a key of :data:`LOSSES`); returns the evaluations of the teacher
    and of the student before and after, and the stages' times in seconds."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {sorted(LOSSES)}, got {loss!r}")
    start = time.perf_counter()
    output_dir.mkdir(parents=True, exist_ok=True)
    train, held_out = problems(seed, QUICK["held_out"] if quick else HELD_OUT)
    teacher_base, student_base = build_models(output_dir, quick)

    def demonstration(record: Mapping[str, Any]) -> dict[str, Any]:
        return {"prompt": record["prompt"], "completion": " " + record["answer"]}

    # 2-3. The teacher's and the student's SFT on the same demonstrations (training triples).
    sft_steps = {
        "teacher": QUICK["teacher_steps"] if quick else TEACHER_STEPS,
        "student": QUICK["student_steps"] if quick else STUDENT_STEPS,
    }
    models = {}
    for name, base in (("teacher", teacher_base), ("student", student_base)):
        print(f"[SFT] {name}: {sft_steps[name]} steps on {len(train)} demonstrations")
        models[name] = sft_stage(
            PPOConfig(model_name=str(base), output_dir=str(output_dir / name), seed=seed),
            train,
            demonstration,
            {
                **SFT_SETTINGS,
                "total_steps": sft_steps[name],
                "warmup_steps": min(SFT_SETTINGS["warmup_steps"], sft_steps[name]),
            },
            fresh=fresh,
        )
    sft_done = time.perf_counter()

    # 4. Distillation on the training prompts alone.
    settings = {
        **DISTILL_SETTINGS,
        **LOSSES[loss],
        **(QUICK["distill"] if quick else {}),
        **(overrides or {}),
    }
    if steps is not None:
        settings["total_steps"] = steps
    config = PPOConfig(
        **settings,
        model_name=str(models["student"]),
        teacher_model_name=str(models["teacher"]),
        seed=seed,
        output_dir=str(output_dir / loss),
        overwrite_output_dir=True,
    )
    trainer = PPOTrainer(config)
    before = evaluate(trainer, held_out)
    terms = (
        f"kl_coef {config.kl_coef}"
        if config.algorithm == "distill"
        else f"beta {config.beta}, lmbda {config.lmbda}"
    )
    print(
        f"[{loss}] algorithm {config.algorithm}: {config.total_steps} steps of "
        f"{config.batch_size} prompts (no answers), {terms}, temperature {config.temperature}, "
        f"learning rate {config.learning_rate}"
    )
    distill_start = time.perf_counter()
    prompts = [r["prompt"] for r in train]
    trainer.train(prompts, num_epochs=epochs_for_steps(config, len(prompts)))
    distill_done = time.perf_counter()
    after = evaluate(trainer, held_out)
    # The teacher measured the same way (its KL to itself is 0: a check of the measurement).
    teacher_config = dataclasses.replace(
        config, model_name=str(models["teacher"]), output_dir=str(output_dir / "teacher_eval")
    )
    teacher = evaluate(PPOTrainer(teacher_config), held_out)

    report(held_out, before, after, teacher)  # 5. Before and after.
    end = time.perf_counter()
    print(
        f"time: SFT {sft_done - start:.0f} s, distillation {distill_done - distill_start:.0f} s, "
        f"total {end - start:.0f} s"
    )
    times = {"sft": sft_done - start, "distill": distill_done - distill_start, "total": end - start}
    return {"before": before, "after": after, "teacher": teacher, "seconds": times}


def report(
    held_out: Sequence[dict[str, str]],
    before: Mapping[str, Any],
    after: Mapping[str, Any],
    teacher: Mapping[str, Any],
) -> None:
    """Print the held-out table (the student before and after, the teacher), whether each score
    clearly rose, the greedy answers' share right at each word, the KL's change and three
    greedy answers."""
    n = len(held_out)
    print(f"\nheld-out triples: {n} ({SAMPLES_PER_PROMPT} samples each at temperature 1)")
    print("| model | sampled score | greedy score | KL per token to the teacher |")
    print("|---|---|---|---|")
    rows = (("student before", before), ("student after", after), ("teacher", teacher))
    for label, result in rows:
        print(
            f"| {label} | {mean(result['sampled']):.3f} | {mean(result['greedy']):.3f} | "
            f"{round(result['kl_per_token'], 3) + 0.0:.3f} |"  # + 0.0: no "-0.000"
        )
    for metric in ("sampled", "greedy"):
        rose, change, error = clearly_rose(before[metric], after[metric])
        verdict = "clearly rose" if rose else "did NOT clearly rise"
        print(f"{metric} score {verdict}: change {change:+.3f} +- {error:.3f}")
    places = zip(("first", "middle", "last"), before["greedy_words"], after["greedy_words"])
    print("greedy words right: " + ", ".join(f"{w} {b:.2f} -> {a:.2f}" for w, b, a in places))
    fell = "fell" if after["kl_per_token"] < before["kl_per_token"] else "did NOT fall"
    print(f"KL per token {fell}: {before['kl_per_token']:.3f} -> {after['kl_per_token']:.3f}")
    for record, completion in list(zip(held_out, after["greedy_samples"]))[:3]:
        mark = "right" if is_right(record, completion) else "wrong"
        print(f"  [{mark}] {record['prompt'].strip()} -> {completion!r}")


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="the task's shuffle and the run's seed")
    parser.add_argument(
        "--loss",
        choices=sorted(LOSSES),
        default="reverse_kl",
        help="reverse_kl: algorithm distill (the sampled token's log-ratio as its advantage); "
        "gkd: algorithm gkd on-policy (the generalized JSD over the vocabulary at every token)",
    )
    parser.add_argument(
        "--steps", type=int, help=f"distillation steps (default {DISTILL_SETTINGS['total_steps']})"
    )
    parser.add_argument("--output-dir", default="runs/distill_task", help="where the stages go")
    parser.add_argument("--quick", action="store_true", help="toy scale on test-size models")
    parser.add_argument("--fresh", action="store_true", help="redo the cached SFT stages")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a distillation config value (YAML), e.g. --set learning_rate=2e-3; repeatable",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    overrides = set_values(parser, args.set)
    run(
        Path(args.output_dir),
        args.seed,
        quick=args.quick,
        loss=args.loss,
        steps=args.steps,
        overrides=overrides,
        fresh=args.fresh,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
