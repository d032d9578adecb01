"""Data-parallel training with ``mlx.launch``: two ranks on localhost (ring backend) train like one
process on the same global batch, stay identical, write one set of logs, and fail together."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import yaml
from mlx.utils import tree_flatten

from base_setup import distributed as dist
from config.loading import config_to_dict, load_config
from fixtures.tiny_corpus import review_prompts
from ppo_trainer.generator import generate
from ppo_trainer.ppo_trainer import PPOTrainer
from main import read_prompts
from tests.distributed_helpers import e_rate, letter_rate
from tests.test_agent_trainer import PROMPTS as AGENT_PROMPTS
from tests.test_agent_trainer import Dice, frequent_tokens, make_config, tools_model  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 240  # a hung collective fails the test instead of hanging CI

pytestmark = pytest.mark.skipif(
    not mx.distributed.is_available("ring"), reason="this mlx build has no ring backend"
)


def _launcher() -> list[str]:
    """The ``mlx.launch`` script of the interpreter running the tests."""
    beside = Path(sys.executable).with_name("mlx.launch")
    found = str(beside) if beside.is_file() else shutil.which("mlx.launch")
    if found is None:
        raise FileNotFoundError("mlx.launch is not installed next to this Python: pip install mlx")
    return [found]


def _free_ports(count: int) -> int:
    """A first port such that ``count`` consecutive ports are free (the ring backend listens on
    ``--starting-port`` + rank)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count >= 65536:
            continue
        sockets = []
        try:
            for port in range(first, first + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free range of local ports for the ring backend")


def launch(num_processes: int, command: list[str], timeout: float = LAUNCH_TIMEOUT_S) -> str:
    """``mlx.launch -n N --backend ring -- python <command>`` from the repository root; returns
    the combined output of every rank and the launcher."""
    cmd = [
        *_launcher(),
        "-n",
        str(num_processes),
        "--backend",
        "ring",
        "--starting-port",
        str(_free_ports(num_processes)),
        "--cwd",
        str(REPO),
        "--",
        sys.executable,
        *command,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # The launcher forwards its stdin to the ranks: give it a pipe that stays open and empty.
    stdin_read, stdin_write = os.pipe()
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdin=stdin_read,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the ranks share the launcher's session: killable together
    )
    os.close(stdin_read)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        raise AssertionError(f"mlx.launch did not finish in {timeout} s:\n{output}")
    finally:
        os.close(stdin_write)
    return output


def rank_exit_codes(output: str) -> dict[int, int]:
    """Exit codes of the ranks that failed, from the launcher's warnings (mlx.launch itself
    exits 0 whatever its ranks do; a negative code is a signal: the launcher stops the other
    ranks once one has failed)."""
    found = re.findall(r"Node with rank (\d+) exited with code (-?\d+)", output)
    return {int(r): int(c) for r, c in found}


RUN_SETTINGS: dict[str, Any] = dict(
    algorithm="ppo",
    max_new_tokens=8,
    batch_size=4,
    num_mini_batches=1,
    num_ppo_epochs=2,
    learning_rate=1e-3,
    lr_scheduler="constant",  # stopping at step 2 and resuming then matches a straight run
    temperature=1.0,
    # A fifth of the vocabulary ends a response: ragged lengths, so the ranks hold different
    # numbers of action tokens (what the token-weighted gradient average is for).
    stop_token_ids=list(range(50, 150)),
    num_epochs=2,
    total_steps=3,
    progress_bar=False,
    # Seed 3: every step's rollout has scores that differ (checked below). With all scores equal,
    # the whitened advantages would be the rounding noise of the KL term, magnified to order 1,
    # and the ranks' and the single process's (different batch shapes) would not agree.
    seed=3,
)


@pytest.fixture(scope="module")
def run_files(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run.yaml and a prompt file (8 prompt records: 2 steps per epoch, 3 steps in all), each
    with the letter its reward counts."""
    root = tmp_path_factory.mktemp("distributed")
    settings = {**RUN_SETTINGS, "model_name": str(tiny_model_dir)}
    (root / "run.yaml").write_text(yaml.safe_dump(settings))
    records = [
        {"prompt": p, "letter": "eo"[i % 2]} for i, p in enumerate(review_prompts(8, seed=1))
    ]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def train_args(run_files: Path, output_dir: Path, *overrides: str) -> list[str]:
    args = ["train", "--config", str(run_files / "run.yaml"), "--prompts"]
    args += [str(run_files / "prompts.jsonl")]
    args += ["--reward-fn", "tests.distributed_helpers:letter_rate"]
    args += ["--set", f"output_dir={output_dir}"]
    for override in overrides:
        args += ["--set", override]
    return args


def trainable(trainer: PPOTrainer) -> dict[str, np.ndarray]:
    policy = dict(tree_flatten(trainer.policy.trainable_parameters()))
    assert trainer.value_model is not None
    value = dict(tree_flatten(trainer.value_model.trainable_parameters()))
    weights = {k: np.array(v) for k, v in policy.items()}
    weights.update({f"value.{k}": np.array(v) for k, v in value.items()})
    return weights


@pytest.fixture(scope="module")
def single_process(run_files: Path) -> dict[str, Any]:
    """The reference: what ``python main.py train`` does in one process (here in-process)."""
    out = run_files / "single"
    config = load_config(run_files / "run.yaml", [f"output_dir={out}"])
    prompts = read_prompts(run_files / "prompts.jsonl")
    trainer = PPOTrainer(config, reward_model=letter_rate)
    initial = trainable(trainer)
    history = trainer.train(prompts)
    return {"initial": initial, "final": trainable(trainer), "history": history, "dir": out}


@pytest.fixture(scope="module")
def two_ranks(run_files: Path) -> dict[str, Any]:
    """Two ranks: 2 steps, stop, resume to step 3; each rank dumps its final weights."""
    out, dump = run_files / "two_ranks", run_files / "dump"
    command = ["-m", "tests.distributed_helpers", "train", str(dump), "2", "--"]
    output = launch(2, command + train_args(run_files, out))
    assert rank_exit_codes(output) == {}, output
    return {"output": output, "dir": out, "dump": dump}


def assert_ranks_equal_one_process(dump: Path, final: dict[str, np.ndarray]) -> None:
    """The two ranks' final trainable weights (``dump/rank<r>.safetensors``) hold ``final``'s
    keys, are identical to each other, and equal one process's ``final`` within 1e-4."""
    ranks = [mx.load(str(dump / f"rank{r}.safetensors")) for r in (0, 1)]
    assert isinstance(ranks[0], dict) and isinstance(ranks[1], dict)
    assert ranks[0].keys() == ranks[1].keys() == final.keys()
    for key in final:
        np.testing.assert_array_equal(np.array(ranks[0][key]), np.array(ranks[1][key]), key)
        np.testing.assert_allclose(np.array(ranks[0][key]), final[key], 1e-4, 1e-5, err_msg=key)


@pytest.mark.slow
def test_two_ranks_keep_identical_weights(two_ranks: dict[str, Any]) -> None:
    ranks = [mx.load(str(two_ranks["dump"] / f"rank{r}.safetensors")) for r in (0, 1)]
    assert isinstance(ranks[0], dict) and isinstance(ranks[1], dict)
    assert ranks[0].keys() == ranks[1].keys() and ranks[0]
    for key in ranks[0]:
        np.testing.assert_array_equal(np.array(ranks[0][key]), np.array(ranks[1][key]), key)


@pytest.mark.slow
def test_two_ranks_train_like_one_process_on_the_global_batch(
    two_ranks: dict[str, Any], single_process: dict[str, Any]
) -> None:
    # Scores that differ within every step (see RUN_SETTINGS' seed), or the comparison is noise.
    assert all(want["objective/scores_std"] > 1e-3 for want in single_process["history"])
    rank0 = mx.load(str(two_ranks["dump"] / "rank0.safetensors"))
    assert isinstance(rank0, dict)
    initial, final = single_process["initial"], single_process["final"]
    assert rank0.keys() == final.keys()
    for key in final:
        assert np.abs(final[key] - initial[key]).max() > 1e-4, f"{key} did not train"
        # Equal to float rounding (the processes run different batch shapes).
        np.testing.assert_allclose(np.array(rank0[key]), final[key], 1e-4, 1e-5, err_msg=key)
    # The logged metrics are those of the global batch, as one process computes them.
    logged = [json.loads(line) for line in (two_ranks["dir"] / "metrics.jsonl").open()]
    assert [r["step"] for r in logged] == [1, 2, 3]
    assert all(0 < r["val/num_eos_tokens"] for r in logged)  # ragged responses
    for got, want in zip(logged, single_process["history"]):
        for key in (
            "objective/scores",
            "objective/scores_std",
            "objective/kl",
            "objective/entropy",
            "objective/rlhf_reward",
            "episode/response_length",
            "val/num_eos_tokens",
            "val/explained_variance",
            "loss/policy",
            "loss/value",
            "policy/clipfrac",
            "policy/approxkl",
            "policy/grad_norm",
        ):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-3, atol=1e-5, err_msg=key)


@pytest.mark.slow
def test_only_rank_0_writes_one_set_of_logs_and_checkpoints(two_ranks: dict[str, Any]) -> None:
    run_dir: Path = two_ranks["dir"]
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "checkpoints",
        "config.yaml",
        "final",
        "metrics.jsonl",
        "rollouts",  # rank 0's share of the rollouts it records
        "training_curves.png",
    ]
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_000002", "step_000003"]
    state = json.loads((run_dir / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["global_step"] == 3
    assert len(state["history"]) == 3
    # Both ranks ran (one "resumed" line each); only rank 0 prints the run summary.
    assert two_ranks["output"].count("resumed from") == 2
    assert two_ranks["output"].count("trained 3 steps") == 1


@pytest.mark.slow
def test_resuming_with_another_number_of_processes_is_refused(
    two_ranks: dict[str, Any], run_files: Path
) -> None:
    config = load_config(run_files / "run.yaml", [f"output_dir={two_ranks['dir']}"])
    trainer = PPOTrainer(config, reward_model=e_rate)
    with pytest.raises(ValueError, match=r"2 process\(es\) but this run has 1.*mlx.launch -n 2"):
        trainer.load_checkpoint(two_ranks["dir"] / "checkpoints" / "step_000003")


@pytest.mark.slow
def test_indivisible_batch_fails_on_every_rank_before_any_work(
    run_files: Path, tmp_path: Path
) -> None:
    out = tmp_path / "bad"
    # A hang would run into the launch timeout; the failure comes before any model is loaded.
    output = launch(2, ["main.py", *train_args(run_files, out, "batch_size=3")], timeout=120)
    message = "batch_size=3 (the prompts of one iteration, over all ranks) does not split evenly"
    for r in (0, 1):  # every rank raised it, and said so before any rank exited
        assert f"rank {r} of 2 stops: {message}" in output, output
    assert f"error: {message} over 2 processes: set batch_size to a multiple of 2" in output
    codes = rank_exit_codes(output)  # 2 (main.py's error exit), or a signal if stopped by then
    assert sorted(codes) == [0, 1] and 2 in codes.values() and 0 not in codes.values(), output
    assert not out.exists()  # nothing was written


@pytest.mark.slow
def test_collectives_and_agreement_checks_on_two_ranks(run_files: Path) -> None:
    """All-reduced statistics equal one process's on the whole batch; disagreeing ranks (payloads,
    weights, configs) and a step that fails on one rank raise on every rank."""
    output = launch(2, ["-m", "tests.distributed_helpers", "checks", str(run_files / "run.yaml")])
    assert rank_exit_codes(output) == {}, output
    for r in (0, 1):
        for check in ("global whitening", "reductions", "agreement checks", "config agreement"):
            assert f"rank {r}: {check} ok" in output, output


def test_row_keys_make_each_prompts_sample_independent_of_its_batch(tiny_model_dir: Path) -> None:
    from models.policy_model import PolicyModel

    policy = PolicyModel.from_pretrained(tiny_model_dir)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    keys = mx.random.split(mx.random.key(3), 4)
    kwargs: dict[str, Any] = dict(
        max_new_tokens=6, temperature=1.0, stop_token_ids=[], pad_token_id=0
    )
    whole = generate(policy, prompts, keys=keys, **kwargs)
    halves = [generate(policy, prompts[i : i + 2], keys=keys[i : i + 2], **kwargs) for i in (0, 2)]
    split = np.concatenate([np.array(h.responses) for h in halves])
    np.testing.assert_array_equal(np.array(whole.responses), split)
    # Other keys draw other samples (the keys are what decides).
    other = generate(policy, prompts, keys=mx.random.split(mx.random.key(4), 4), **kwargs)
    assert not np.array_equal(np.array(other.responses), np.array(whole.responses))
    with pytest.raises(ValueError, match=r"keys must be a \(4, 2\) uint32 array"):
        generate(policy, prompts, keys=keys[:3], **kwargs)


def test_fingerprint_is_exact_and_order_sensitive() -> None:
    a = mx.arange(12, dtype=mx.float32).reshape(3, 4) / 7
    same = mx.array(np.array(a))
    one_ulp = np.array(a)
    one_ulp[1, 2] = np.nextafter(one_ulp[1, 2], np.float32(10))
    swapped = np.array(a)[:, ::-1].copy()
    half = a.astype(mx.bfloat16)

    def fp(x: Any) -> list[int]:
        return np.array(dist.fingerprint({"x": mx.array(x)})).tolist()

    assert fp(a) == fp(same)
    assert fp(a) != fp(one_ulp)
    assert fp(a) != fp(swapped)
    assert fp(half) == fp(mx.array(np.array(half.astype(mx.float32))).astype(mx.bfloat16))
    # Naive reference for one small array: sum of bits * (2654435761 i + 1) mod 2**32.
    x = np.array([1.5, -2.0], dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    weights = (np.arange(2, dtype=np.uint64) * 2654435761 + 1) % 2**32
    assert fp(x) == [int((bits * weights).sum() % 2**32)]


def test_single_process_helpers_are_local() -> None:
    x = mx.array([1.0, 2.0])
    assert dist.world_size() == 1 and dist.rank() == 0 and dist.is_main_process()
    assert dist.all_sum(x) is x and dist.all_mean(x) is x
    assert dist.any_rank(True) and not dist.any_rank(False)
    dist.check_same_on_all_ranks(b"anything", "x", "y")
    with pytest.raises(KeyError):
        dist.raise_if_any_rank_failed(KeyError("mine"), "the step")


@pytest.mark.slow
def test_two_ranks_train_a_shared_base_value_model_like_one_process(run_files: Path) -> None:
    """``value_init: shared`` (the value adapters and head on the policy's base): two ranks,
    stopped and resumed, end with the weights one process reaches on the global batch."""
    out = run_files / "shared"
    config = load_config(
        run_files / "run.yaml", [f"output_dir={out / 'single'}", "value_init=shared"]
    )
    trainer = PPOTrainer(config, reward_model=letter_rate)
    initial = trainable(trainer)
    assert any(k.startswith("value.") and "lora_" in k for k in initial)
    trainer.train(read_prompts(run_files / "prompts.jsonl"))
    final = trainable(trainer)
    command = ["-m", "tests.distributed_helpers", "train", str(out / "dump"), "2", "--"]
    output = launch(2, command + train_args(run_files, out / "ranks", "value_init=shared"))
    assert rank_exit_codes(output) == {}, output
    for key in final:
        # lora_a moves little here: its gradient waits for lora_b, which starts at zero.
        assert not np.array_equal(final[key], initial[key]), f"{key} did not train"
    assert_ranks_equal_one_process(out / "dump", final)


@pytest.mark.slow
def test_two_ranks_play_seeded_environments_like_one_process(
    tools_model: Path, frequent_tokens: list[int], tmp_path: Path
) -> None:
    """GRPO with tools and seeded environments (``Dice``), one step: each rank plays its share
    of the episodes with the environments one process builds (their seeds follow the global
    batch), the ranks end identical and equal to one process, and the logged ``agent/`` metrics
    are the global batch's."""
    config = make_config(
        tools_model,
        tmp_path / "single",
        frequent_tokens,
        algorithm="grpo",
        group_size=2,
        max_new_tokens=64,
        tool_call_parser="tests.test_agent_trainer:every_turn_increments",
    )
    single = PPOTrainer(config, environment_factory=Dice)
    initial = flat_weights(single.policy)
    history = single.train(AGENT_PROMPTS, num_epochs=1)
    final = flat_weights(single.policy)
    settings = {**config_to_dict(config), "output_dir": str(tmp_path / "ranks")}
    (tmp_path / "agents.yaml").write_text(yaml.safe_dump(settings))
    command = ["-m", "tests.distributed_helpers", "agents", str(tmp_path / "agents.yaml")]
    output = launch(2, command + [str(tmp_path / "dump")])
    assert rank_exit_codes(output) == {}, output
    for key in final:
        assert not np.array_equal(final[key], initial[key]), f"{key} did not train"
    assert_ranks_equal_one_process(tmp_path / "dump", final)
    logged = [json.loads(line) for line in (tmp_path / "ranks" / "metrics.jsonl").open()]
    assert [r["step"] for r in logged] == [1] and len(history) == 1
    for got, want in zip(logged, history):
        assert want["agent/tool_calls"] > 0
        for key in ("agent/turns", "agent/tool_calls", "agent/context_tokens", "objective/scores"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)


# --------------------------------------------------------------------------- supervised stages
#: DPO and SFT: 9 examples in batches of 4 (4, 4, 1: at the step of the single-example batch, a
#: rank's share is empty), 3 steps (DPO stopped after 2 and resumed), held-out data evaluated.
STAGE_SETTINGS: dict[str, Any] = dict(
    batch_size=4,
    learning_rate=1e-3,
    lr_scheduler="constant",
    num_epochs=1,
    total_steps=3,
    eval_every=2,
    progress_bar=False,
    keep_last_checkpoints=0,
    seed=1,
)


def flat_weights(model: Any) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in dict(tree_flatten(model.trainable_parameters())).items()}


@pytest.fixture(scope="module")
def stage_runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The DPO and SFT runs on two ranks (one launch) and in one process."""
    from config.dpo_config import DPOConfig
    from config.sft_config import SFTConfig
    from finetune.dpo_trainer import DPOTrainer
    from finetune.records import load_preference_data, load_sft_data
    from finetune.sft_trainer import SFTTrainer
    from fixtures.demo_data import preference_records, sft_records, write_jsonl

    root = tmp_path_factory.mktemp("stages")
    (root / "run.yaml").write_text(
        yaml.safe_dump({**STAGE_SETTINGS, "model_name": str(tiny_model_dir)})
    )
    stages: dict[str, Any] = {
        "dpo": (DPOConfig, DPOTrainer, load_preference_data, preference_records),
        "sft": (SFTConfig, SFTTrainer, load_sft_data, sft_records),
    }
    runs, single = {}, {}
    for name, (config_class, trainer_class, load, make_records) in stages.items():
        data = write_jsonl(root / f"{name}.jsonl", make_records(9, seed=2))
        held_out = write_jsonl(root / f"{name}_eval.jsonl", make_records(3, seed=7))
        settings = [f"dataset={data}", f"eval_dataset={held_out}"]
        argv = [name, "--config", str(root / "run.yaml")]
        for setting in [*settings, f"output_dir={root / name / 'ranks'}"]:
            argv += ["--set", setting]
        runs[name] = (2 if name == "dpo" else None, argv)  # the resume is the same code for both
        config = load_config(
            root / "run.yaml", [*settings, f"output_dir={root / name / 'single'}"], config_class
        )
        trainer = trainer_class(config)
        initial = flat_weights(trainer.model)
        history = trainer.train(load(data), load(held_out))
        final = flat_weights(trainer.model)
        single[name] = {"initial": initial, "final": final, "history": history}
    (root / "runs.json").write_text(json.dumps(runs))
    command = ["-m", "tests.distributed_helpers", "stages", str(root / "dump")]
    output = launch(2, [*command, str(root / "runs.json")])
    assert rank_exit_codes(output) == {}, output
    return {"root": root, "single": single, "output": output}


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["dpo", "sft"])
def test_two_ranks_train_a_supervised_stage_like_one_process(
    stage_runs: dict[str, Any], stage: str
) -> None:
    """DPO (stopped and resumed) and SFT on two ranks end with the weights one process reaches
    on the same global batches, write one set of files, and log the global batch's metrics."""
    root: Path = stage_runs["root"]
    single = stage_runs["single"][stage]
    initial, final = single["initial"], single["final"]
    for key in final:
        assert np.abs(final[key] - initial[key]).max() > 1e-4, f"{key} did not train"
    assert_ranks_equal_one_process(root / "dump" / stage, final)
    run_dir = root / stage / "ranks"
    files = {"checkpoints", "config.yaml", "metrics.jsonl", "model", "training_curves.png"}
    if stage == "dpo":
        files.add("reference_logps")
    assert {p.name for p in run_dir.iterdir()} == files
    state = json.loads((run_dir / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["global_step"] == 3
    output = stage_runs["output"]
    resumed = f"resumed from {run_dir / 'checkpoints' / 'step_000002'}"
    assert output.count(resumed) == (2 if stage == "dpo" else 0)  # each rank resumed
    # Rank 0 alone prints the saved model (DPO: once per run, stopped and resumed).
    assert output.count(f"{stage.upper()} model: {run_dir / 'model'}") == (
        2 if stage == "dpo" else 1
    )
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [r["step"] for r in logged] == [0, 1, 2, 3]
    for got, want in zip(logged, single["history"]):
        for key in (f"loss/{stage}", "grad_norm", "eval/loss", "rewards/margins", "sft/tokens"):
            if key in want:
                # The first margins are 0 up to rounding: beta times differences of log-probs
                # summed over answers (~ -100), each rank's reference batches not the process's.
                atol = 1e-5 if key == "rewards/margins" else 1e-6
                np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=atol, err_msg=key)


def test_rank_share_cuts_a_batch_into_contiguous_near_equal_shares() -> None:
    from finetune.supervised_trainer import rank_share

    batch = list(range(8))
    assert [rank_share(batch, r, 2) for r in (0, 1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [rank_share(batch[:5], r, 2) for r in (0, 1)] == [[0, 1], [2, 3, 4]]
    assert [rank_share(batch[:1], r, 2) for r in (0, 1)] == [[], [0]]  # an empty share
    assert [rank_share(batch, 0, 1)] == [batch]
