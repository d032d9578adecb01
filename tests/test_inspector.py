"""The rollout inspector page (ppo_trainer/inspector.py), checked as a person sees it: rendered by
headless Chromium, its screenshot must show tokens coloured by their advantage's sign, and the
numbers it shows (embedded data, token tooltips) must equal the records."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from html.parser import HTMLParser
from typing import Any

import numpy as np
import pytest

from ppo_trainer.inspector import embed_json, write_inspector
from ppo_trainer.rollout_records import RolloutArrays, log_rollouts, read_rollout_records

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="headless Chromium is not installed (Debian: apt-get install chromium; .ci/run "
    "installs it): the page cannot be rendered",
)
WINDOW = (1280, 1400)

VOCAB = ["<eos>", "The", " good", " bad", " film", ".", "\n", " ", " was", " plot"]
GOOD, BAD = 2, 3
SCRIPT_PROMPT = 'Review </script><script>document.title="broken"</script> of the film:'


class WordTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(VOCAB[i] for i in ids)


def make_run(run_dir: Path) -> None:
    """Three recorded steps of four responses; at step 2 the advantage is +1 on every " good"
    token, -1 on every " bad" token and 0 elsewhere."""
    responses = np.array(
        [
            [1, GOOD, 4, 5, 0, 0],
            [1, BAD, 9, 6, 1, 0],
            [1, 9, 8, GOOD, 7, 0],
            [1, 4, 8, BAD, 5, 0],
        ]
    )  # (B, T)
    lengths = np.array([5, 5, 6, 6])
    mask = (np.arange(6)[None, :] < lengths[:, None]).astype(np.float32)
    prompt = np.array([[1, 4, 5]] * 4)
    rng = np.random.default_rng(0)
    for step in (1, 2, 3):
        advantages = np.where(responses == GOOD, 1.0, np.where(responses == BAD, -1.0, 0.0))
        arrays = RolloutArrays(
            step=step,
            algorithm="ppo",
            prompts=[SCRIPT_PROMPT, "Review of the film:", "Review of the film:", "Plot:"],
            query_responses=np.concatenate([prompt, responses], axis=1),
            prompt_lengths=np.full(4, 3),
            responses=responses,
            mask=mask,
            ended_with_stop=np.array([True, False, False, False]),
            scores=np.array([1.0, -1.0, 0.5, -0.5]) * step,
            logprobs=-rng.random((4, 6)) * mask,
            ref_logprobs=-rng.random((4, 6)) * mask,
            kl=rng.normal(size=(4, 6)) * mask / 10,
            entropy=rng.random((4, 6)) * 2 * mask,
            values=rng.normal(size=(4, 6)) * mask,
            rewards=rng.normal(size=(4, 6)) * mask,
            advantages=advantages * mask,
            returns=rng.normal(size=(4, 6)) * mask,
        )
        log_rollouts(run_dir, arrays, WordTokenizer(), limit=4)


def chromium(tmp_path: Path, page: Path, fragment: str, *args: str) -> str:
    """Run headless Chromium on ``page#fragment``; returns its stdout."""
    assert CHROMIUM is not None
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        "--enable-logging=stderr",  # the page's console: script errors
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        *args,
        f"{page.resolve().as_uri()}#{fragment}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "CONSOLE" in line]
    assert not errors, f"the page's script failed: {errors}"
    return result.stdout


