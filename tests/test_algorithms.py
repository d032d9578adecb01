"""The algorithms as objects (algorithms/): the registry finds each by name, each declares the
config keys that apply to it and its defaults (``python main.py config --kind <name>`` prints only
those; ``algorithm: {name: ..., ...}`` in a config file takes only those), and a new algorithm is
one class and one registry line: the worked one of docs/algorithms.md trains the tiny model."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
import pytest

from algorithms.base import KL_REWARD_KEYS, AdvantageInputs, AdvantageSettings, PolicyLoss
from algorithms.registry import ALGORITHMS, algorithm_keys, get_algorithm
from config.loading import load_config, save_config
from config.ppo_config import PPOConfig
from config.reference import config_keys, keys_text
from fixtures.tiny_corpus import review_prompts
from ppo_trainer.callbacks import TrainerCallback
from ppo_trainer.experience import ExperienceSettings
from ppo_trainer.ppo_trainer import PPOTrainer
from tests.test_algorithms_learn import brevity, config
from tests.test_ppo_trainer import assert_all_changed, trainable

if TYPE_CHECKING:
    from experience_buffer.buffer import RolloutBatch

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {f.name for f in dataclasses.fields(PPOConfig)}
#: The keys of PPO's value model and GAE, which a GRPO run has no use for.
VALUE_KEYS = {
    "vf_coef",
    "cliprange_value",
    "value_model_name",
    "value_init",
    "value_learning_rate",
    "value_warmup_steps",
    "gamma",
    "lam",
    "whiten_rewards",
    "whiten_advantages",
}


# ------------------------------------------------------------------ the worked algorithm


class ReinforceMean:
    """REINFORCE with a batch-mean baseline (Williams 1992): R_b = score_b - kl_coef * sum_t kl_bt,
    advantage = R_b - mean_b' R_b' on every token of response b; the clipped surrogate on it."""

    name = "reinforce_mean"
    title = "REINFORCE (batch-mean baseline)"
    defaults: Mapping[str, Any] = {"num_ppo_epochs": 1}
    keys = KL_REWARD_KEYS
    value_model = False
    kl_in_reward = True
    grouped = False
    policy_loss: PolicyLoss = "token"

    def check(self, config: Any) -> None:
        """Nothing beyond the config's own checks."""

    def advantages(
        self, x: AdvantageInputs, settings: AdvantageSettings
    ) -> tuple[mx.array, mx.array | None]:
        """(B, T) advantages, each response's R_b - mean(R) on its tokens; no returns."""
        import mlx.core as mx

        from base_setup.distributed import all_sum
        from reward_kl.reward_computer import sequence_rewards

        rewards = sequence_rewards(x.scores, x.kl, x.mask, x.kl_coef)  # (B,)
        # The mean over the global batch: every rank's sequences.
        total = all_sum(mx.stack([rewards.sum(), mx.array(rewards.size, mx.float32)]), x.group)
        baseline = total[0] / total[1]
        return (rewards - baseline)[:, None] * x.mask, None  # (B, T)


@pytest.fixture
def reinforce_mean(monkeypatch: pytest.MonkeyPatch) -> ReinforceMean:
    """The worked algorithm, registered as the line of algorithms/registry.py would."""
    algorithm = ReinforceMean()
    monkeypatch.setitem(ALGORITHMS, algorithm.name, algorithm)
    return algorithm


def naive_advantages(
    scores: list[float], kl: list[list[float]], mask: list[list[float]], kl_coef: float
) -> list[list[float]]:
    rewards = [
        s - kl_coef * sum(k * m for k, m in zip(row, ms)) for s, row, ms in zip(scores, kl, mask)
    ]
    baseline = sum(rewards) / len(rewards)
    return [[(r - baseline) * m for m in ms] for r, ms in zip(rewards, mask)]


def test_the_worked_algorithm_is_the_one_docs_show() -> None:
    page = (ROOT / "docs" / "algorithms.md").read_text(encoding="utf-8")
    assert inspect.getsource(ReinforceMean) in page
    assert "    ReinforceMean(),\n" in page  # its registry line


def test_the_worked_algorithms_advantages_equal_the_naive_ones() -> None:
    scores = [1.0, -0.5, 2.0]
    kl = [[0.1, 0.2, 0.3], [0.0, -0.1, 0.4], [0.5, 0.5, 0.5]]
    mask = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    x = AdvantageInputs(
        scores=mx.array(scores),
        kl=mx.array(kl),
        rewards=mx.zeros((3, 3)),  # not read: the rewards are its own
        mask=mx.array(mask),
        values=None,
        kl_coef=0.5,
    )
    settings = ExperienceSettings.from_config(PPOConfig(model_name="m"))
    advantages, returns = ReinforceMean().advantages(x, settings)
    assert returns is None
    np.testing.assert_allclose(
        np.array(advantages), naive_advantages(scores, kl, mask, 0.5), atol=1e-6
    )


