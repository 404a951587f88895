"""The run viewer in a real headless Chromium (`make test-browser`): a tiny real run (the
grpo preset, 3 steps, validated before and after, a verl-signature reward with acc/pred)
served by `hybridflow view` in its own process, driven by Playwright. Checked: the page
loads with no error, the curves render as SVG paths with one point per step, the timing
table lists the phases, the sample table shows a generation the run wrote to
samples.jsonl and its filters narrow it, and a step appended to the file while the page
is open appears at the next poll (a half-written line waits).

Chromium is Debian's (/usr/bin/chromium); Playwright only drives it (`playwright install`
is never run: nothing is downloaded). HYBRIDFLOW_VIEWER_SCREENSHOT=PATH also saves the
page there (docs/img/viewer.png is made so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ROOT = Path(__file__).parents[2]


def real_run(run_dir: Path, steps: int = 3) -> None:
    """`hybridflow run grpo`, shrunk: one CLI process with its stage processes."""
    sets = [
        f"run_dir={run_dir}",
        f"run.steps={steps}",
        "run.step_batch=32",
        "run.micro_batch=16",
        "data.options.samples_per_prompt=4",
        "metrics.backends=[jsonl]",
        "metrics.samples_per_step=4",
        "validation.source=task:last_digit",
        "validation.max_prompts=8",
        "stages.reward.roles.reward.options.function=tests.view.reward_fns:digit_match",
        "stages.reward.roles.reward.options.ground_truth_key=answer",
    ]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridflow",
            "run",
            "grpo",
            *(a for s in sets for a in ("--set", s)),
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]


class Viewer:
    """`hybridflow view RUN_DIR --port 0` in a process of its own; `.url` from its first line."""

    def __init__(self, run_dir: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hybridflow", "view", str(run_dir), "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert " on http://127.0.0.1:" in line, (line, self.proc.stderr and self.proc.stderr.read())
        self.url = line.split(" on ")[1].split()[0]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.communicate(timeout=10)


def browser_page(viewport: dict[str, int] | None = None):
    """A started Playwright, its Chromium and one page (caller closes the first two)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} is missing: `make test-browser` installs it")
    pw = sync_api.sync_playwright().start()
    browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
    page = browser.new_page(viewport=viewport or {"width": 1400, "height": 1000})
    return pw, browser, page


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("view") / "run"
    real_run(path)
    return path


@pytest.fixture()
def page(run_dir) -> Iterator:
    viewer = Viewer(run_dir)
    pw, browser, page = browser_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
    page.goto(viewer.url)
    try:
        yield page
        assert not errors, errors  # no script error, no CSP refusal, no request elsewhere
    finally:
        browser.close()
        pw.stop()
        viewer.close()


def read_samples(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]


