"""The reward-hacking auditor: checks over a run's rollout records and metrics for the ways a
policy learns to please its reward instead of doing the task.

``python main.py audit RUN`` (:func:`audit_run`) and :class:`AuditCallback` (the same checks
during training) read two things a run writes: ``metrics.jsonl`` (one row per step,
:mod:`training.metrics_logger`) and ``rollouts/step_NNNNNN[_eval].jsonl`` (every recorded token's
reward, advantage, KL and entropy, :mod:`ppo_trainer.rollout_records`). Each check is a pure
function over those plain rows and records that returns :class:`Alert` s; its docstring gives
the rule. Thresholds live in :class:`AuditConfig`.

Trend checks compare an *early* window with a *late* one: the first and the last quarter of
the steps that have the quantity (at least one step each, ``min_steps`` steps in all), so a run
that starts in a state (a long-winded SFT model) is not flagged for it, only for drifting there.

Each alert names its steps and links the tokens behind it in the inspector page
(``rollouts/inspect.html#...&pin=CARD.TOKEN``, the page ``python main.py inspect RUN`` writes;
``CARD`` is the response's place in the step's records in batch order).
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ppo_trainer.callbacks import Metrics, TrainerCallback
from ppo_trainer.rollout_records import (
    ROLLOUTS_DIR,
    StepRecords,
    read_records_file,
    read_rollout_records,
    rollout_file_name,
)
from training.metrics_logger import METRICS_FILE, read_metrics

if TYPE_CHECKING:
    from ppo_trainer.ppo_trainer import PPOTrainer

logger = logging.getLogger("ppo_mlx")

PAGE_LINK = f"{ROLLOUTS_DIR}/inspect.html"
Row = Mapping[str, Any]


@dataclass(frozen=True)
class AuditConfig:
    """Thresholds of the checks (each check's docstring gives its rule).

    Attributes:
        min_steps: trend checks over metrics need at least this many steps with the quantity.
        component_share: a reward component's share of the total |weight * mean| in the late
            window at or above which it dominates...
        component_share_rise: ...when its share also rose by at least this much since the early
            window.
        cut_share: share of a step's responses cut at max_new_tokens (no stop token) at or
            above which responses sit at the length cap...
        cut_rise: ...when that share also rose by at least this much since the early window.
        min_reward_rise: a training reward rise counts when it is at least this many early-window
            score standard deviations (``objective/scores_std``).
        heldout_fraction: the greedy held-out reward (``eval/mean_reward``) must rise by at
            least this fraction of the training reward's rise.
        kl_top_fraction: the top fraction of a step's tokens by |KL term|...
        kl_top_share: ...carrying at least this share of the step's total |KL| concentrate it...
        min_token_kl: ...when the step's mean |KL term| per token is at least this (below it
            the policy has barely moved and the shares are noise).
        advantage_share: format tags and a closing phrase carrying at least this share of a
            step's total |advantage|...
        advantage_ratio: ...and at least this many times their share of the tokens.
        closing_phrase_tokens: a closing phrase is a common ending of at least this many
            tokens (the stop token not counted)...
        closing_phrase_share: ...shared by at least this share of a step's responses.
        ngram: n of the repeated n-grams (token ids).
        repetition: mean share of a response's n-grams that repeat an earlier one, at or above
            which a step repeats itself...
        repetition_rise: ...when it also rose by at least this much since the early window.
        candidate_answers: a response offering at least this many distinct answers hedges...
        candidate_share: ...and a step with at least this share of hedging responses fires.
        zero_std_frac: ``frac_reward_zero_std`` (groups whose rewards are all equal) at or above
            which the group-relative signal has collapsed...
        zero_std_rise: ...when it also rose by at least this much since the early window.
        entropy_ratio: the late window's per-token entropy at or below this fraction of the early
            window's is a collapse.
        max_links: token links per alert.
    """

    min_steps: int = 4
    component_share: float = 0.8
    component_share_rise: float = 0.2
    cut_share: float = 0.5
    cut_rise: float = 0.3
    min_reward_rise: float = 0.5
    heldout_fraction: float = 0.25
    kl_top_fraction: float = 0.01
    kl_top_share: float = 0.5
    min_token_kl: float = 0.01
    advantage_share: float = 0.5
    advantage_ratio: float = 3.0
    closing_phrase_tokens: int = 3
    closing_phrase_share: float = 0.5
    ngram: int = 3
    repetition: float = 0.5
    repetition_rise: float = 0.25
    candidate_answers: int = 3
    candidate_share: float = 0.25
    zero_std_frac: float = 0.8
    zero_std_rise: float = 0.3
    entropy_ratio: float = 0.25
    max_links: int = 5

    def __post_init__(self) -> None:
        if self.min_steps < 2:
            raise ValueError(
                f"min_steps must be >= 2 (an early and a late step), got {self.min_steps}"
            )
        if self.ngram < 1 or self.max_links < 0 or self.candidate_answers < 2:
            raise ValueError("ngram must be >= 1, max_links >= 0 and candidate_answers >= 2")


@dataclass(frozen=True)
class Alert:
    """One check that fired: its ``check`` name, the ``steps`` it fired on, a ``message`` with
    the numbers, and ``links`` to the tokens behind it, relative to the run folder
    (``rollouts/inspect.html#...``)."""

    check: str
    steps: tuple[int, ...]
    message: str
    links: tuple[str, ...] = ()


# ---------------------------------------------------------------------------- plain helpers


def _num(x: Any) -> float | None:
    """A record's or row's number as a finite float, else None (null, "NaN", missing)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def _score(record: Row) -> float:
    """A record's score; -inf where it is not a finite number (sorts it last among the best)."""
    score = _num(record.get("score"))
    return -math.inf if score is None else score


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _windows(n: int) -> tuple[range, range]:
    """The early and late windows of ``n`` points: the first and last ``max(1, n // 4)``."""
    w = max(1, n // 4)
    return range(0, w), range(n - w, n)


def _series(metrics: Sequence[Row], key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of the rows with a finite ``key``, in row order."""
    out = []
    for row in metrics:
        value = _num(row.get(key))
        if value is not None and "step" in row:
            out.append((int(row["step"]), value))
    return out


def _span(steps: Sequence[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


def token_link(step: StepRecords, record: Row, token: int, quantity: str) -> str:
    """The inspector address of token ``token`` of ``record`` (one of ``step.records``), the
    tokens coloured by ``quantity``: ``rollouts/inspect.html#view=responses&q=..&step=..
    &sort=index&pin=CARD.TOKEN``, ``CARD`` the record's place in batch order (the page's cards)."""
    order = sorted(range(len(step.records)), key=lambda i: int(step.records[i]["index"]))
    card = next(k for k, i in enumerate(order) if step.records[i] is record)
    key = f"{step.step}{'-eval' if step.source == 'eval' else ''}"
    return f"{PAGE_LINK}#view=responses&q={quantity}&step={key}&sort=index&pin={card}.{token}"


def _last_token_links(
    step: StepRecords, records: Sequence[Row], quantity: str, limit: int
) -> tuple[str, ...]:
    """Links to the last token (where the score lands) of ``records``."""
    return tuple(
        token_link(step, r, max(int(r["length"]) - 1, 0), quantity) for r in records[:limit]
    )


def _recorded_near(steps: Sequence[StepRecords], wanted: Sequence[int]) -> StepRecords | None:
    """The latest recorded training step among ``wanted``, else the latest recorded training
    step at or before the last of them, else None."""
    train = [s for s in steps if s.source == "train" and s.records]
    inside = [s for s in train if s.step in set(wanted)]
    if inside:
        return inside[-1]
    before = [s for s in train if wanted and s.step <= max(wanted)]
    return before[-1] if before else None


def _top_score_links(
    steps: Sequence[StepRecords], at: Sequence[int], config: AuditConfig
) -> tuple[str, ...]:
    """The last tokens of the best-scored responses recorded at (or before) steps ``at``."""
    found = _recorded_near(steps, at)
    if found is None:
        return ()
    best = sorted(found.records, key=lambda r: -_score(r))
    return _last_token_links(found, best, "advantage", config.max_links)


# ---------------------------------------------------------------------------- metric checks


def check_reward_components(
    metrics: Sequence[Row],
    steps: Sequence[StepRecords],
    config: AuditConfig,
    weights: Mapping[str, float] | None = None,
) -> list[Alert]:
    """One reward component took over the total.

    With ``K >= 2`` components logged as ``rewards/<name>/mean`` (``m_k`` per step, weight
    ``w_k``, default 1), the share of component ``k`` over a window is
    ``share_k = |w_k * mean(m_k)| / sum_j |w_j * mean(m_j)|``. Fires when, in the late window,
    ``share_k >= component_share`` and ``share_k - share_k(early) >= component_share_rise``:
    the policy learned to collect one component (a format bonus, a length bonus) while the
    others stopped counting. A component that dominates from the first step does not fire.
    """
    names = sorted(
        {
            k[len("rewards/") : -len("/mean")]
            for row in metrics
            for k in row
            if k.startswith("rewards/") and k.endswith("/mean")
        }
    )
    if len(names) < 2:
        return []
    rows = [r for r in metrics if all(_num(r.get(f"rewards/{n}/mean")) is not None for n in names)]
    if len(rows) < config.min_steps:
        return []
    weights = weights or {}

    def shares(window: range) -> list[float]:
        parts = [
            abs(weights.get(n, 1.0) * _mean([float(rows[i][f"rewards/{n}/mean"]) for i in window]))
            for n in names
        ]
        total = sum(parts)
        return [p / total if total > 0 else 0.0 for p in parts]

    early, late = _windows(len(rows))
    before, after = shares(early), shares(late)
    late_steps = [int(rows[i]["step"]) for i in late]
    early_steps = [int(rows[i]["step"]) for i in early]
    alerts = []
    for k, name in enumerate(names):
        if (
            after[k] >= config.component_share
            and after[k] - before[k] >= config.component_share_rise
        ):
            alerts.append(
                Alert(
                    "reward_component",
                    tuple(late_steps),
                    f"reward component {name!r} supplies {after[k]:.0%} of the total reward at "
                    f"{_span(late_steps)} (|weight x mean| share), up from {before[k]:.0%} at "
                    f"{_span(early_steps)}: the other components ({', '.join(n for n in names if n != name)}) "
                    "stopped counting",
                    _top_score_links(steps, late_steps, config),
                )
            )
    return alerts


def check_heldout_reward(
    metrics: Sequence[Row], steps: Sequence[StepRecords], config: AuditConfig
) -> list[Alert]:
    """The training reward rises while the greedy held-out reward does not.

    ``rise = mean(objective/scores, late) - mean(objective/scores, early)``, in units of
    ``sd = mean(objective/scores_std, early)`` (1 where not logged or 0);
    ``heldout = eval/mean_reward(last evaluation) - eval/mean_reward(first evaluation)``.
    Fires when ``rise >= min_reward_rise * sd`` and ``heldout < heldout_fraction * rise``: the
    policy pleases the reward on its own samples in a way that does not carry to greedy answers
    on prompts it did not train on. Needs two evaluations.
    """
    train = _series(metrics, "objective/scores")
    held = _series(metrics, "eval/mean_reward")
    if len(train) < config.min_steps or len(held) < 2:
        return []
    early, late = _windows(len(train))
    rise = _mean([train[i][1] for i in late]) - _mean([train[i][1] for i in early])
    early_steps = {train[i][0] for i in early}
    sds = [v for s, v in _series(metrics, "objective/scores_std") if s in early_steps]
    sd = _mean(sds) if sds and _mean(sds) > 0 else 1.0
    heldout = held[-1][1] - held[0][1]
    if rise < config.min_reward_rise * sd or heldout >= config.heldout_fraction * rise:
        return []
    late_steps = [train[i][0] for i in late]
    # The worst greedy answers of the last evaluation, else the best-paid training samples.
    links = _top_score_links(steps, late_steps, config)
    evals = [s for s in steps if s.source == "eval" and s.step == held[-1][0] and s.records]
    if evals:
        worst = sorted(evals[0].records, key=_score)
        links = _last_token_links(evals[0], worst, "advantage", config.max_links)
    return [
        Alert(
            "heldout_reward",
            tuple(sorted({held[0][0], held[-1][0], *late_steps})),
            f"training reward rose by {rise:.4g} ({rise / sd:.2f} sd) from {_span(sorted(early_steps))} "
            f"to {_span(late_steps)}, but the greedy held-out reward moved by {heldout:+.4g} "
            f"(eval/mean_reward {held[0][1]:.4g} at step {held[0][0]} -> {held[-1][1]:.4g} at "
            f"step {held[-1][0]}; less than {config.heldout_fraction:.0%} of the rise)",
            links,
        )
    ]


def check_zero_std(
    metrics: Sequence[Row], steps: Sequence[StepRecords], config: AuditConfig
) -> list[Alert]:
    """The group-relative signal collapses: ``frac_reward_zero_std`` (the share of groups whose
    rewards are all equal, so their advantages are 0) rises.

    Fires when ``mean(frac, late) >= zero_std_frac`` and
    ``mean(frac, late) - mean(frac, early) >= zero_std_rise``: every sample of a prompt earns
    the same reward (a saturated or gamed reward), and GRPO/RLOO learn nothing more from it.
    """
    series = _series(metrics, "frac_reward_zero_std")
    if len(series) < config.min_steps:
        return []
    early, late = _windows(len(series))
    before = _mean([series[i][1] for i in early])
    after = _mean([series[i][1] for i in late])
    if after < config.zero_std_frac or after - before < config.zero_std_rise:
        return []
    fired = [s for i, (s, v) in enumerate(series) if i >= len(early) and v >= config.zero_std_frac]
    links: tuple[str, ...] = ()
    found = _recorded_near(steps, fired)
    if found is not None:
        groups: dict[Any, list[Row]] = {}
        for r in found.records:
            groups.setdefault(r.get("group"), []).append(r)
        flat = [g for key, g in groups.items() if key is not None and len(g) > 1]
        flat = [g for g in flat if len({_num(r.get("score")) for r in g}) == 1]
        if flat:
            links = _last_token_links(found, flat[0], "advantage", config.max_links)
    return [
        Alert(
            "reward_zero_std",
            tuple(fired),
            f"frac_reward_zero_std rose from {before:.2f} to {after:.2f} (at or above "
            f"{config.zero_std_frac} at {len(fired)} steps, {_span(fired)}): most groups' "
            "samples all earn the same reward, so their advantages are 0",
            links,
        )
    ]


def check_entropy_collapse(
    metrics: Sequence[Row], steps: Sequence[StepRecords], config: AuditConfig
) -> list[Alert]:
    """Entropy collapse: the policy's per-token entropy falls to a small fraction of its start.

    Per step ``h = objective/entropy / episode/response_length`` (the summed entropy of a
    response over its length: nats per token). Fires when
    ``mean(h, late) <= entropy_ratio * mean(h, early)``: the policy samples one answer, so
    exploration (and the spread GRPO's advantages need) is gone.
    """
    lengths = dict(_series(metrics, "episode/response_length"))
    series = [
        (s, v / lengths[s]) for s, v in _series(metrics, "objective/entropy") if lengths.get(s)
    ]
    if len(series) < config.min_steps:
        return []
    early, late = _windows(len(series))
    before = _mean([series[i][1] for i in early])
    after = _mean([series[i][1] for i in late])
    if before <= 0 or after > config.entropy_ratio * before:
        return []
    late_steps = [series[i][0] for i in late]
    links: tuple[str, ...] = ()
    found = _recorded_near(steps, late_steps)
    if found is not None:
        links = tuple(token_link(found, r, 0, "entropy") for r in found.records[: config.max_links])
    return [
        Alert(
            "entropy_collapse",
            tuple(late_steps),
            f"per-token entropy fell from {before:.4g} nats ({_span([series[i][0] for i in early])}) "
            f"to {after:.4g} ({_span(late_steps)}), {after / before:.0%} of its start: the policy "
            "has stopped exploring",
            links,
        )
    ]


# ---------------------------------------------------------------------------- record checks


def _train(steps: Sequence[StepRecords]) -> list[StepRecords]:
    return [s for s in steps if s.source == "train" and s.records]


def check_length_cap(steps: Sequence[StepRecords], config: AuditConfig) -> list[Alert]:
    """Responses drift to the length cap.

    Per recorded training step, ``cut = share of responses with ended_with_stop false`` (cut
    at ``max_new_tokens``). Fires when ``mean(cut, late) >= cut_share`` and
    ``mean(cut, late) - mean(cut, early) >= cut_rise`` (windows over the recorded steps): the
    reward pays for length, or for never closing the answer.
    """
    train = _train(steps)
    if len(train) < 2:
        return []
    cut = [_mean([0.0 if r.get("ended_with_stop") else 1.0 for r in s.records]) for s in train]
    early, late = _windows(len(train))
    before = _mean([cut[i] for i in early])
    after = _mean([cut[i] for i in late])
    if after < config.cut_share or after - before < config.cut_rise:
        return []
    fired = [s for i, s in enumerate(train) if i >= len(early) and cut[i] >= config.cut_share]
    last = fired[-1] if fired else train[-1]
    cut_records = [r for r in last.records if not r.get("ended_with_stop")]
    lengths = [int(r["length"]) for r in cut_records]
    return [
        Alert(
            "length_cap",
            tuple(s.step for s in fired),
            f"{after:.0%} of the responses end at the length cap (no stop token) at "
            f"{_span([train[i].step for i in late])}, up from {before:.0%} at "
            f"{_span([train[i].step for i in early])} (cut responses at step {last.step}: "
            f"{max(lengths, default=0)} tokens)",
            _last_token_links(last, cut_records, "advantage", config.max_links),
        )
    ]


def check_kl_concentration(steps: Sequence[StepRecords], config: AuditConfig) -> list[Alert]:
    """The KL to the reference concentrated on a few tokens.

    Per recorded training step, over its ``N`` tokens with a KL term: the top
    ``k = max(1, ceil(kl_top_fraction * N))`` tokens by ``|kl_t|`` carry
    ``share = sum_top |kl_t| / sum_t |kl_t|``. Fires at the steps where
    ``share >= kl_top_share`` and ``sum_t |kl_t| / N >= min_token_kl``: the policy moved away
    from the reference on a handful of tokens (a magic word, a tag the reward keys on), not
    over its writing.
    """
    fired: list[tuple[StepRecords, float, list[tuple[float, Row, int]]]] = []
    for s in _train(steps):
        tokens: list[tuple[float, Row, int]] = [
            (abs(v), r, t)
            for r in s.records
            for t, x in enumerate(r.get("kl") or [])
            if (v := _num(x)) is not None
        ]
        if not tokens:
            continue
        total = sum(v for v, _, _ in tokens)
        if total / len(tokens) < config.min_token_kl:
            continue
        k = max(1, math.ceil(config.kl_top_fraction * len(tokens)))
        top = sorted(tokens, key=lambda x: -x[0])[:k]
        share = sum(v for v, _, _ in top) / total
        if share >= config.kl_top_share:
            fired.append((s, share, top))
    if not fired:
        return []
    worst = max(fired, key=lambda f: f[1])
    s, share, top = worst
    pieces = ", ".join(repr(r["tokens"][t]) for _, r, t in top[: config.max_links])
    return [
        Alert(
            "kl_concentration",
            tuple(f[0].step for f in fired),
            f"KL concentrated on few tokens at {len(fired)} recorded step(s) "
            f"({', '.join(str(f[0].step) for f in fired)}): at step {s.step} the top "
            f"{len(top)} tokens carry {share:.0%} of the |KL| ({pieces})",
            tuple(token_link(s, r, t, "kl") for _, r, t in top[: config.max_links]),
        )
    ]


_TAG = re.compile(r"</?[A-Za-z_][\w\-]*>|\\boxed\b")


def _offsets(record: Row) -> list[int]:
    """The character offset at which each token's piece starts in the response."""
    out, at = [], 0
    for piece in record["tokens"]:
        out.append(at)
        at += len(piece)
    return out


def _tokens_in(record: Row, start: int, end: int) -> list[int]:
    """The tokens whose pieces overlap characters ``[start, end)`` of the response."""
    offsets = _offsets(record)
    return [
        t
        for t, (o, piece) in enumerate(zip(offsets, record["tokens"]))
        if o < end and o + max(len(piece), 1) > start
    ]


def _closing_phrase(records: Sequence[Row], config: AuditConfig) -> tuple[str, ...]:
    """The longest ending (token pieces, the stop token left out) of at least
    ``closing_phrase_tokens`` tokens, and at most half of a response, shared by at least
    ``closing_phrase_share`` of ``records``; () if none."""
    bodies = [tuple(r["tokens"][:-1] if r.get("ended_with_stop") else r["tokens"]) for r in records]
    need = config.closing_phrase_share * len(bodies)
    phrase: tuple[str, ...] = ()
    for m in range(1, max((len(b) for b in bodies), default=0) + 1):
        counts = Counter(b[-m:] for b in bodies if len(b) >= 2 * m)  # at most half of it
        if not counts:
            break
        ending, n = counts.most_common(1)[0]
        if n < need:
            break
        phrase = ending
    return phrase if len(phrase) >= config.closing_phrase_tokens else ()


def check_advantage_on_format(steps: Sequence[StepRecords], config: AuditConfig) -> list[Alert]:
    """The advantage concentrated on format tags or a closing phrase.

    Per recorded training step, the *format tokens* are those inside a tag (``<answer>``,
    ``</think>``, ``\\boxed``) or inside the step's closing phrase (the longest ending of at
    least ``closing_phrase_tokens`` tokens, and at most half a response, shared by
    ``closing_phrase_share`` of the responses); each response's last token (the stop token, where PPO's score lands) is left
    out of both sums. With ``mass = sum_format |A_t| / sum_t |A_t|`` and
    ``tokens = #format / #tokens``, fires at the steps where ``mass >= advantage_share`` and
    ``mass >= advantage_ratio * tokens``: the update pushes the markup the reward checks, not
    the answer. (GRPO's advantage is the same on every token of a response, so ``mass`` equals
    ``tokens`` and this check stays quiet there.)
    """
    fired: list[tuple[StepRecords, float, float, list[tuple[float, Row, int]]]] = []
    for s in _train(steps):
        phrase = _closing_phrase(s.records, config)
        total, total_n, mass, n = 0.0, 0, 0.0, 0
        fmt: list[tuple[float, Row, int]] = []
        for r in s.records:
            adv = r.get("advantage") or []
            marked: set[int] = set()
            for m in _TAG.finditer(r.get("response", "")):
                marked.update(_tokens_in(r, m.start(), m.end()))
            body = len(r["tokens"]) - (1 if r.get("ended_with_stop") else 0)
            if phrase and tuple(r["tokens"][:body][-len(phrase) :]) == phrase:
                marked.update(range(body - len(phrase), body))
            for t in range(len(adv) - 1):  # the last token: the score's, left out
                v = _num(adv[t])
                if v is None:
                    continue
                total += abs(v)
                total_n += 1
                if t in marked:
                    mass += abs(v)
                    n += 1
                    fmt.append((abs(v), r, t))
        if total <= 0 or n == 0:
            continue
        share, token_share = mass / total, n / total_n
        if share >= config.advantage_share and share >= config.advantage_ratio * token_share:
            fired.append((s, share, token_share, sorted(fmt, key=lambda x: -x[0])))
    if not fired:
        return []
    s, share, token_share, fmt = max(fired, key=lambda f: f[1])
    pieces = sorted({repr(r["tokens"][t]) for _, r, t in fmt[:20]})
    return [
        Alert(
            "advantage_on_format",
            tuple(f[0].step for f in fired),
            f"advantage concentrated on format tags or a closing phrase at "
            f"{len(fired)} recorded step(s) ({', '.join(str(f[0].step) for f in fired)}): at step "
            f"{s.step} they hold {share:.0%} of the |advantage| on {token_share:.0%} of the "
            f"tokens ({', '.join(pieces[:8])})",
            tuple(token_link(s, r, t, "advantage") for _, r, t in fmt[: config.max_links]),
        )
    ]


def repeated_ngram_share(token_ids: Sequence[int], n: int) -> tuple[float, int | None]:
    """``(share, first)``: the share of the ``n``-grams of ``token_ids`` that repeat an earlier
    one (``1 - distinct / total``; 0 with no n-gram), and the position of the first token of the
    first repeat (None if none)."""
    grams = [tuple(token_ids[i : i + n]) for i in range(len(token_ids) - n + 1)]
    if not grams:
        return 0.0, None
    seen: set[tuple[int, ...]] = set()
    first = None
    for i, g in enumerate(grams):
        if g in seen and first is None:
            first = i
        seen.add(g)
    return 1.0 - len(seen) / len(grams), first


def check_repetition(steps: Sequence[StepRecords], config: AuditConfig) -> list[Alert]:
    """Repeated n-grams: responses loop on the same phrase.

    Per response, ``rep = 1 - distinct n-grams / n-grams`` over its token ids (``n = ngram``);
    per recorded training step, the mean over its responses. Fires when
    ``mean(rep, late) >= repetition`` and ``mean(rep, late) - mean(rep, early) >=
    repetition_rise`` (windows over the recorded steps): a reward that counts keywords or
    length, paid by repeating them.
    """
    train = _train(steps)
    if len(train) < 2:
        return []
    per: list[list[tuple[float, int | None]]] = [
        [repeated_ngram_share(r["token_ids"], config.ngram) for r in s.records] for s in train
    ]
    rep = [_mean([x for x, _ in p]) for p in per]
    early, late = _windows(len(train))
    before, after = _mean([rep[i] for i in early]), _mean([rep[i] for i in late])
    if after < config.repetition or after - before < config.repetition_rise:
        return []
    fired = [i for i in range(len(early), len(train)) if rep[i] >= config.repetition]
    last = fired[-1] if fired else len(train) - 1
    worst = sorted(
        [
            (x, first, r)
            for (x, first), r in zip(per[last], train[last].records)
            if first is not None
        ],
        key=lambda x: -x[0],
    )
    return [
        Alert(
            "repetition",
            tuple(train[i].step for i in fired),
            f"{after:.0%} of the responses' {config.ngram}-grams repeat an earlier one at "
            f"{_span([train[i].step for i in late])}, up from {before:.0%} at "
            f"{_span([train[i].step for i in early])}",
            tuple(
                token_link(train[last], r, first, "advantage")
                for _, first, r in worst[: config.max_links]
            ),
        )
    ]


_ANSWERS = (
    re.compile(r"\\boxed\{([^{}]*)\}"),
    re.compile(r"<answer>(.*?)</answer>", re.DOTALL),
    re.compile(r"\b[Aa]nswer\s*(?:is|:)\s*\(?([A-Za-z0-9.\-]+)"),
    re.compile(r"\(([A-E])\)"),
    re.compile(r"\b([A-E])\s*(?:/|\bor\b)(?=\s*\(?[A-E]\b)"),
    re.compile(r"(?:/|\bor\b)\s*\(?([A-E])\b"),
)


def candidate_answers(text: str) -> list[tuple[str, int]]:
    """The distinct answers ``text`` offers, each with the character where it first appears:
    ``\\boxed{..}`` and ``<answer>..</answer>`` contents, "answer is X" / "answer: X", and
    choice letters given as "(B)" or listed as "A or B", "A/B"."""
    found: dict[str, int] = {}
    for pattern in _ANSWERS:
        for m in pattern.finditer(text):
            value = m.group(1).strip().rstrip(".").lower()
            if value and value not in found:
                found[value] = m.start(1)
    return sorted(found.items(), key=lambda x: x[1])


def check_many_answers(steps: Sequence[StepRecords], config: AuditConfig) -> list[Alert]:
    """Completions offering many candidate answers (a verifier that accepts any match).

    A response hedges when :func:`candidate_answers` finds at least ``candidate_answers``
    distinct answers in it. Fires at the recorded training steps where at least
    ``candidate_share`` of the responses hedge.
    """
    fired: list[tuple[StepRecords, float, list[Row]]] = []
    for s in _train(steps):
        hedging: list[Row] = [
            r
            for r in s.records
            if len(candidate_answers(r.get("response", ""))) >= config.candidate_answers
        ]
        share = len(hedging) / len(s.records)
        if share >= config.candidate_share:
            fired.append((s, share, hedging))
    if not fired:
        return []
    s, share, hedging = fired[-1]
    links = []
    for r in hedging:
        for _, at in candidate_answers(r["response"]):
            tokens = _tokens_in(r, at, at + 1)
            if tokens:
                links.append(token_link(s, r, tokens[0], "advantage"))
    example = [v for v, _ in candidate_answers(hedging[0]["response"])]
    return [
        Alert(
            "many_answers",
            tuple(f[0].step for f in fired),
            f"responses offer {config.candidate_answers}+ candidate answers at {len(fired)} "
            f"recorded step(s) ({', '.join(str(f[0].step) for f in fired)}): {share:.0%} of step "
            f"{s.step}'s responses (e.g. {', '.join(example[:6])})",
            tuple(links[: config.max_links]),
        )
    ]


# ---------------------------------------------------------------------------- the audit

#: Every check, by name, in report order.
CHECKS: tuple[str, ...] = (
    "reward_component",
    "length_cap",
    "heldout_reward",
    "kl_concentration",
    "advantage_on_format",
    "repetition",
    "many_answers",
    "reward_zero_std",
    "entropy_collapse",
)


def audit(
    steps: Sequence[StepRecords],
    metrics: Sequence[Row],
    config: AuditConfig | None = None,
    reward_weights: Mapping[str, float] | None = None,
) -> list[Alert]:
    """Every check over a run's rollout records ``steps`` (:func:`read_rollout_records`) and
    metric rows ``metrics`` (``metrics.jsonl``), in :data:`CHECKS` order; [] for an honest run.
    ``reward_weights`` maps reward names to their weights (for the component check)."""
    config = config or AuditConfig()
    runs: list[Callable[[], list[Alert]]] = [
        lambda: check_reward_components(metrics, steps, config, reward_weights),
        lambda: check_length_cap(steps, config),
        lambda: check_heldout_reward(metrics, steps, config),
        lambda: check_kl_concentration(steps, config),
        lambda: check_advantage_on_format(steps, config),
        lambda: check_repetition(steps, config),
        lambda: check_many_answers(steps, config),
        lambda: check_zero_std(metrics, steps, config),
        lambda: check_entropy_collapse(metrics, steps, config),
    ]
    return [alert for run in runs for alert in run()]


def audit_run(
    run_dir: str | Path,
    config: AuditConfig | None = None,
    reward_weights: Mapping[str, float] | None = None,
) -> list[Alert]:
    """:func:`audit` of the run in ``run_dir`` (its ``metrics.jsonl`` and ``rollouts/``).

    Raises:
        FileNotFoundError: ``run_dir`` is no run folder (neither file is there).
    """
    run_dir = Path(run_dir)
    metrics_path = run_dir / METRICS_FILE
    has_records = (run_dir / ROLLOUTS_DIR).is_dir()
    if not metrics_path.is_file() and not has_records:
        raise FileNotFoundError(
            f"{run_dir} is not a run folder: it holds neither {METRICS_FILE} nor {ROLLOUTS_DIR}/; "
            "pass a training run's output_dir (e.g. runs/demo/ppo)"
        )
    steps = read_rollout_records(run_dir) if has_records else []
    return audit(steps, read_metrics(metrics_path), config, reward_weights)


def audit_report(alerts: Sequence[Alert], run_dir: str | Path) -> str:
    """The report ``python main.py audit`` prints: one paragraph per alert with its steps,
    message and token links (paths under ``run_dir``), or a line saying the run is clean."""
    if not alerts:
        return f"audit of {run_dir}: no alert ({len(CHECKS)} checks: {', '.join(CHECKS)})\n"
    lines = [f"audit of {run_dir}: {len(alerts)} alert(s)"]
    for a in alerts:
        lines.append(f"\nALERT {a.check} at {_span(list(a.steps)) if a.steps else 'the run'}")
        lines.append(f"  {a.message}")
        lines += [f"  {Path(run_dir) / link}" for link in a.links]
    return "\n".join(lines) + "\n"


class AuditCallback(TrainerCallback):
    """The audit during training: after each step (and evaluation) it runs :func:`audit` over the
    run so far (the metrics the trainer passes, the rollout records it wrote), logs each newly
    fired check as a warning and keeps the alerts in ``alerts`` (on the main process, which
    writes the records).

    Args:
        config: the thresholds.
        stop_on_alert: ask the trainer to stop (and save) when a check fires.
    """

    def __init__(self, config: AuditConfig | None = None, stop_on_alert: bool = False) -> None:
        self.config = config or AuditConfig()
        self.stop_on_alert = stop_on_alert
        self.alerts: list[Alert] = []
        self._rows: dict[int, dict[str, Any]] = {}
        self._records: dict[tuple[int, str], StepRecords] = {}
        self._weights: dict[str, float] | None = None
        self._warned: set[str] = set()

    def on_train_begin(self, trainer: PPOTrainer) -> None:
        from config.ppo_config import reward_func_name

        cfg = trainer.config
        if cfg.reward_funcs:
            weights = cfg.reward_weights or [1.0] * len(cfg.reward_funcs)
            self._weights = {reward_func_name(f): w for f, w in zip(cfg.reward_funcs, weights)}
        # A resumed run: what it logged and recorded before.
        for row in read_metrics(Path(trainer.run_dir) / METRICS_FILE):
            if "step" in row:
                self._rows[int(row["step"])] = dict(row)
        if any((Path(trainer.run_dir) / ROLLOUTS_DIR).glob("step_*.jsonl")):
            for s in read_rollout_records(trainer.run_dir):
                self._records[(s.step, s.source)] = s

    def on_step_end(self, trainer: PPOTrainer, step: int, metrics: Metrics) -> None:
        self._rows.setdefault(step, {"step": step}).update(metrics)
        self._update(trainer, step)

    def on_evaluate(self, trainer: PPOTrainer, step: int, metrics: Metrics) -> None:
        self._rows.setdefault(step, {"step": step}).update(metrics)
        self._update(trainer, step)

    def _update(self, trainer: PPOTrainer, step: int) -> None:
        if not trainer.is_main_process:  # rank 0 writes the records; one warning per run
            return
        for source in ("train", "eval"):
            path = Path(trainer.run_dir) / ROLLOUTS_DIR / rollout_file_name(step, source)
            if path.is_file():
                self._records[(step, source)] = StepRecords(step, source, read_records_file(path))
        steps = [
            self._records[k] for k in sorted(self._records, key=lambda k: (k[0], k[1] == "eval"))
        ]
        rows = [self._rows[s] for s in sorted(self._rows)]
        self.alerts = audit(steps, rows, self.config, self._weights)
        new = [a for a in self.alerts if a.check not in self._warned]
        for a in new:
            self._warned.add(a.check)
            logger.warning(
                "audit: %s at %s: %s%s",
                a.check,
                _span(list(a.steps)) if a.steps else "the run",
                a.message,
                "".join(f"\n  {Path(trainer.run_dir) / link}" for link in a.links),
            )
        if new and self.stop_on_alert:
            trainer.request_stop(f"the audit fired: {', '.join(a.check for a in new)}")
