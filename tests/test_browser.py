"""What a person sees: JupyterLab in Debian's headless Chromium, driven by Playwright.

A `%%rtrain` cell that reports for a few seconds must show a plot whose per-rank
traces grow while the cell is still running; a click on Resume in the checkpoint
browser must continue training from the chosen checkpoint. Skipped where Chromium
or JupyterLab/Playwright are not installed (`.ci/run` installs them).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import rtnb
from tests._kernel import new_notebook
from tests.conftest import free_port, missing, require

pytestmark = [pytest.mark.browser, pytest.mark.ray, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
TOKEN = "rtnb-browser-test"


def _require_tools() -> None:
    if not Path(CHROMIUM).exists():
        missing("Debian chromium is not installed (apt-get install chromium)")
    require("playwright.sync_api", "the browser tests drive Chromium with Playwright")
    if shutil.which("jupyter-lab", path=str(Path(sys.executable).parent)) is None:
        missing("jupyterlab is not installed in this environment")


@pytest.fixture
def lab(ray_cluster, tmp_path):
    _require_tools()
    port = free_port()
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    root = tmp_path / "nb"
    root.mkdir()
    cmd = [
        str(Path(sys.executable).parent / "jupyter-lab"),
        "--no-browser",
        "--allow-root",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        "--ServerApp.ip=127.0.0.1",
        f"--IdentityProvider.token={TOKEN}",
        f"--ServerApp.root_dir={root}",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
    ]
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ}
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=1)
            break
        except OSError:
            time.sleep(0.3)
    else:
        proc.kill()
        pytest.fail(f"JupyterLab did not start:\n{(tmp_path / 'lab.log').read_text()[-2000:]}")
    try:
        yield url, root
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _notebook(root: Path, cells: list[str]) -> str:
    import nbformat

    nbformat.write(new_notebook(cells), root / "live.ipynb")
    return "live.ipynb"


@contextlib.contextmanager
def _opened(url: str, name: str, tmp_path: Path):
    """The notebook open in headless Chromium with its first cell (`%rtnb start`) run."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--disable-quic",
            ],
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/lab/tree/{name}?token={TOKEN}")
            page.wait_for_selector(
                ".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000
            )
            # The first execute request can be lost while the kernel connection is
            # still settling on a cold start: retry until the cell really runs.
            # Re-send only when the cell never started: a start that is merely slow
            # must not be queued twice.
            first = page.locator(".jp-Cell").first
            prompt = first.locator(".jp-InputPrompt")
            for attempt in range(4):
                first.click()
                page.keyboard.press("Escape")
                page.keyboard.press("Shift+Enter")  # start the group
                try:
                    page.wait_for_function(
                        "el => /\\[(\\*|\\d+)\\]/.test(el.textContent)",
                        arg=prompt.element_handle(),
                        timeout=10_000,
                    )
                    break
                except Exception:
                    page.screenshot(
                        path=str(tmp_path / f"start_attempt_{attempt}.png"), full_page=True
                    )
                    if attempt == 3:
                        raise
            page.wait_for_selector(".jp-OutputArea-output:has-text('gloo')", timeout=180_000)
            yield page
        finally:
            browser.close()


def _kernel_status(page) -> str | None:
    return page.evaluate(
        "() => document.querySelector('.jp-Notebook-ExecutionIndicator')?.getAttribute('data-status')"
    )


