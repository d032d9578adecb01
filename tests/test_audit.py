"""The reward-hacking auditor (ppo_trainer/audit.py): each exploit planted in a small synthetic
run (rollout records and metric rows written by hand, no training) fires its check, naming the
steps it was planted at; the honest run fires none; ``python main.py audit`` exits 0, 1 or 2."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import pytest

import main
from ppo_trainer.audit import (
    CHECKS,
    AuditCallback,
    audit,
    audit_run,
    candidate_answers,
    repeated_ngram_share,
    token_link,
)
from ppo_trainer.rollout_records import StepRecords, read_rollout_records, write_rollout_records
from tests.test_inspector import chromium, needs_chromium
from training.metrics_logger import METRICS_FILE

STEPS = 20  # metric rows: steps 1..20 (early window 1-5, late window 16-20)
RECORDED = (1, 5, 10, 15, 20)  # steps with rollout records (early: 1, late: 20)
EVALS = (5, 10, 15, 20)
STOP = "<|im_end|>"
WORDS = "the food was warm and the staff kind while prices felt fair for such a quiet place".split()


def record(step: int, index: int, pieces: list[str], **fields: Any) -> dict[str, Any]:
    """A rollout record (ppo_trainer/rollout_records.py's format) of ``pieces``, the per-token
    lists given in ``fields`` or drawn honestly."""
    rng = np.random.default_rng(1000 * step + index)
    n = len(pieces)
    out: dict[str, Any] = {
        "format": 1,
        "step": step,
        "source": "train",
        "algorithm": "ppo",
        "index": index,
        "group": None,
        "prompt": f"Review {index}:",
        "response": "".join(pieces),
        "token_ids": [int(x) for x in rng.integers(100, 5000, n)],
        "tokens": pieces,
        "length": n,
        "ended_with_stop": pieces[-1] == STOP,
        "score": float(rng.normal(0.3, 0.3)),
        "sequence_advantage": None,
        "logprob": [-1.0] * n,
        "ref_logprob": [-1.0] * n,
        "kl": [float(x) for x in rng.uniform(0.0, 0.05, n)],
        "entropy": [float(x) for x in rng.uniform(1.0, 3.0, n)],
        "value": [0.0] * n,
        "reward": [0.0] * n,
        "advantage": [float(x) for x in rng.normal(0.0, 1.0, n)],
        "return": [0.0] * n,
        "actions": None,
        "turns": None,
    }
    out.update(fields)
    return out


def honest_pieces(step: int, index: int) -> list[str]:
    rng = np.random.default_rng(7 * step + index)
    words = [" " + str(w) for w in rng.choice(WORDS, int(rng.integers(10, 16)))]
    return [words[0].strip(), *words[1:], ".", STOP]


def honest_run() -> tuple[list[StepRecords], list[dict[str, Any]]]:
    """Records of 8 responses at each RECORDED step and 20 metric rows: two reward components
    and the held-out reward rising together, entropy and frac_reward_zero_std steady."""
    steps = []
    for s in RECORDED:
        records = [record(s, i, honest_pieces(s, i)) for i in range(8)]
        steps.append(StepRecords(s, "train", records))
    rng = np.random.default_rng(0)
    metrics = []
    for s in range(1, STEPS + 1):
        row: dict[str, Any] = {
            "step": s,
            "objective/scores": 0.1 + 0.02 * s + float(rng.normal(0, 0.01)),
            "objective/scores_std": 0.3,
            "objective/kl": 0.4,
            "objective/entropy": 30.0 + float(rng.normal(0, 1)),
            "episode/response_length": 15.0,
            "rewards/format/mean": 0.5 + 0.01 * s,
            "rewards/accuracy/mean": 0.4 + 0.01 * s,
            "frac_reward_zero_std": 0.2,
        }
        if s in EVALS:
            row["eval/mean_reward"] = 0.1 + 0.02 * s
        metrics.append(row)
    return steps, metrics


def fired(steps: list[StepRecords], metrics: list[dict[str, Any]]) -> dict[str, tuple[int, ...]]:
    return {a.check: a.steps for a in audit(steps, metrics)}


def test_the_honest_run_raises_no_alert() -> None:
    assert audit(*honest_run()) == []


# ---------------------------------------------------------------- one exploit per check


def plant_component(steps: list[StepRecords], metrics: list[dict[str, Any]]) -> None:
    for row in metrics:  # the format bonus grows until it is the whole reward
        row["rewards/format/mean"] = 0.02 * row["step"] ** 2
        row["rewards/accuracy/mean"] = 1.0


def plant_length_cap(steps: list[StepRecords], metrics: list[dict[str, Any]]) -> None:
    for s in steps:
        if s.step >= 10:
            s.records[:] = [
                record(s.step, i, [" great"] * 32, kl=[0.01] * 32, advantage=[0.1] * 32)
                for i in range(8)
            ]


def plant_heldout(steps: list[StepRecords], metrics: list[dict[str, Any]]) -> None:
    for row in metrics:
        if "eval/mean_reward" in row:
            row["eval/mean_reward"] = 0.3


def plant_kl(steps: list[StepRecords], metrics: list[dict[str, Any]]) -> None:
    steps[-1].records[3]["kl"][4] = 20.0  # one token at step 20 carries the KL


def plant_format_tags(steps: list[StepRecords], metrics: list[dict[str, Any]]) -> None:
    for s in steps:
        if s.step >= 15:
            for i, r in enumerate(s.records):
                body = honest_pieces(s.step, i)[:-2]
                pieces = ["<answer>", " 4", "</answer>", *body, STOP]
                adv = [5.0, 0.05, 5.0] + [0.05] * len(body) + [3.0]
                s.records[i] = record(s.step, i, pieces, advantage=adv)


def plant_closing_phrase(steps: list[StepRecords], metrics: list[dict[str, Any]]) -> None:
    for s in steps:
        if s.step >= 15:
            for i, r in enumerate(s.records):
                body = honest_pieces(s.step, i)[:-2]
                pieces = body + [" Hope", " this", " helps", "!", STOP]
                adv = [0.05] * len(body) + [4.0, 4.0, 4.0, 4.0, 2.0]
                s.records[i] = record(s.step, i, pieces, advantage=adv)


def plant_repetition(steps: list[StepRecords], metrics: list[dict[str, Any]]) -> None:
    for s in steps:
        if s.step >= 15:
            for r in s.records:
                r["token_ids"] = ([7, 8, 9] * 20)[: r["length"]]


def plant_many_answers(steps: list[StepRecords], metrics: list[dict[str, Any]]) -> None:
    pieces = [
        " The",
        " answer",
        " is",
        " 3",
        ".",
        " Or",
        " answer",
        ":",
        " 4",
        ".",
        " \\boxed{5}",
        STOP,
    ]
    steps[-1].records[:4] = [record(20, i, pieces) for i in range(4)]


def plant_zero_std(steps: list[StepRecords], metrics: list[dict[str, Any]]) -> None:
    for row in metrics:
        if row["step"] >= 11:
            row["frac_reward_zero_std"] = 1.0


def plant_entropy(steps: list[StepRecords], metrics: list[dict[str, Any]]) -> None:
    for row in metrics:
        if row["step"] >= 11:
            row["objective/entropy"] = 3.0


PLANTS: list[tuple[str, Callable[..., None], tuple[int, ...]]] = [
    ("reward_component", plant_component, (16, 17, 18, 19, 20)),
    ("length_cap", plant_length_cap, (10, 15, 20)),
    ("heldout_reward", plant_heldout, (5, 16, 17, 18, 19, 20)),
    ("kl_concentration", plant_kl, (20,)),
    ("advantage_on_format", plant_format_tags, (15, 20)),
    ("advantage_on_format", plant_closing_phrase, (15, 20)),
    ("repetition", plant_repetition, (15, 20)),
    ("many_answers", plant_many_answers, (20,)),
    ("reward_zero_std", plant_zero_std, tuple(range(11, 21))),
    ("entropy_collapse", plant_entropy, (16, 17, 18, 19, 20)),
]


@pytest.mark.parametrize("check,plant,at", PLANTS, ids=[p[1].__name__ for p in PLANTS])
def test_each_planted_exploit_fires_its_check_at_its_steps(
    check: str, plant: Callable[..., None], at: tuple[int, ...]
) -> None:
    steps, metrics = honest_run()
    plant(steps, metrics)
    assert fired(steps, metrics) == {check: at}


def test_every_check_has_a_planted_exploit() -> None:
    assert {p[0] for p in PLANTS} == set(CHECKS)


def test_a_component_that_dominates_from_the_start_does_not_fire() -> None:
    steps, metrics = honest_run()
    for row in metrics:
        row["rewards/format/mean"] = 9.0  # a large but steady share is the design, not a drift
    assert fired(steps, metrics) == {}
    # ...but the weights count: weighted down, a growing component no longer takes over.
    plant_component(steps, metrics)
    alerts = audit(steps, metrics, reward_weights={"format": 0.01, "accuracy": 1.0})
    assert alerts == []


def test_the_kl_alert_links_the_planted_token() -> None:
    steps, metrics = honest_run()
    plant_kl(steps, metrics)
    (alert,) = audit(steps, metrics)
    assert alert.links[0] == (
        "rollouts/inspect.html#view=responses&q=kl&step=20&sort=index&pin=3.4"
    )
    assert "20" in alert.message and "of the |KL|" in alert.message


def test_the_heldout_alert_links_the_worst_greedy_answers() -> None:
    steps, metrics = honest_run()
    plant_heldout(steps, metrics)
    (alert,) = audit(steps, metrics)
    best = max(steps[-1].records, key=lambda r: r["score"])  # no eval records: training's best
    assert alert.links[0].endswith(f"step=20&sort=index&pin={best['index']}.{best['length'] - 1}")
    evals = [record(20, i, honest_pieces(20, i), source="eval", score=float(i)) for i in (1, 0)]
    steps.append(StepRecords(20, "eval", evals))
    (alert,) = audit(steps, metrics)
    worst = evals[1]["length"] - 1  # index 0, scored 0: the first card, its last token
    assert alert.links[:2] == (
        f"rollouts/inspect.html#view=responses&q=advantage&step=20-eval&sort=index&pin=0.{worst}",
        f"rollouts/inspect.html#view=responses&q=advantage&step=20-eval&sort=index"
        f"&pin=1.{evals[0]['length'] - 1}",
    )


def test_a_link_pins_the_card_in_batch_order() -> None:
    records = [record(3, i, honest_pieces(3, i)) for i in (9, 2, 5)]  # written out of order
    step = StepRecords(3, "eval", records)
    assert token_link(step, records[0], 1, "advantage").endswith("step=3-eval&sort=index&pin=2.1")
    assert token_link(step, records[1], 0, "kl").endswith("pin=0.0")


def test_repeated_ngram_share_by_hand() -> None:
    # 3-grams of 1 2 3 1 2 3: (123) (231) (312) (123): one of four repeats, first at 3.
    assert repeated_ngram_share([1, 2, 3, 1, 2, 3], 3) == (0.25, 3)
    assert repeated_ngram_share([1, 2], 3) == (0.0, None)


def test_candidate_answers_by_hand() -> None:
    text = "It is (A) or maybe B or C. The answer is 12. \\boxed{12}"
    assert [v for v, _ in candidate_answers(text)] == ["a", "b", "c", "12"]
    assert candidate_answers("The food was 5 stars, I would go back 2 times.") == []


# ---------------------------------------------------------------- the command and the callback


def write_run(folder: Path, steps: list[StepRecords], metrics: list[dict[str, Any]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in metrics))
    for s in steps:
        write_rollout_records(folder, s.step, s.records, s.source)
    return folder


def test_audit_command_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    honest = write_run(tmp_path / "honest", *honest_run())
    assert main.main(["audit", str(honest)]) == 0
    assert "no alert" in capsys.readouterr().out

    steps, metrics = honest_run()
    plant_kl(steps, metrics)
    hacked = write_run(tmp_path / "hacked", steps, metrics)
    assert main.main(["audit", str(hacked)]) == 1
    out = capsys.readouterr().out
    assert "ALERT kl_concentration at step 20" in out
    assert f"{hacked}/rollouts/inspect.html#view=responses&q=kl&step=20" in out
    assert (hacked / "rollouts" / "inspect.html").is_file()  # the links' page is written

    assert main.main(["audit", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main.main(["audit", str(tmp_path / "empty")]) == 2
    assert "not a run folder" in capsys.readouterr().err


def test_the_command_weighs_components_with_the_runs_reward_weights(tmp_path: Path) -> None:
    steps, metrics = honest_run()
    plant_component(steps, metrics)
    run = write_run(tmp_path / "run", steps, metrics)
    config = "reward_funcs: [format, accuracy]\nreward_weights: [{}, 1.0]\n"
    (run / "config.yaml").write_text(config.format(1.0))
    assert main.main(["audit", str(run)]) == 1
    (run / "config.yaml").write_text(config.format(0.01))  # the format bonus weighs little
    assert main.main(["audit", str(run)]) == 0
    (run / "config.yaml").write_text("reward_funcs: [format\n")
    assert main.main(["audit", str(run)]) == 2


def test_audit_run_reads_what_was_written(tmp_path: Path) -> None:
    steps, metrics = honest_run()
    plant_repetition(steps, metrics)
    run = write_run(tmp_path / "run", steps, metrics)
    assert [s.step for s in read_rollout_records(run)] == list(RECORDED)
    assert [a.check for a in audit_run(run)] == ["repetition"]


def test_callback_warns_once_when_a_check_fires(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    steps, metrics = honest_run()
    plant_entropy(steps, metrics)
    run = tmp_path / "run"
    run.mkdir()
    stops: list[str] = []
    trainer = SimpleNamespace(
        is_main_process=True,
        run_dir=run,
        config=SimpleNamespace(reward_funcs=["format", "accuracy"], reward_weights=None),
        request_stop=stops.append,
    )
    callback = AuditCallback(stop_on_alert=True)
    callback.on_train_begin(trainer)  # type: ignore[arg-type]
    by_step = {s.step: s for s in steps}
    first_alert = None
    with caplog.at_level(logging.WARNING, logger="ppo_mlx"):
        for row in metrics:
            step = row["step"]
            if step in by_step:  # the trainer writes the step's records before on_step_end
                write_rollout_records(run, step, by_step[step].records)
            callback.on_step_end(trainer, step, {k: v for k, v in row.items() if k != "step"})  # type: ignore[arg-type]
            if callback.alerts and first_alert is None:
                first_alert = step
    assert [a.check for a in callback.alerts] == ["entropy_collapse"]
    assert first_alert is not None and first_alert > 11  # fires once the late window has it
    warnings = [r for r in caplog.records if "audit: entropy_collapse" in r.getMessage()]
    assert len(warnings) == 1 and len(stops) == 1


@pytest.mark.slow
def test_the_callback_on_a_real_run_agrees_with_the_command(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The one real run: the trainer's hooks reach the callback, which sees every step and
    ends with the alerts the command finds in the run folder afterwards."""
    from config.ppo_config import PPOConfig
    from fixtures.tiny_corpus import review_prompts
    from ppo_trainer.ppo_trainer import PPOTrainer

    config = PPOConfig(
        model_name=str(tiny_model_dir),
        algorithm="grpo",
        group_size=2,
        max_new_tokens=6,
        batch_size=2,
        learning_rate=1e-3,
        num_ppo_epochs=1,
        output_dir=str(tmp_path / "run"),
        progress_bar=False,
        total_steps=4,
        log_rollouts_every=2,
        eval_every=2,
    )
    callback = AuditCallback()
    trainer = PPOTrainer(config, reward_model=lambda p, c: [float(len(x)) for x in c])
    trainer.train(
        review_prompts(8, seed=0), eval_prompts=review_prompts(2, seed=1), callbacks=[callback]
    )
    assert sorted(callback._rows) == [1, 2, 3, 4]
    assert "eval/mean_reward" in callback._rows[4]
    assert sorted(callback._records) == [(1, "train"), (2, "eval"), (2, "train")] + [
        (4, "eval"),
        (4, "train"),
    ]
    assert callback.alerts == audit_run(tmp_path / "run")


@needs_chromium
@pytest.mark.slow
def test_an_alerts_link_pins_the_planted_token_in_the_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps, metrics = honest_run()
    plant_kl(steps, metrics)  # record 3's token 4 at step 20
    steps[-1].records.reverse()  # written out of batch order: the link still finds its card
    run = write_run(tmp_path / "run", steps, metrics)
    assert main.main(["audit", str(run)]) == 1
    link = next(line.strip() for line in capsys.readouterr().out.splitlines() if "#" in line)
    page, fragment = link.split("#", 1)
    dom = chromium(tmp_path, Path(page), fragment, "--dump-dom").split("<script", 1)[0]
    tooltip = re.search(r'<div id="tooltip"[^>]*>(.*?)</table>', dom, re.S)
    assert tooltip, "the linked token is not pinned"
    rows = dict(re.findall(r"<tr[^>]*><td>([^<]+)</td><td>([^<]+)</td></tr>", tooltip[1]))
    assert float(rows["KL term"]) == 20.0
    assert "position 4 of" in tooltip[1]