@pytest.mark.slow
def test_the_worked_algorithm_trains_the_tiny_model(
    tiny_model_dir: Path, tmp_path: Path, reinforce_mean: ReinforceMean
) -> None:
    """Registered by one line, it runs in the trainer: its defaults apply, every trainable
    parameter moves, and the advantages the update used are the naive ones of the rollout."""
    cfg = config(tiny_model_dir, tmp_path / "run", algorithm="reinforce_mean", learning_rate=1e-3)
    assert cfg.num_ppo_epochs == 2  # given by the helper; its default 1 applies where not given
    assert PPOConfig(model_name="m", algorithm="reinforce_mean").num_ppo_epochs == 1
    seen: list[RolloutBatch] = []

    class Keep(TrainerCallback):
        def on_rollout_end(self, trainer: PPOTrainer, step: int, batch: RolloutBatch) -> None:
            seen.append(batch)

    trainer = PPOTrainer(cfg, reward_model=brevity)
    assert trainer.value_model is None and trainer.ref_model is not None
    before = trainable(trainer.policy)
    trainer.train(review_prompts(cfg.batch_size, seed=0), num_epochs=1, callbacks=[Keep()])
    assert_all_changed(before, trainable(trainer.policy))
    (batch,) = seen
    kl = np.array(batch.logprobs) - np.array(batch.ref_logprobs)  # k1, the default estimator
    expected = naive_advantages(
        np.array(batch.scores).tolist(), kl.tolist(), np.array(batch.mask).tolist(), cfg.kl_coef
    )
    np.testing.assert_allclose(np.array(batch.advantages), expected, atol=1e-5)


# ------------------------------------------------------------------ the registry


def test_every_algorithm_is_found_by_its_name_and_declares_config_fields() -> None:
    assert list(ALGORITHMS) == [
        "ppo",
        "grpo",
        "rloo",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "distill",
        "gkd",
        "online_dpo",
    ]
    for name, algorithm in ALGORITHMS.items():
        assert get_algorithm(name) is algorithm and algorithm.name == name
        assert algorithm.keys <= FIELDS, name
        assert set(algorithm.defaults) <= FIELDS, name
        assert algorithm.policy_loss in ("token", "grpo", "sequence", "gkd")
    assert [n for n, a in ALGORITHMS.items() if a.value_model] == ["ppo"]
    assert [n for n, a in ALGORITHMS.items() if not a.kl_in_reward] == ["grpo", "online_dpo"]
    assert [n for n, a in ALGORITHMS.items() if a.grouped] == [
        "grpo",
        "rloo",
        "reinforce_pp_baseline",
        "online_dpo",
    ]
    # GRPO's defaults are TRL's.
    assert dict(ALGORITHMS["grpo"].defaults) == {
        "beta": 0.0,
        "num_ppo_epochs": 1,
        "loss_type": "dapo",
        "temperature": 1.0,
    }


def test_an_unknown_name_gets_the_closest() -> None:
    with pytest.raises(ValueError, match="got 'gpro': did you mean 'grpo'"):
        get_algorithm("gpro")
    with pytest.raises(ValueError, match=r"algorithm must be one of 'ppo', .*, got 3: A new"):
        get_algorithm(3)
    with pytest.raises(ValueError, match="did you mean 'rloo'"):
        PPOConfig(model_name="m", algorithm="rlooo")
    with pytest.raises(ValueError, match=r"algorithm must be one of .*, got \['grpo'\]"):
        PPOConfig(model_name="m", algorithm=["grpo"])  # type: ignore[arg-type]


def test_a_registered_algorithm_is_a_config_choice(reinforce_mean: ReinforceMean) -> None:
    config = PPOConfig(model_name="m", algorithm="reinforce_mean")
    assert config.algorithm_object is reinforce_mean
    assert config.uses_reference_model and not config.normalizes_reward
    assert "reinforce_mean" in str(get_algorithm_error("reinforce_meen"))


def get_algorithm_error(name: str) -> ValueError:
    with pytest.raises(ValueError) as info:
        get_algorithm(name)
    return info.value


# ------------------------------------------------------------------ config by algorithm