class _TokenSpans(HTMLParser):
    """Collects the token spans (class "t") of a page: card, token index, box, shown text."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[dict[str, Any]] = []
        self.depth = 0  # > 0 inside a token span (which may hold marker spans)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if self.depth:
            self.depth += tag == "span"
        elif tag == "span" and "t" in (a.get("class") or "").split():
            box = a.get("data-box")
            self.spans.append(
                {
                    "card": int(a["data-c"] or -1),
                    "i": int(a["data-i"] or -1),
                    "box": [float(v) for v in box.split(",")] if box else None,
                    "text": "",
                }
            )
            self.depth = 1

    def handle_endtag(self, tag: str) -> None:
        if self.depth and tag == "span":
            self.depth -= 1

    def handle_data(self, data: str) -> None:
        if self.depth:
            self.spans[-1]["text"] += data


def token_spans(dom: str) -> list[dict[str, Any]]:
    parser = _TokenSpans()
    parser.feed(dom)
    return parser.spans


def test_embedded_json_cannot_end_the_script() -> None:
    value = {"prompt": SCRIPT_PROMPT + " <!-- & \u2028", "x": [1.5, "NaN"]}
    text = embed_json(value)
    assert "<" not in text and ">" not in text
    assert json.loads(text) == value


def test_page_embeds_every_record(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_run(run)
    page = write_inspector(run)
    assert page == run / "rollouts" / "inspect.html"
    text = page.read_text(encoding="utf-8")
    assert "http://" not in text and "https://" not in text  # nothing to fetch: works offline
    embedded = re.search(r'<script type="application/json" id="records">(.*?)</script>', text, re.S)
    assert embedded is not None
    data = json.loads(embedded[1])
    steps = read_rollout_records(run)
    assert data["steps"] == [
        {"step": s.step, "source": s.source, "records": s.records} for s in steps
    ]
    assert data["initial"] == 2  # the latest step by default
    other = write_inspector(run, step=2, out=tmp_path / "other.html").read_text(encoding="utf-8")
    assert '"initial":1,' in other
    with pytest.raises(ValueError, match=r"recorded steps: \[1, 2, 3\]"):
        write_inspector(run, step=7)
    with pytest.raises(FileNotFoundError, match="log_rollouts_every"):
        write_inspector(tmp_path / "empty")


@pytest.mark.slow
def test_cli_writes_the_page_and_prints_its_path(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_run(run)
    out = tmp_path / "page.html"
    result = subprocess.run(
        [sys.executable, "main.py", "inspect", str(run), "--step", "2", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == str(out) and out.is_file()
    missing = subprocess.run(
        [sys.executable, "main.py", "inspect", str(tmp_path / "nothing")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert missing.returncode == 2 and "log_rollouts_every" in missing.stderr


@needs_chromium
@pytest.mark.slow
def test_screenshot_colours_tokens_by_the_sign_of_their_advantage(tmp_path: Path) -> None:
    from PIL import Image

    run = tmp_path / "run"
    make_run(run)
    page = write_inspector(run, step=2)
    fragment = "view=responses&step=2&q=advantage&sort=index"
    dom = chromium(tmp_path, page, fragment + "&boxes=1", "--dump-dom")
    shot = tmp_path / "page.png"
    chromium(tmp_path, page, fragment, f"--screenshot={shot}")
    image = np.asarray(Image.open(shot).convert("RGB")).astype(np.int64)  # (H, W, 3)
    assert image.shape[:2] == (WINDOW[1], WINDOW[0])

    records = read_rollout_records(run)[1].records
    spans = token_spans(dom)
    assert len(spans) == sum(r["length"] for r in records)
    redness: dict[str, list[float]] = {"positive": [], "negative": [], "zero": []}
    for span in spans:
        record = records[span["card"]]  # batch order: card k shows row k
        x, y, w, h = span["box"]
        assert y + h < WINDOW[1], "the test tokens must be on screen"
        box = image[int(y) + 2 : int(y + h) - 2, int(x) + 1 : int(x + w) - 1]  # inside the box
        # The background fills most of a token's box; the median ignores the glyphs.
        r, g, b = np.median(box.reshape(-1, 3), axis=0)
        advantage = record["advantage"][span["i"]]
        kind = "positive" if advantage > 0 else "negative" if advantage < 0 else "zero"
        redness[kind].append(r - b)
        if kind == "zero":  # white: no colour for a zero advantage
            assert min(r, g, b) > 235, (record["tokens"][span["i"]], (r, g, b))
    assert len(redness["positive"]) == 2 and len(redness["negative"]) == 2
    assert min(redness["positive"]) > 100  # red
    assert max(redness["negative"]) < -100  # blue


@needs_chromium
@pytest.mark.slow
def test_tooltip_numbers_equal_the_records(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_run(run)
    page = write_inspector(run)
    records = read_rollout_records(run)[0].records  # step 1
    for card, token in [(2, 3), (0, 4)]:
        dom = chromium(
            tmp_path,
            page,
            f"view=responses&step=1&q=kl&sort=index&pin={card}.{token}",
            "--dump-dom",
        )
        rendered = dom.split("<script", 1)[0]  # the page's elements, not its source code
        tooltip = re.search(r'<div id="tooltip"[^>]*>(.*?)</table>', rendered, re.S)
        assert tooltip, "the pinned token's tooltip is not in the page"
        rows = dict(re.findall(r"<tr[^>]*><td>([^<]+)</td><td>([^<]+)</td></tr>", tooltip[1]))
        record = records[card]
        names = {
            "log-prob": "logprob",
            "ref log-prob": "ref_logprob",
            "KL term": "kl",
            "entropy": "entropy",
            "value": "value",
            "reward": "reward",
            "advantage": "advantage",
            "return": "return",
        }
        assert set(rows) == set(names)
        for label, key in names.items():
            assert float(rows[label]) == record[key][token], (label, rows[label])
        assert f"id {record['token_ids'][token]}" in tooltip[1]
        assert f"position {token} of {record['length']}" in tooltip[1]
    # Every token's text is on the page, in order, whitespace made visible.
    spans = token_spans(dom)
    shown = [s["text"] for s in spans if s["card"] == 2]
    assert shown == ["The", " plot", " was", " good", "·", "<eos>"]


@needs_chromium
@pytest.mark.slow
def test_compare_view_and_a_hostile_prompt(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_run(run)
    page = write_inspector(run)
    dom = chromium(tmp_path, page, "view=compare&a=1&b=3&q=advantage&prompt=1", "--dump-dom")
    headings = re.findall(r"<h2>Step (\d+)", dom)
    assert headings == ["1", "3"]
    # Prompt 1 of the prompts both steps share ("Review of the film:") has two responses a side.
    columns = dom.split('id="columns">', 1)[1].split("</section>", 1)[0]
    assert columns.count('class="card"') == 4
    assert "Review of the film:" in columns
    # The prompt with </script> in it is shown as text and ran nothing.
    dom = chromium(tmp_path, page, "view=responses&step=3", "--dump-dom")
    assert "<title>Rollout inspector" in dom
    assert re.search(r"<title>[^<]*broken", dom) is None
    assert html.escape(SCRIPT_PROMPT, quote=False) in dom


def make_judged_run(run_dir: Path) -> None:
    """One GRPO step of two groups of two responses scored by ``group_judge`` on the 0-10
    scale: its prompt on each group's first response, its verdict on every one."""
    responses = np.array([[1, GOOD, 4, 0], [1, BAD, 4, 0], [1, 9, 8, 0], [1, 4, 8, 0]])
    mask = np.ones((4, 4), dtype=np.float32)
    prompts = ["Review of the film:"] * 2 + ["Plot:"] * 2
    group_prompt = (
        "Several responses to one request follow.\n\nRequest:\n{}\n\nResponse 1:\n{}\n\n"
        "Response 2:\n{}\n\nHow good is response 1, compared with the others?"
    )
    digits = [str(k) for k in range(11)]
    shares = [
        np.eye(11)[8] * 0.7 + np.eye(11)[9] * 0.3,
        np.eye(11)[2],
        np.eye(11)[5],
        np.eye(11)[6],
    ]
    details: dict[str, list[Any]] = {
        "group_judge/response": [1, 2, 1, 2],
        "group_judge/prompt": [
            group_prompt.format(prompts[0], "The good film", "The bad film"),
            None,
            group_prompt.format(prompts[2], "The plot was", "The film was"),
            None,
        ],
        "group_judge/score": [8.3, 2.0, 5.0, 6.0],
        "group_judge/distribution": [dict(zip(digits, p.tolist())) for p in shares],
        "group_judge/mass": [0.93, 0.88, 0.61, 0.75],
    }
    arrays = RolloutArrays(
        step=1,
        algorithm="grpo",
        prompts=prompts,
        query_responses=np.concatenate([np.array([[1, 4, 5]] * 4), responses], axis=1),
        prompt_lengths=np.full(4, 3),
        responses=responses,
        mask=mask,
        ended_with_stop=np.array([True] * 4),
        scores=np.array([0.83, 0.2, 0.5, 0.6]),
        logprobs=-np.full((4, 4), 0.5),
        ref_logprobs=-np.full((4, 4), 0.5),
        kl=np.zeros((4, 4)),
        advantages=np.array([0.7, -0.7, -0.7, 0.7]),
        group_size=2,
        details=details,
    )
    log_rollouts(run_dir, arrays, WordTokenizer(), limit=4)


@needs_chromium
@pytest.mark.slow
def test_the_judges_prompt_and_verdict_show_under_each_response(tmp_path: Path) -> None:
    """Each card shows the judge's score on its scale, the distribution it was read from and
    its prompt; a group's later responses show the prompt recorded with the first."""
    run = tmp_path / "run"
    make_judged_run(run)
    page = write_inspector(run)
    dom = chromium(tmp_path, page, "view=responses&step=1&judge=1", "--dump-dom")
    cards = dom.split("<script")[0].split('<div class="card" data-c=')[1:]
    assert len(cards) == 4
    for card, score in zip(cards, ("8.30", "2.00", "5.00", "6.00")):
        assert f"judge's score <b>{score}</b> / 10" in card
        assert card.count("<i title=") == 11  # the 0-10 distribution's bars
        assert "<details open=" in card and "How good is response 1" in card
    assert "Response 2:\nThe bad film" in cards[1] and "shown with #0" in cards[1]
    assert "on the scale <b>93.0%</b>" in cards[0]
    shot = tmp_path / "judge.png"
    chromium(tmp_path, page, "view=responses&step=1&judge=1", f"--screenshot={shot}")
    assert shot.stat().st_size > 0