def test_the_page_draws_the_curves_timing_and_the_samples_of_a_real_run(page, run_dir):
    page.wait_for_selector('svg.chart[data-metric="reward/mean"] path.line')
    assert page.inner_text("#run-name") == "run"
    assert page.inner_text("#run-state") == "done"
    line = page.locator('svg.chart[data-metric="reward/mean"] path.line')
    assert line.get_attribute("data-points") == "3"  # steps 0, 1, 2
    d = line.get_attribute("d")
    assert d.startswith("M") and d.count("L") == 2
    val = page.locator('svg.chart[data-metric="val/reward/mean"] path.line')
    assert val.get_attribute("data-points") == "2"  # before training, after the last step
    # A metric picked by name from the list draws its curve; picked again, it goes.
    page.fill("#metric-filter", "actor/entropy")
    page.click('#metric-list button[data-metric="actor/entropy"]')
    assert page.locator('svg.chart[data-metric="actor/entropy"] path.line').count() == 1
    page.click('#metric-list button[data-metric="actor/entropy"]')
    assert page.locator('svg.chart[data-metric="actor/entropy"]').count() == 0
    # Timing: one row per phase of the dataflow.
    phases = page.locator("#timing tr[data-phase]").evaluate_all(
        "rows => rows.map(r => r.dataset.phase)"
    )
    assert set(phases) == {"rollout", "reward", "ref", "adv", "train", "reshard"}

    # The samples table shows what samples.jsonl holds: a known generation, newest first.
    samples = read_samples(run_dir)
    train = [s for s in samples if s["split"] == "train"]
    assert [s["step"] for s in train] == [0] * 4 + [1] * 4 + [2] * 4
    page.wait_for_selector("#samples tr.sample")
    assert page.locator("#samples tr.sample").count() == len(samples)
    newest = min(enumerate(samples), key=lambda p: (-p[1]["step"], p[0]))[1]
    cells = page.locator("#samples tr.sample").first.locator("td").all_inner_texts()
    assert cells[:5] == [
        str(newest["step"]),
        newest["split"],
        "",
        newest["prompt"],
        newest["response"],
    ]

    # Filters: by split and step (a known training generation), by step alone, by reward.
    known = train[-1]
    page.select_option("#f-split", "train")
    page.select_option("#f-step", "2")
    page.wait_for_function(
        "() => [...document.querySelectorAll('#samples tr.sample')].every("
        "r => r.dataset.step === '2' && r.dataset.split === 'train')"
    )
    rows = page.locator("#samples tr.sample")
    assert rows.count() == 4
    cells = rows.last.locator("td").all_inner_texts()  # in the order the run wrote them
    assert cells[:5] == ["2", "train", "", known["prompt"], known["response"]]
    assert float(cells[5]) == pytest.approx(known["reward"])
    assert f"pred: {known['pred']}" in cells[8]
    assert f"ground_truth: {known['ground_truth']}" in cells[8]
    page.select_option("#f-split", "")

    page.select_option("#f-step", "1")
    page.wait_for_function(
        "() => [...document.querySelectorAll('#samples tr.sample')].every(r => r.dataset.step === '1')"
    )
    assert page.locator("#samples tr.sample").count() == 4
    page.select_option("#f-step", "")
    page.select_option("#f-split", "val")
    # Wait for the filtered table itself: a refresh in flight can still show 8 rows of the
    # previous filter for a moment (seen once in a fresh-clone run).
    page.wait_for_function(
        "() => { const rs = [...document.querySelectorAll('#samples tr.sample')];"
        " return rs.length === 8 && rs.every(r => r.dataset.split === 'val'); }"
    )
    assert set(
        page.locator("#samples tr.sample").evaluate_all("rs => rs.map(r => r.dataset.split)")
    ) == {"val"}
    page.select_option("#f-split", "")
    best = max(s["reward"] for s in samples)
    page.fill("#f-min", str(best))
    expected = sum(s["reward"] >= best for s in samples)
    page.wait_for_function(
        f"() => document.querySelectorAll('#samples tr.sample').length === {expected}"
    )
    page.fill("#f-min", "")

    if os.environ.get("HYBRIDFLOW_VIEWER_SCREENSHOT"):
        page.screenshot(path=os.environ["HYBRIDFLOW_VIEWER_SCREENSHOT"], full_page=True)


def test_a_step_written_while_the_page_is_open_appears_at_the_next_poll(page, run_dir):
    line = page.locator('svg.chart[data-metric="reward/mean"] path.line')
    line.wait_for()
    assert line.get_attribute("data-points") == "3"
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "reward/mean": 0.75, "timing/step": 0.1}) + "\n")
        f.write('{"step": 4, "reward/mean": 0.')  # the writer is mid-line
        f.flush()
    page.wait_for_function(
        """() => document.querySelector('svg.chart[data-metric="reward/mean"] path.line')
                 .dataset.points === '4'""",
        timeout=15_000,
    )
    assert "step 3: 0.75" in page.inner_text(
        '.chart-card:has(svg[data-metric="reward/mean"]) .title'
    )