def listed_keys(text: str) -> dict[str, str]:
    """``{key: default}`` of ``keys_text``'s lines ``key = default    (values)``."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", " ")):
            key, _, rest = line.partition(" = ")
            out[key] = rest.split("    (")[0]
    return out


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_config_kind_of_an_algorithm_lists_only_its_keys(name: str) -> None:
    algorithm = ALGORITHMS[name]
    listed = listed_keys(keys_text(name))
    others = algorithm_keys() - algorithm.keys
    assert algorithm.keys <= set(listed), name
    assert not others & set(listed), name
    # Every other key is listed: the keys that apply to every algorithm.
    assert set(listed) == FIELDS - others
    assert listed["algorithm"] == name
    for key, value in algorithm.defaults.items():
        assert listed[key] == str(value), key


def test_config_kind_grpo_prints_no_value_model_key() -> None:
    out = subprocess.run(
        [sys.executable, "main.py", "config", "--kind", "grpo"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    listed = listed_keys(out)
    assert not VALUE_KEYS & set(listed)
    assert not {"kl_coef", "kl_estimator", "adaptive_kl"} & set(listed)  # GRPO's KL is beta
    assert (listed["beta"], listed["temperature"], listed["loss_type"]) == ("0.0", "1.0", "dapo")
    assert {"group_size", "grpo_advantage_scale", "importance_sampling_level"} <= set(listed)
    ppo = listed_keys(keys_text("ppo"))
    assert VALUE_KEYS <= set(ppo) and not {"beta", "loss_type", "dynamic_sampling"} & set(ppo)
    assert (ppo["beta"] if "beta" in ppo else None, ppo["temperature"]) == (None, "0.7")


def test_the_configuration_page_marks_each_algorithms_keys_and_defaults() -> None:
    keys = {key.name: key for _, part in config_keys("ppo") for key in part}
    assert set(keys) == FIELDS  # the page lists every key
    assert keys["vf_coef"].algorithms == ("ppo",)
    assert keys["temperature"].algorithms is None
    assert keys["temperature"].algorithm_defaults == (
        ("grpo", "1.0"),
        ("distill", "1.0"),
        ("gkd", "0.9"),
        ("online_dpo", "0.9"),
    )
    assert keys["kl_coef"].algorithms == (
        "ppo",
        "rloo",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "distill",
    )


# ------------------------------------------------------------------ the algorithm section


def test_the_algorithm_section_is_the_same_run_as_the_flat_keys(tmp_path: Path) -> None:
    """``algorithm: {name: grpo, ...}`` reads as the flat keys, saves the same config.yaml, and
    takes TRL's names too; ``--set algorithm.name=grpo`` and ``algorithm.beta=...`` as well."""
    out = str(tmp_path / "out")
    nested = tmp_path / "nested.yaml"
    nested.write_text(
        f"model_name: m\noutput_dir: {out}\nalgorithm:\n  name: grpo\n  num_generations: 4\n"
        "  beta: 0.04\n  temperature: 0.9\n"
    )
    flat = PPOConfig(
        model_name="m", output_dir=out, algorithm="grpo", group_size=4, beta=0.04, temperature=0.9
    )
    from_file = load_config(nested)
    assert from_file == flat
    assert (from_file.num_ppo_epochs, from_file.loss_type) == (1, "dapo")  # TRL's defaults
    saved = save_config(from_file, tmp_path / "a.yaml").read_text()
    assert saved == save_config(flat, tmp_path / "b.yaml").read_text()
    overrides = [
        "model_name=m",
        f"output_dir={out}",
        "algorithm.name=grpo",
        "algorithm.group_size=4",
        "algorithm.beta=0.04",
        "temperature=0.9",
    ]
    assert load_config(None, overrides) == flat


@pytest.mark.parametrize(
    "section, message",
    [
        ("  name: grpo\n  vf_coef: 0.2\n", "vf_coef in section 'algorithm' does not apply to "),
        ("  name: grpo\n  gamma: 0.9\n", "--kind grpo` lists what does"),
        ("  name: ppo\n  beta: 0.1\n", "beta in section 'algorithm' does not apply to"),
        # TRL's name of a GRPO-only key.
        ("  name: rloo\n  scale_rewards: false\n", "scale_rewards in section 'algorithm' does"),
        ("  group_size: 4\n", "section 'algorithm' must name the algorithm"),
        ("  name: gpro\n", "did you mean 'grpo'"),
    ],
)
def test_the_algorithm_section_refuses_what_does_not_apply(
    tmp_path: Path, section: str, message: str
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model_name: m\nalgorithm:\n" + section)
    with pytest.raises(ValueError, match=message):
        load_config(path)


def test_the_flat_keys_of_another_algorithm_still_load() -> None:
    """A saved config.yaml holds every key, so the flat form refuses none (only the options
    that would change nothing for the algorithm, as before)."""
    config = load_config(None, ["model_name=m", "algorithm=grpo", "group_size=2", "vf_coef=0.3"])
    assert config.vf_coef == 0.3