def _wait_idle(page, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    time.sleep(0.5)  # let the busy status arrive first
    while _kernel_status(page) != "idle":
        if time.monotonic() > deadline:
            raise AssertionError("the kernel stayed busy")
        time.sleep(0.2)


def test_live_plot_grows_while_the_cell_runs(lab, tmp_path):
    url, root = lab
    name = _notebook(
        root,
        [
            f"%load_ext rtnb\n%rtnb start --storage {tmp_path / 'runs'}",
            # Reports until the test has seen the plot grow (a file ends it), so no
            # timing of the machine decides what the test can observe.
            f"%%rtrain --steps 5000\nimport os, time, rtnb, torch.distributed as dist\ns = 0\n"
            f"while not os.path.exists({str(tmp_path / 'seen')!r}) and s < 5000:\n"
            "    s += 1\n    rtnb.report({'loss': 1.0 / s + dist.get_rank()})\n    time.sleep(0.03)",
            "%rtnb stop",
        ],
    )
    samples: list[list[int]] = []
    with _opened(url, name, tmp_path) as page:
        page.keyboard.press("Shift+Enter")  # the reporting cell
        page.wait_for_selector(".js-plotly-plot", timeout=120_000)
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            lengths = page.evaluate(
                "() => { const el = document.querySelector('.js-plotly-plot');"
                " return el && el.data ? el.data.map(t => (t.y || []).length) : []; }"
            )
            if lengths:
                samples.append(lengths)
                firsts = [s[0] for s in samples]
                if sum(a < b for a, b in zip(firsts, firsts[1:])) >= 3:
                    break  # seen growing three times while the cell runs
            time.sleep(0.5)
        page.screenshot(path=str(tmp_path / "live_plot.png"), full_page=True)
        # While it runs: at its end the live view gives way to the lasting figure.
        header = page.locator(".widget-html-content").first.inner_text()
        (tmp_path / "seen").write_text("stop")
        page.keyboard.press("Shift+Enter")  # %rtnb stop
        _wait_idle(page)
    assert len(samples) >= 3, f"plot seen too rarely: {samples}"
    assert len(samples[-1]) >= 2, "one trace per rank (plus the mean)"
    growing = [s[0] for s in samples]
    assert growing[-1] > growing[0], f"traces did not grow while the cell ran: {growing}"
    assert any(a < b for a, b in zip(growing, growing[1:]))
    assert "step" in header
    assert (tmp_path / "live_plot.png").stat().st_size > 10_000


def test_resume_button_continues_training_from_the_chosen_checkpoint(lab, tmp_path):
    url, root = lab
    runs = tmp_path / "runs"
    name = _notebook(
        root,
        [
            f"%load_ext rtnb\n%rtnb start --storage {runs} --name clicked",
            "%%rtrain\nimport time, rtnb, torch.distributed as dist\n"
            "ck = rtnb.get_checkpoint()\n"
            "i = ck.load_state()['i'] + 1 if ck is not None else 0\n"
            "print(f'training from i={i}')\n"
            "while i < 8:\n"
            "    rtnb.report({'i': i}, checkpoint=rtnb.Checkpoint.from_state({'i': i}) if dist.get_rank() == 0 else None)\n"
            "    i += 1\n"
            "    time.sleep(0.05)",
            "%rtnb checkpoints",
            "%rtnb wait\n%rtnb stop",
        ],
    )
    with _opened(url, name, tmp_path) as page:
        page.keyboard.press("Shift+Enter")  # train i = 0..7, a checkpoint per step
        _wait_idle(page)
        page.keyboard.press("Shift+Enter")  # the checkpoint browser
        browser_widget = page.locator(".jp-OutputArea-output:has(table.rtnb-checkpoints)")
        browser_widget.wait_for(timeout=30_000)
        # step 3 holds i=2 (reports are numbered from step 1)
        browser_widget.locator(".widget-dropdown:has-text('checkpoint') select").select_option(
            "step-000000003"
        )
        browser_widget.locator("button:has-text('Resume')").click()
        page.wait_for_selector("text=training from i=3", timeout=60_000)
        message = browser_widget.locator(".widget-html-content:has-text('Resume:')").inner_text()
        page.screenshot(path=str(tmp_path / "resumed.png"), full_page=True)
        page.locator(".jp-Cell").nth(3).click()
        page.keyboard.press("Escape")
        page.keyboard.press("Shift+Enter")  # wait for the resumed cell, stop the group
        page.wait_for_selector(".jp-OutputArea-output:has-text('stopped')", timeout=90_000)
    assert "step-000000003" in message and "running in the background" in message
    frame = rtnb.Result.from_path(str(runs / "clicked")).metrics_dataframe
    values = frame[frame["rank"] == 0]["i"].tolist()
    assert values == [*range(8), *range(3, 8)], "trained 0..7, then resumed at 3 up to 7"


def _plot_state(page) -> dict:
    return page.evaluate(
        "() => { const el = document.querySelector('.js-plotly-plot');"
        " if (!el || !el.layout) return {};"
        " return {type: el.layout.yaxis.type, traces: el.data.length,"
        "  buttons: [...el.querySelectorAll('.updatemenu-button')].map(b => b.textContent)}; }"
    )


def test_a_saved_notebook_reopened_with_a_new_kernel_keeps_its_figure(lab, tmp_path):
    """Train, save, close; reopen with a new kernel: the figure is there, not "model not
    found", and its own buttons work without any kernel state (log y)."""
    url, root = lab
    name = _notebook(
        root,
        [
            f"%load_ext rtnb\n%rtnb start --storage {tmp_path / 'runs'}",
            "%%rtrain --steps 40\nimport rtnb, torch.distributed as dist\n"
            "for s in range(40):\n    rtnb.report({'loss': 10.0 / (s + 1) + dist.get_rank()})",
            "%rtnb stop",
        ],
    )
    with _opened(url, name, tmp_path) as page:
        page.keyboard.press("Shift+Enter")  # train
        _wait_idle(page)
        page.wait_for_selector(
            ".js-plotly-plot .updatemenu-button", state="attached", timeout=60_000
        )
        page.keyboard.press("Shift+Enter")  # stop
        _wait_idle(page)
        page.keyboard.press("Control+s")
        page.wait_for_timeout(1500)
    # A new kernel: forget the old one, as closing JupyterLab would.
    for session in json.load(urllib.request.urlopen(f"{url}/api/sessions?token={TOKEN}")):
        request = urllib.request.Request(
            f"{url}/api/sessions/{session['id']}?token={TOKEN}", method="DELETE"
        )
        urllib.request.urlopen(request)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--no-first-run"]
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/lab/tree/{name}?token={TOKEN}")
            # JupyterLab's plotly renderer shows the PNG it saved with the figure and
            # makes it interactive when the pointer enters it.
            rendered = page.locator(".jp-RenderedPlotly").first
            rendered.wait_for(timeout=90_000)
            saved_png = page.locator(".jp-RenderedPlotly img.plot-img").count()
            rendered.hover()
            page.wait_for_selector(
                ".js-plotly-plot .updatemenu-button", state="attached", timeout=60_000
            )
            before = _plot_state(page)
            text = page.locator(".jp-Notebook").inner_text()
            page.locator(".updatemenu-button:has-text('log y')").first.click()
            page.wait_for_timeout(500)
            after = _plot_state(page)
            page.screenshot(path=str(tmp_path / "reopened.png"), full_page=True)
        finally:
            browser.close()
    assert "model not found" not in text
    assert saved_png == 1, "the figure was saved with its PNG (what GitHub shows)"
    assert before["traces"] == 3, "rank 0, rank 1 and the mean"
    assert {"log y", "raw", "EMA 0.9"} <= set(before["buttons"])
    assert before["type"] == "linear" and after["type"] == "log"
