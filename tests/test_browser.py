"""What a person sees: JupyterLab in Debian's headless Chromium, driven by Playwright.

A `%%rtrain` cell that reports for a few seconds must show a plot whose per-rank
traces grow while the cell is still running; a click on Resume in the checkpoint
browser must continue training from the chosen checkpoint. Skipped where Chromium
or JupyterLab/Playwright are not installed (`.ci/run` installs them).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import rtnb
from tests._jupyter import jupyter_server
from tests._kernel import new_notebook
from tests._margins import until
from tests.conftest import missing, require

pytestmark = [pytest.mark.browser, pytest.mark.ray, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
TOKEN = "rtnb-browser-test"
DOC_IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"


def _require_tools() -> None:
    if not Path(CHROMIUM).exists():
        missing("Debian chromium is not installed (apt-get install chromium)")
    require("playwright.sync_api", "the browser tests drive Chromium with Playwright")
    if shutil.which("jupyter-lab", path=str(Path(sys.executable).parent)) is None:
        missing("jupyterlab is not installed in this environment")


@pytest.fixture(scope="module")
def _lab_server(ray_cluster, tmp_path_factory):
    """One JupyterLab for the module's tests (each in a folder of its own, with no
    kernel, session or saved layout of the test before it)."""
    yield from _lab(tmp_path_factory.mktemp("lab"))


@pytest.fixture
def lab(_lab_server, tmp_path):
    yield from _visit(_lab_server, tmp_path)


@pytest.fixture
def dark_lab(_lab_server, tmp_path):
    yield from _visit(_lab_server, tmp_path, theme="JupyterLab Dark")


THEMES = Path("@jupyterlab") / "apputils-extension" / "themes.jupyterlab-settings"


def _lab(folder: Path):
    _require_tools()
    settings = folder / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    root = folder / "nb"
    root.mkdir()
    with jupyter_server(
        "jupyter-lab",
        root,
        folder / "lab.log",
        TOKEN,
        (
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            f"--LabApp.user_settings_dir={folder / 'settings'}",
            f"--LabApp.workspaces_dir={folder / 'workspaces'}",
        ),
    ) as url:
        yield url, root, folder


def _visit(server, tmp_path: Path, theme: str | None = None):
    """A test's folder in the module's JupyterLab (``theme`` its setting meanwhile);
    after it, its kernels are shut down and its layout forgotten, as a JupyterLab of
    its own would end them."""
    url, root, folder = server
    themes = folder / "settings" / THEMES
    if theme is not None:
        themes.write_text(json.dumps({"theme": theme}))
    mine = root / tmp_path.name
    mine.mkdir()
    try:
        yield url, mine
    finally:
        themes.unlink(missing_ok=True)
        for kernel in _api(url, "api/kernels"):
            _api(url, f"api/kernels/{kernel['id']}", method="DELETE")
        shutil.rmtree(folder / "workspaces", ignore_errors=True)


def _api(url: str, path: str, method: str = "GET"):
    request = urllib.request.Request(f"{url}/{path}?token={TOKEN}", method=method)
    with urllib.request.urlopen(request, timeout=60) as answer:
        body = answer.read()
    return json.loads(body) if body else None


def _doc_picture(target, name: str) -> None:
    """A picture for the manual (docs/images/NAME) of what this test sees: the pages
    show these and no other, so a changed widget changes its picture in the commit
    that changed it (tests/test_docs.py checks every one is shown)."""
    DOC_IMAGES.mkdir(parents=True, exist_ok=True)
    page = target.page
    size = page.viewport_size
    box = target.bounding_box()
    # JupyterLab scrolls the notebook inside its panel, so a picture shows only what
    # fits the window: make the window tall enough for the whole output, then back.
    if box is not None and box["height"] > size["height"] - 250:
        page.set_viewport_size({"width": size["width"], "height": int(box["height"]) + 300})
    try:
        target.scroll_into_view_if_needed()
        page.mouse.move(0, 0)  # no hover tooltip or toolbar left over in the picture
        target.screenshot(path=str(DOC_IMAGES / name))
    finally:
        page.set_viewport_size(size)


def _notebook(folder: Path, cells: list[str]) -> str:
    """The notebook written in the test's folder; its path in JupyterLab."""
    import nbformat

    nbformat.write(new_notebook(cells), folder / "live.ipynb")
    return f"{folder.name}/live.ipynb"


def _listen_for_comm_noise(page, noise: list[str]) -> None:
    """Collect the ids of comms the kernel was sent messages for after closing them:
    ipykernel logs "No such comm: <id>" to the cell-less stderr JupyterLab's log
    console shows. Only the kernel's own comms count (ipywidgets names them with a
    bare hex uuid): the page's widget manager also probes a control comm with a
    dashed id as the notebook opens, before any cell imported ipywidgets, which is
    JupyterLab's own and happens without rtnb too."""

    def frame(payload) -> None:
        data = payload if isinstance(payload, bytes) else payload.encode()
        for comm in re.findall(rb"No such comm: ([0-9a-f]{32})\b", data):
            if comm.decode() not in noise:
                noise.append(comm.decode())

    page.on("websocket", lambda ws: ws.on("framereceived", frame))


# A page too busy to load a large module in anywidget's 2 s for a model to initialize
# (seen beside CI's suite): its main thread held 2.5 s as a module of over 1 MB (the
# size of plotly's page code) is handed to it. plotly's own FigureWidget then stays
# empty for good; rtnb's figures draw (widgets/_figure.py).
SLOW_LARGE_MODULES = """
(() => {
  const makeUrl = URL.createObjectURL;
  URL.createObjectURL = function (object) {
    const url = makeUrl.call(this, object);
    if (object instanceof Blob && object.size > 1000000) {
      const until = Date.now() + 2500;
      while (Date.now() < until) {}
    }
    return url;
  };
})();
"""


# The residual case: anywidget gives up on the tab's first figure (its small module
# held up 2.5 s, as behind another figure's evaluation of plotly's code). Such a model
# hears nothing more; its view tells the kernel, which draws a new figure. The tab
# records that it held the module up (once: not again after a reload).
FIRST_FIGURE_GIVEN_UP = """
(() => {
  if (sessionStorage.getItem("rtnb-test-held-figure")) return;
  const held = new WeakSet();
  const PlainBlob = Blob;
  globalThis.Blob = class extends PlainBlob {
    constructor(parts, options) {
      super(parts, options);
      const text = (parts || []).filter((p) => typeof p === "string").join("");
      if (!globalThis.__rtnb_test_held_figure && text.includes("MISSED_AFTER_MS")) {
        globalThis.__rtnb_test_held_figure = true;
        sessionStorage.setItem("rtnb-test-held-figure", "1");
        held.add(this);
      }
    }
  };
  const makeUrl = URL.createObjectURL;
  URL.createObjectURL = function (object) {
    if (held.has(object)) {
      const until = Date.now() + 2500;
      while (Date.now() < until) {}
    }
    return makeUrl.call(this, object);
  };
})();
"""


@contextlib.contextmanager
def _opened(
    url: str,
    name: str,
    tmp_path: Path,
    noise: list[str] | None = None,
    init_script: str | None = None,
    page_path: str = "lab/tree",
):
    """The notebook open in headless Chromium with its first cell (`%rtnb start`) run;
    ``noise`` collects the kernel's "No such comm" lines over the whole visit;
    ``init_script`` runs in the page before its own scripts; ``page_path`` is the
    client's page for a notebook (``notebooks`` for Notebook 7, on the same server)."""
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
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            if page_path == "notebooks":
                # Notebook 7 opens on its file browser, and a notebook opened from
                # there gets a tab of its own: the browser's tab stays open beside it.
                context.new_page().goto(f"{url}/tree/{Path(name).parent}?token={TOKEN}")
            page = context.new_page()
            if noise is not None:
                _listen_for_comm_noise(page, noise)
            if init_script is not None:
                page.add_init_script(init_script)
            page.goto(f"{url}/{page_path}/{name}?token={TOKEN}")
            page.wait_for_selector(
                ".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=240_000
            )
            # The first execute request can be lost while the kernel connection is
            # still settling on a cold start: retry until the cell really runs.
            # Re-send only when the cell never started: a start that is merely slow
            # must not be queued twice.
            first = page.locator(".jp-Cell").first
            prompt = first.locator(".jp-InputPrompt")
            for attempt in range(4):
                dialog = page.locator(".jp-Dialog")
                if dialog.count():
                    # JupyterLab asked something while the kernel settled (which
                    # kernel, a lost connection): take its default, as a user would.
                    page.screenshot(path=str(tmp_path / f"dialog_{attempt}.png"), full_page=True)
                    dialog.locator(".jp-mod-accept").first.click()
                    dialog.wait_for(state="detached", timeout=30_000)
                first.click()
                page.keyboard.press("Escape")
                page.keyboard.press("Shift+Enter")  # start the group
                try:
                    page.wait_for_function(
                        "el => /\\[(\\*|\\d+)\\]/.test(el.textContent)",
                        arg=prompt.element_handle(),
                        timeout=20_000,
                    )
                    break
                except Exception:
                    page.screenshot(
                        path=str(tmp_path / f"start_attempt_{attempt}.png"), full_page=True
                    )
                    if attempt == 3:
                        raise
            # A re-sent start whose first send was only slow to show runs twice; the
            # second then says the group is already running, which is the group
            # this visit wanted, so either line means started.
            started = "gloo" if attempt == 0 else "gloo|a worker group is already running"
            try:
                page.wait_for_function(
                    "([el, words]) => new RegExp(words).test("
                    "el.querySelector('.jp-OutputArea')?.textContent ?? '')",
                    arg=[first.element_handle(), started],
                    timeout=180_000,
                )
            except Exception as exc:
                page.screenshot(path=str(tmp_path / "start_not_seen.png"), full_page=True)
                shown = first.locator(".jp-OutputArea").inner_text()[-2000:]
                raise AssertionError(
                    f"`%rtnb start` did not say it started within 180 s: the kernel "
                    f"{_kernel_status(page)!r}, its prompt {prompt.inner_text()!r}, "
                    f"its output {shown!r} (screenshot: {tmp_path}/start_not_seen.png)"
                ) from exc
            yield page
        finally:
            browser.close()


def _kernel_status(page) -> str | None:
    return page.evaluate(
        "() => document.querySelector('.jp-Notebook-ExecutionIndicator')?.getAttribute('data-status')"
    )


def _wait_idle(page, timeout_s: float = 240) -> None:
    time.sleep(0.5)  # let the busy status arrive first
    until("the kernel idle in JupyterLab", lambda: _kernel_status(page) == "idle", timeout_s)


def _plot_lengths(page, cell: int | None = None) -> list[int]:
    """The trace lengths of the first plot (in notebook cell ``cell``, if given)."""
    return page.evaluate(
        "i => { const root = i === null ? document : document.querySelectorAll('.jp-Cell')[i];"
        " const el = root && root.querySelector('.js-plotly-plot');"
        " return el && el.data ? el.data.map(t => (t.y || []).length) : []; }",
        cell,
    )


def _seen_growing(
    page, deadline_s: float, cell: int | None = None, size=lambda lengths: lengths[0]
) -> list[list[int]]:
    """Samples of a live plot's trace lengths until ``size`` of them (the first
    trace's length by default) grew 3 times."""
    samples: list[list[int]] = []
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        lengths = _plot_lengths(page, cell)
        if lengths:
            samples.append(lengths)
            sizes = [size(s) for s in samples]
            if sum(a < b for a, b in zip(sizes, sizes[1:])) >= 3:
                break
        time.sleep(0.5)
    return samples


def _luminance(color: str) -> float:
    """WCAG relative luminance of a CSS colour ("#rrggbb", "rgb(r, g, b)")."""
    color = color.strip()
    if color.startswith("#"):
        digits = color[1:]
        if len(digits) in (3, 4):  # #rgb(a) stands for #rrggbb(aa)
            digits = "".join(d * 2 for d in digits)
        channels = [int(digits[i : i + 2], 16) for i in (0, 2, 4)]
    else:
        channels = [int(float(c)) for c in color[color.index("(") + 1 : -1].split(",")[:3]]

    def linear(c: float) -> float:
        c /= 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(c) for c in channels)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _contrast(a: str, b: str) -> float:
    la, lb = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def _colours(page) -> dict:
    """What the page paints: its background, every plot line's colour, every plot
    button's face and text (the lasting figures' own controls) and the colour of the
    figures' other text (ticks, axis titles, legends)."""
    return page.evaluate(
        "() => { const probe = document.createElement('div');"
        " probe.style.background = 'var(--jp-layout-color0)'; document.body.appendChild(probe);"
        " const bg = getComputedStyle(probe).backgroundColor; probe.remove();"
        " const lines = [...document.querySelectorAll('.js-plotly-plot .scatterlayer path.js-line')]"
        "  .map(p => p.style.stroke || p.getAttribute('stroke')).filter(Boolean);"
        " const buttons = [...document.querySelectorAll('.updatemenu-button')].map(b => ({"
        "  face: b.querySelector('rect').style.fill || b.querySelector('rect').getAttribute('fill'),"
        "  text: b.querySelector('text').style.fill || b.querySelector('text').getAttribute('fill')}));"
        " const texts = [...document.querySelectorAll('.js-plotly-plot .main-svg text')]"
        "  .filter(t => t.textContent.trim() && !t.closest('.updatemenu-container, .hoverlayer'))"
        "  .map(t => getComputedStyle(t).fill);"
        " return {background: bg, lines, buttons, texts}; }"
    )


def _colours_settled(page, theme: str, timeout_s: float = 20) -> dict:
    """``_colours`` once they read well, or as they are at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        colours = _colours(page)
        try:
            _assert_readable(colours, theme)
            return colours
        except AssertionError:
            if time.monotonic() > deadline:
                return colours
        time.sleep(0.3)


def _assert_readable(colours: dict, theme: str) -> None:
    background = colours["background"]
    assert colours["lines"] and colours["buttons"], colours
    for line in set(colours["lines"]):
        ratio = _contrast(line, background)
        assert ratio >= 3.0, f"{theme}: a plot line {line} on {background} is {ratio:.2f}:1"
    for button in colours["buttons"]:
        ratio = _contrast(button["text"], button["face"])
        assert ratio >= 4.5, f"{theme}: button text {button} is {ratio:.2f}:1"
    assert colours["texts"], colours
    for text in set(colours["texts"]):
        ratio = _contrast(text, background)
        assert ratio >= 4.5, f"{theme}: figure text {text} on {background} is {ratio:.2f}:1"


# Each text of the tables (headers, cells, badges) with the colour it is painted on:
# the page's background with every see-through background above it laid over.
_TABLE_TEXTS = """() => {
  const rgba = (c) => { const m = c.match(/[\\d.]+/g).map(Number);
    return [m[0], m[1], m[2], m.length > 3 ? m[3] : 1]; };
  const over = (top, under) => top.map((v, i) => i < 3 ? v * top[3] + under[i] * (1 - top[3]) : 1);
  const probe = document.createElement('div');
  probe.style.background = 'var(--jp-layout-color0)'; document.body.appendChild(probe);
  const page = rgba(getComputedStyle(probe).backgroundColor); probe.remove();
  return [...document.querySelectorAll('.rtnb-table th, .rtnb-table td > span, .rtnb-badge')]
    .filter((el) => el.textContent.trim())
    .map((el) => {
      const layers = [];
      for (let at = el; at; at = at.parentElement) layers.push(rgba(getComputedStyle(at).backgroundColor));
      const ground = layers.reverse().reduce((under, top) => top[3] ? over(top, under) : under, page);
      const ink = over(rgba(getComputedStyle(el).color), ground);
      return {text: el.textContent.trim(), ink: `rgb(${ink.slice(0, 3).join(',')})`,
              ground: `rgb(${ground.slice(0, 3).join(',')})`};
    });
}"""


def _assert_tables_readable(page, theme: str) -> None:
    texts = page.evaluate(_TABLE_TEXTS)
    assert texts, "no table text on the page"
    for item in texts:
        ratio = _contrast(item["ink"], item["ground"])
        assert ratio >= 4.5, f"{theme}: table text {item} is {ratio:.2f}:1"


def _lag_sample(page, cell: int) -> dict:
    """The live view of notebook cell ``cell`` at one instant: its header, and the last
    step each rank's trace draws."""
    return page.evaluate(
        "i => { const c = document.querySelectorAll('.jp-Cell')[i];"
        " const head = c && c.querySelector('.widget-html-content');"
        " const el = c && c.querySelector('.js-plotly-plot');"
        " const last = {};"
        " for (const t of (el && el.data) || []) {"
        "  if (t.name && t.name.startsWith('rank ')) {"
        "   const xs = Array.from(t.x || []); last[t.name] = xs.length ? xs[xs.length - 1] : null; } }"
        " return {header: head ? head.textContent : '', last}; }",
        cell,
    )


# One training step of the demo's character model (rtnb.demo) per call, for cells
# whose loop the test ends: the live view shows real training, as in the manual.
DEMO_STEPS = """import os, time, torch, rtnb
from torch.utils.data import DataLoader
from rtnb.demo import CharModel, char_datasets
torch.manual_seed(0)
train_set, _ = char_datasets()
loader = rtnb.prepare_data_loader(DataLoader(train_set, batch_size=128, shuffle=True))
net = CharModel()
model = rtnb.prepare_model(net)
opt = torch.optim.Adam(model.parameters(), lr=0.003)
def batches():
    while True:
        yield from loader
batch = batches()
def demo_step():
    xb, yb = next(batch)
    logits = model(xb)
    loss = torch.nn.functional.cross_entropy(logits, yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {"loss": loss.item(), "accuracy": (logits.argmax(-1) == yb).float().mean().item()}
"""


# The ranks leave a DDP loop at the same step: one that saw the file a step before
# the other would leave its peer waiting in the next backward's all-reduce for ever
# (half-speed run K: rank 0 ran one step more and the cell never ended).
SEEN_BY_ALL = """def seen_by_all(path):
    flag = torch.tensor([float(os.path.exists(path))])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())
"""


def test_live_plot_grows_while_the_cell_runs(dark_lab, tmp_path):
    """In the dark theme, on a page slow to load plotly's code and that anywidget's
    2 s cost the first figure: the live plot grows (a new figure for the one that
    could not hear the kernel), fills the output width and has no white box;
    reloaded while a background cell runs, the tab shows the plot live again."""
    url, root = dark_lab
    name = _notebook(
        root,
        [
            f"%load_ext rtnb\n%rtnb start --storage {tmp_path / 'runs'}",
            # Reports until the test has seen the plot grow (a file ends it), so no
            # timing of the machine decides what the test can observe.
            # The demo's model (its picture is the manual's), one step a report.
            "%%rtrain --steps 5000\n" + DEMO_STEPS + SEEN_BY_ALL + "s = 0\n"
            f"while not seen_by_all({str(tmp_path / 'seen')!r}) and s < 5000:\n"
            "    s += 1\n    rtnb.report(demo_step())\n    time.sleep(0.03)",
            # The same in the background: the kernel stays free to answer a reload.
            # A checkpoint every 100 steps, for the browser's table in the dark theme.
            f"%%rtrain --steps 5000 --background\ns = 0\n"
            f"while not seen_by_all({str(tmp_path / 'seen-again')!r}) and s < 5000:\n"
            "    s += 1\n"
            "    saved = rtnb.Checkpoint.from_state({'s': s}) if s % 100 == 1 else None\n"
            "    rtnb.report(demo_step(), checkpoint=saved)\n    time.sleep(0.03)",
            "%rtnb wait\n%rtnb checkpoints",
            "%rtnb stop",
        ],
    )
    noise: list[str] = []
    slow_page = SLOW_LARGE_MODULES + FIRST_FIGURE_GIVEN_UP
    with _opened(url, name, tmp_path, noise, init_script=slow_page) as page:
        page.keyboard.press("Shift+Enter")  # the reporting cell
        page.wait_for_selector(".js-plotly-plot", timeout=240_000)
        samples = _seen_growing(page, 150)
        assert page.evaluate("() => globalThis.__rtnb_test_held_figure === true")
        # While it runs: how far behind the header's step each rank's trace is.
        lags = []
        for _ in range(10):
            lags.append(_lag_sample(page, 1))
            time.sleep(0.5)
        page.screenshot(path=str(tmp_path / "live_plot_dark.png"), full_page=True)
        _doc_picture(
            page.locator(".jp-Cell").nth(1).locator(".jp-OutputArea"), "live-view-dark.png"
        )
        look = page.evaluate(
            "() => { const el = document.querySelector('.js-plotly-plot');"
            " const area = el.closest('.jp-OutputArea-output');"
            " const svg = el.querySelector('.main-svg');"
            " return {plot: svg.getBoundingClientRect().width,"
            "  area: area.getBoundingClientRect().width,"
            "  paper: getComputedStyle(svg).backgroundColor,"
            "  theme: document.body.dataset.jpThemeName,"
            "  light: document.body.dataset.jpThemeLight}; }"
        )
        header = page.locator(".widget-html-content").first.inner_text()
        (tmp_path / "seen").write_text("stop")
        _wait_idle(page)  # the foreground cell ended; the background one starts next
        page.wait_for_selector(".updatemenu-button", state="attached", timeout=150_000)
        # The lasting figure, its lines and buttons. Where this cell was sent before
        # the page's theme answer reached the kernel (it queues behind the cell), the
        # figure is drawn again in the dark theme's colours once the answer comes.
        dark_colours = _colours_settled(page, "dark")
        # Known once the cell ended (a running cell's prompt reads [*]).
        prompt = page.locator(".jp-Cell").nth(1).locator(".jp-InputPrompt").inner_text()
        page.keyboard.press("Shift+Enter")
        in_cell_2 = (
            "() => { const c = document.querySelectorAll('.jp-Cell')[2];"
            " return !!(c && c.querySelector('.js-plotly-plot')); }"
        )
        page.wait_for_function(in_cell_2, timeout=240_000)
        # While the background cell runs: save, reload the tab, and the live plot is
        # back and drawing (the kernel answers the page's widget requests).
        time.sleep(1)  # let the live view settle in the output before saving it
        page.keyboard.press("Control+s")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:  # JupyterLab may be writing the file right now
                saved = json.loads((root / "live.ipynb").read_text())["cells"][2].get("outputs", [])
            except ValueError:
                saved = []
            if any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in saved):
                break
            time.sleep(0.3)
        page.reload()
        try:
            page.wait_for_function(in_cell_2, timeout=240_000)
        finally:
            page.screenshot(path=str(tmp_path / "reloaded.png"), full_page=True)
        after_reload = _seen_growing(page, 60, cell=2)
        # The background cell leaves the kernel free: a click on rank 1's chip takes
        # its traces off the plot, a second brings them back.
        traced = (
            "() => { const p = document.querySelectorAll('.jp-Cell')[2]"
            ".querySelector('.js-plotly-plot');"
            " return p && p.data ? p.data.some(t => t.name === 'rank 1') : null; }"
        )
        chip = page.locator(".jp-Cell").nth(2).locator(".rtnb-chip:text-is('1')")
        chip.click()
        page.wait_for_function(f"() => ({traced})() === false", timeout=150_000)
        chip.click()
        page.wait_for_function(f"() => ({traced})() === true", timeout=150_000)
        (tmp_path / "seen-again").write_text("stop")
        page.locator(".jp-Cell").nth(3).click()
        page.keyboard.press("Escape")
        page.keyboard.press("Shift+Enter")  # %rtnb wait, %rtnb checkpoints
        page.locator(".rtnb-ckpt-rows tbody tr[data-id]").first.wait_for(timeout=240_000)
        _wait_idle(page)
        _assert_tables_readable(page, "dark")
        page.keyboard.press("Shift+Enter")  # %rtnb stop
        _wait_idle(page)
    assert look["theme"] == "JupyterLab Dark" and look["light"] == "false", look
    assert look["paper"] in ("rgba(0, 0, 0, 0)", "transparent"), f"a white box: {look}"
    assert look["plot"] >= 0.9 * look["area"], f"the plot does not fill the output: {look}"
    firsts = [s[0] for s in after_reload]
    assert sum(a < b for a, b in zip(firsts, firsts[1:])) >= 3, (
        f"after a reload the plot did not come back live: {after_reload}"
    )
    assert len(samples) >= 3, f"plot seen too rarely: {samples}"
    assert len(samples[-1]) >= 2, "one trace per rank (plus the mean)"
    growing = [s[0] for s in samples]
    assert growing[-1] > growing[0], f"traces did not grow while the cell ran: {growing}"
    assert any(a < b for a, b in zip(growing, growing[1:]))
    assert "step" in header
    assert (tmp_path / "live_plot_dark.png").stat().st_size > 10_000
    _assert_readable(dark_colours, "dark")
    _assert_plot_keeps_up(lags, prompt)
    # Live views ended, one reloaded page: no message reached a comm the kernel closed.
    assert noise == [], f"messages for closed comms: {noise}"


def _assert_plot_keeps_up(lags: list[dict], prompt: str) -> None:
    """Every rank is drawn in every sample, the header names the cell as its In [N]
    prompt does, and the plot is a few seconds behind the header's step at most."""
    import re

    behind, rates = [], []
    for sample in lags:
        assert set(sample["last"]) == {"rank 0", "rank 1"}, f"a rank is not drawn: {sample}"
        number = re.search(r"\[(\d+)\]", prompt).group(1)
        assert sample["header"].startswith(f"[{number}]"), (prompt, sample["header"])
        step = re.search(r"step (\d+)", sample["header"])
        rate = re.search(r"([\d.]+) steps/s", sample["header"])
        if step is None or rate is None or None in sample["last"].values():
            continue
        behind.append(int(step.group(1)) - min(sample["last"].values()))
        rates.append(float(rate.group(1)))
    assert len(behind) >= 5, f"too few samples with a step: {lags}"
    typical = sorted(behind)[len(behind) // 2]
    # Bounds with room for Chromium, JupyterLab and Ray sharing 2 cores; the lag
    # itself is live_view.py's figure. They still catch the bug that was a plot ~7 s
    # behind, catching up at the end.
    assert typical <= 3 * max(rates) + 5, (
        f"the plot lags the header by {behind} steps ({rates} steps/s)"
    )
    assert max(behind) <= 5 * max(rates) + 5, (
        f"the plot lagged the header by up to {max(behind)} steps ({rates} steps/s)"
    )


def test_resume_button_continues_training_from_the_chosen_checkpoint(lab, tmp_path):
    """Train (loss best at step 4), a syntax error, the checkpoint browser (the star on
    step 4 by the loss's name), Resume from step 2, the runs dashboard open while the
    run is live (the resumed run with its main line), stop. Over the whole visit the
    kernel never hears from a comm it closed, and the light theme reads well."""
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
            "    rtnb.report({'i': i, 'loss': abs(i - 4) + 0.5}, checkpoint=rtnb.Checkpoint.from_state({'i': i}) if dist.get_rank() == 0 else None)\n"
            "    i += 1\n"
            "    time.sleep(0.05)",
            "%%rtrain\nx = (",
            "%rtnb checkpoints",
            f"%rtnb runs {runs} --metric i",
            "%rtnb wait\n%rtnb stop",
        ],
    )
    _finished_run(runs, "other", [10.0 - s for s in range(6)])
    noise: list[str] = []
    with _opened(url, name, tmp_path, noise) as page:
        page.keyboard.press("Shift+Enter")  # train i = 0..7, a checkpoint per step
        _wait_idle(page)
        page.wait_for_selector(".updatemenu-button", state="attached", timeout=150_000)
        light_colours = _colours(page)
        train_prompt = page.locator(".jp-Cell").nth(1).locator(".jp-InputPrompt").inner_text()
        page.keyboard.press("Shift+Enter")  # a syntax error
        _wait_idle(page)
        error_cell = page.locator(".jp-Cell").nth(2)
        error_text = error_cell.locator(".jp-OutputArea-output").inner_text()
        error_prompt = error_cell.locator(".jp-InputPrompt").inner_text()
        page.keyboard.press("Shift+Enter")  # the checkpoint browser
        browser_widget = page.locator(".jp-OutputArea-output:has(.rtnb-ckpt-rows)")
        browser_widget.wait_for(timeout=150_000)
        rows_text = _row_texts(browser_widget)
        # A click on the loss header sorts the table in the page, lowest loss first.
        browser_widget.locator(".rtnb-ckpt-rows th:has-text('loss')").click()
        page.wait_for_function(
            "() => document.querySelector('.rtnb-ckpt-rows tbody tr[data-id] td span')"
            "?.textContent === 'step 4'",
            timeout=150_000,
        )
        rule_text = browser_widget.locator(
            ".widget-html-content:has-text('best')"
        ).first.inner_text()
        resume = browser_widget.locator("button:has-text('Resume')")
        assert resume.is_disabled(), "nothing selected, nothing to resume"
        # Click the timeline's marker of step 2 (it holds i=2: steps count from 0).
        marker = (
            browser_widget.locator(".js-plotly-plot .scatterlayer .trace")
            .first.locator("path.point")
            .nth(2)
        )
        marker.wait_for(timeout=150_000)
        box = marker.bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.wait_for_function(
            "() => [...document.querySelectorAll('.rtnb-ckpt-rows tr.rtnb-selected td span')]"
            ".some(cell => cell.textContent === 'step 2')",
            timeout=150_000,
        )
        resume.click()
        page.wait_for_selector("text=training from i=3", timeout=240_000)
        message = browser_widget.locator(".widget-html-content:has-text('Resume:')").inner_text()
        page.screenshot(path=str(tmp_path / "resumed.png"), full_page=True)
        # The runs dashboard while the run is live (it re-reads live runs every 3 s):
        # select both runs, see both curves and the resumed run's main line.
        page.locator(".jp-Cell").nth(4).click()
        page.keyboard.press("Escape")
        page.keyboard.press("Shift+Enter")
        _tick_rows(page.locator(".rtnb-runs-rows"), {0, 1})
        dashboard_plot = (
            "() => { const d = document.querySelector('.rtnb-runs-rows').closest('.widget-vbox');"
            " const p = d.querySelector('.js-plotly-plot');"
            " return p && p.data ? p.data.map(t => t.name).sort() : []; }"
        )
        page.wait_for_function(f"() => ({dashboard_plot})().length === 3", timeout=150_000)
        before_refreshes = list(noise)
        # Two of the dashboard's refreshes of the live run, each seen on the page.
        read_at = "() => document.querySelector('.rtnb-runs-read')?.textContent ?? ''"
        for _ in range(2):
            shown = page.evaluate(read_at)
            page.wait_for_function(
                f"(shown) => ({read_at})() !== shown", arg=shown, timeout=150_000
            )
        during_refreshes = [c for c in noise if c not in before_refreshes]
        overlaid = page.evaluate(dashboard_plot)
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        page.locator(".jp-Cell").nth(5).click()
        page.keyboard.press("Escape")
        page.keyboard.press("Shift+Enter")  # wait for the resumed cell, stop the group
        page.wait_for_selector(".jp-OutputArea-output:has-text('stopped')", timeout=240_000)
        # The resumed cell's figure draws the branch from step 3 over the first line.
        # It is drawn once the cell's lasting figure reaches the page and plotly has
        # rendered it, which on a slow machine comes after the stop's line: wait for it.
        resumed_plot = (
            "() => { const plots = [...document.querySelectorAll('.js-plotly-plot')]"
            "  .filter(p => p.data && p.data.some(t => t.name === 'earlier line'));"
            " return plots.length ? plots[plots.length - 1].data.map("
            "  t => ({name: t.name, x0: t.x ? Array.from(t.x)[0] : null})) : null; }"
        )
        try:
            page.wait_for_function(resumed_plot, timeout=240_000)
        except Exception:  # noqa: BLE001 - the assertion below says what was drawn
            page.screenshot(path=str(tmp_path / "no_earlier_line.png"), full_page=True)
        traces = page.evaluate(resumed_plot) or []
        time.sleep(2)  # what the page still sends once the views ended
    assert "step-000000002" in message and "running in the background" in message
    assert f"cell {train_prompt.strip(': ')}" in message, (train_prompt, message)
    number = error_prompt.strip("[]: ")
    assert f"In[{number}]" in error_text and "SyntaxError" in error_text, (error_prompt, error_text)
    best = [r for r in rows_text if "★ best" in r]
    assert len(best) == 1 and re.search(r"step\s4(?!\d)", best[0]), rows_text
    assert "best: lowest loss (by its name" in rule_text, rule_text
    frame = rtnb.Result.from_path(str(runs / "clicked")).metrics_dataframe
    values = frame[frame["rank"] == 0]["i"].tolist()
    assert values == [*range(8), *range(3, 8)], "trained 0..7, then resumed at 3 up to 7"
    names = {t["name"]: t["x0"] for t in traces}
    assert names.get("earlier line") == 0 and names.get("rank 0") == 3, traces
    committed = sorted(p.name for p in (runs / "clicked" / "checkpoints").iterdir() if p.is_dir())
    assert "step-000000007" in committed and "step-000000007-b1" in committed, committed
    assert overlaid == ["clicked", "clicked (earlier line)", "other"], overlaid
    # The dashboard refreshes a live run into the same figure (it replaced its figure
    # every 3 s, each one a "No such comm"); every figure the kernel closed (a live
    # view that ended, a timeline rebuilt for a new branch) left a silent stand-in for
    # the answer plotly's view sends to its own close: nothing in the log console.
    assert during_refreshes == [], f"messages for closed comms while refreshing: {noise}"
    assert noise == [], f"messages for closed comms over the visit: {noise}"
    _assert_readable(light_colours, "light")


def _branch_cells(runs: Path, name: str) -> list[str]:
    """Train steps 0..119 (a checkpoint every 5 steps), the checkpoint browser, wait,
    stop: the notebook of the tests that resume from the browser mid-history."""
    return [
        f"%load_ext rtnb\n%rtnb start --storage {runs} --name {name}",
        "%%rtrain\nimport time, rtnb, torch.distributed as dist\n"
        "ck = rtnb.get_checkpoint()\n"
        "i = ck.load_state()['i'] + 1 if ck is not None else 0\n"
        "while i < 120:\n"
        "    keep = dist.get_rank() == 0 and i % 5 == 0\n"
        "    rtnb.report({'loss': 5.0 / (i + 1)},"
        " checkpoint=rtnb.Checkpoint.from_state({'i': i}) if keep else None)\n"
        "    i += 1\n"
        "    time.sleep(0.04)",
        "%rtnb checkpoints",
        "%rtnb wait",
        "%rtnb stop",
    ]


def _page_errors(page) -> list[str]:
    """What the page logs as an error from now on (console errors, uncaught ones)."""
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    return errors


def _resume_mid_history(page) -> None:
    """Run the checkpoint browser's cell, select step 40, click Resume, then wait for
    the resumed cell to end (``%rtnb wait``)."""
    page.keyboard.press("Shift+Enter")  # the checkpoint browser
    browser_widget = page.locator(".jp-OutputArea-output:has(.rtnb-ckpt-rows)")
    browser_widget.wait_for(timeout=150_000)
    row = browser_widget.locator(".rtnb-ckpt-rows tr[data-id]:has(td span:text-is('step 40'))")
    row.wait_for(timeout=150_000)
    row.click()
    page.wait_for_function(
        "() => [...document.querySelectorAll('.rtnb-ckpt-rows tr.rtnb-selected td span')]"
        ".some(cell => cell.textContent === 'step 40')",
        timeout=150_000,
    )
    browser_widget.locator("button:has-text('Resume')").click()
    page.locator(".jp-Cell").nth(3).click()
    page.keyboard.press("Escape")
    page.keyboard.press("Shift+Enter")  # %rtnb wait: until the resumed cell ends
    _wait_idle(page)


# What the resumed cell's view shows once it ended: its header's step, and the last x
# of its own line (its earlier line drawn too).
RESUMED_VIEW = (
    "() => { const box = [...document.querySelectorAll('.jp-OutputArea-output')]"
    "  .find(o => o.querySelector('.rtnb-ckpt-rows'));"
    " const plot = box && [...box.querySelectorAll('.js-plotly-plot')]"
    "  .find(p => p.data && p.data.some(t => t.name === 'earlier line'));"
    " if (!plot) return null;"
    " const own = plot.data.find(t => t.name === 'rank 0');"
    " const xs = own && own.x ? Array.from(own.x) : [];"
    " return {last: xs.length ? xs[xs.length - 1] : null, points: xs.length,"
    "  header: box.innerText}; }"
)


def _resumed_view(page, tmp_path: Path, last: int) -> tuple[dict | None, list]:
    """The resumed cell's view once its line reached ``last`` (or as it is after a
    minute), and every plot's traces (name, last x, points) for the failure message."""
    try:
        page.wait_for_function(
            f"() => {{ const s = ({RESUMED_VIEW})(); return s && s.last === {last}; }}",
            timeout=60_000,
        )
    except Exception:  # noqa: BLE001 - the caller's assertion says what was drawn
        page.screenshot(path=str(tmp_path / "resumed_view.png"), full_page=True)
    drawn = page.evaluate(
        "() => [...document.querySelectorAll('.js-plotly-plot')].map(p => (p.data || [])"
        ".map(t => [t.name, t.x ? Array.from(t.x).slice(-1)[0] : null, t.x ? t.x.length : 0]))"
    )
    return page.evaluate(RESUMED_VIEW), drawn


def _rtnb_errors(errors: list[str]) -> list[str]:
    return [e for e in errors if "rtnb" in e or "setting state" in e.lower()]


def test_a_resumed_runs_live_view_draws_to_its_last_step(lab, tmp_path):
    """Resume from the middle of a run's history in the checkpoint browser: the
    resumed cell's live view keeps drawing, as each new checkpoint of its branch
    lands in the timeline beside it, to the step its header reaches, the earlier line
    drawn faint; no view of rtnb's logs an error in the page."""
    url, root = lab
    name = _notebook(root, _branch_cells(tmp_path / "runs", "branch"))
    with _opened(url, name, tmp_path) as page:
        errors = _page_errors(page)
        page.keyboard.press("Shift+Enter")  # train steps 0..119
        _wait_idle(page)
        _resume_mid_history(page)
        seen, drawn = _resumed_view(page, tmp_path, 119)
        page.keyboard.press("Shift+Enter")  # stop
        _wait_idle(page)
    assert seen is not None, f"the resumed cell's view draws its earlier line: {drawn} {errors}"
    assert "step 119" in seen["header"], seen["header"][-500:]
    assert seen["last"] == 119 and seen["points"] >= 70, seen
    assert not _rtnb_errors(errors), errors


def test_notebook_7_runs_the_quickstart_path_live_resume_and_reload(lab, tmp_path):
    """The same server's Notebook 7 page, its file browser's tab open beside it: start,
    a live view that grows while its cell runs, the checkpoint browser, Resume from mid-history with the resumed view drawn
    to its last step, then save and reload: the figures are there from the saved
    notebook, the live kernel's widgets are back, and no rtnb view logged an error."""
    url, root = lab
    name = _notebook(root, _branch_cells(tmp_path / "runs", "nb7"))
    with _opened(url, name, tmp_path, page_path="notebooks") as page:
        errors = _page_errors(page)
        page.keyboard.press("Shift+Enter")  # train steps 0..119
        grown = _seen_growing(page, 120, cell=1)
        _wait_idle(page)
        _resume_mid_history(page)
        seen, drawn = _resumed_view(page, tmp_path, 119)
        page.keyboard.press("Shift+Enter")  # stop
        _wait_idle(page)
        page.keyboard.press("Control+s")
        until("the notebook saved", lambda: "stopped" in (root / "live.ipynb").read_text(), 60)
        page.reload()
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']")
        rendered = page.locator(".jp-RenderedPlotly").first
        rendered.wait_for(timeout=240_000)
        rendered.hover()
        page.wait_for_selector(
            ".js-plotly-plot .updatemenu-button", state="attached", timeout=240_000
        )
        # The live kernel's widgets are drawn again from its state: the browser's table.
        page.locator(".rtnb-ckpt-rows tr[data-id]").first.wait_for(timeout=120_000)
        reloaded = page.locator(".jp-Notebook").inner_text()
        page.screenshot(path=str(tmp_path / "reloaded.png"), full_page=True)
    # Drawn while the cell ran: at two points or more between its first step and its
    # last, growing (a busy machine's page samples it a few times in its 5 s).
    mid = [lengths[0] for lengths in grown if 0 < lengths[0] < 120]
    assert len(set(mid)) >= 2 and mid == sorted(mid), grown
    assert seen is not None, f"the resumed cell's view draws its earlier line: {drawn} {errors}"
    assert "step 119" in seen["header"] and seen["last"] == 119, seen
    assert "Error displaying widget" not in reloaded and "stopped" in reloaded, reloaded[-2000:]
    assert not _rtnb_errors(errors), errors


def _example_cell(notebook: str, starts: str) -> str:
    """The code cell of an example notebook that starts with ``starts``, as it ships."""
    import nbformat

    nb = nbformat.read(DOC_IMAGES.parent.parent / "notebooks" / notebook, as_version=4)
    return next(c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith(starts))


def _quickstart_cell(starts: str) -> str:
    return _example_cell("quickstart.ipynb", starts)


def test_the_demo_trains_in_jupyterlab_and_gives_the_manuals_pictures(lab, tmp_path):
    """The quickstart's own cells (the demo's character model on Python's source text)
    in JupyterLab: the live view mid-run, the checkpoint browser with the best by the
    validation loss, the runs dashboard — the manual's pictures are of real training,
    and the model it trained did learn (far above chance on held-out text)."""
    url, root = lab
    runs = root / "rtnb_runs"  # beside the notebook, as by default: the titles read ./rtnb_runs
    name = _notebook(
        root,
        [
            f"%load_ext rtnb\n%rtnb start --storage {runs} --name char-model "
            "--score val_loss --mode min",
            "steps = 600\nlr = 0.003",
            _quickstart_cell("%%rtrain\nimport torch, rtnb"),
            _quickstart_cell("%rtnb push"),
            # At a pace that leaves the picture time to be taken mid-run.
            _quickstart_cell("%%rtrain --steps").replace(
                "        rtnb.report(metrics, checkpoint=checkpoint)\n",
                "        rtnb.report(metrics, checkpoint=checkpoint)\n"
                "        __import__('time').sleep(0.03)\n",
            ),
            "%rtnb checkpoints",
            # A second run to compare, as a user tries another learning rate.
            f"%rtnb stop\n%rtnb start --storage {runs} --name char-model-lr-0.01 "
            "--score val_loss --mode min",
            "steps = 300\nlr = 0.01",
            _quickstart_cell("%%rtrain\nimport torch, rtnb"),
            _quickstart_cell("%rtnb push"),
            _quickstart_cell("%%rtrain --steps"),
            f"%rtnb runs {runs} --metric val_accuracy",
            "%rtnb stop",
        ],
    )
    with _opened(url, name, tmp_path) as page:
        for _ in range(4):  # parameters, the ranks' data and model, push, train
            page.keyboard.press("Shift+Enter")
        page.locator(".jp-Cell").nth(4).locator(".js-plotly-plot").wait_for(timeout=240_000)
        # Mid-run: 250 of the 600 steps drawn (or the run already over, on a fast day).
        until(
            "250 of the demo's steps drawn",
            lambda: max(_plot_lengths(page, 4) or [0]) >= 250 or _kernel_status(page) == "idle",
            240,
        )
        _doc_picture(
            page.locator(".jp-Cell").nth(4).locator(".jp-OutputArea"), "live-view-light.png"
        )
        _wait_idle(page)
        trained = page.locator(".jp-Cell").nth(4).locator(".jp-OutputArea").inner_text()
        page.keyboard.press("Shift+Enter")  # the checkpoint browser
        browser_widget = page.locator(".jp-OutputArea-output:has(.rtnb-ckpt-rows)")
        browser_widget.wait_for(timeout=150_000)
        rows_text = _row_texts(browser_widget)
        _assert_tables_readable(page, "light")
        _doc_picture(browser_widget, "checkpoints.png")
        for _ in range(5):  # the second run: its group, parameters, model, push, training
            page.keyboard.press("Shift+Enter")
        page.locator(".jp-Cell").nth(10).locator(".js-plotly-plot").wait_for(timeout=240_000)
        _wait_idle(page, timeout_s=300)
        second = page.locator(".jp-Cell").nth(10).locator(".jp-OutputArea").inner_text()
        page.keyboard.press("Shift+Enter")  # the runs dashboard
        _tick_rows(page.locator(".rtnb-runs-rows"), {0, 1})
        page.wait_for_function(
            "() => { const d = document.querySelector('.rtnb-runs-rows').closest('.widget-vbox');"
            " const p = d.querySelector('.js-plotly-plot'); return p && p.data && p.data.length >= 2; }",
            timeout=150_000,
        )
        _doc_picture(page.locator(".jp-OutputArea-output:has(.rtnb-runs-rows)"), "runs.png")
        page.keyboard.press("Shift+Enter")  # stop
        page.wait_for_selector(".jp-OutputArea-output:has-text('stopped')", timeout=240_000)
    assert "trained 600 steps: validation accuracy" in trained, trained
    assert "trained 300 steps: validation accuracy" in second, second
    result = rtnb.Result.from_path(str(runs / "char-model"))
    # Chance is 1 in 101; the commonest character (a space) is under a fifth of the text.
    assert result.metrics["val_accuracy"] > 0.3, result.metrics
    assert result.metrics["val_loss"] < 3.0, result.metrics
    frame = result.metrics_dataframe
    assert sorted(frame["rank"].unique()) == [0, 1] and len(frame) == 1200
    best = [r for r in rows_text if "★ best" in r]
    assert len(best) == 1 and len(rows_text) >= 12, rows_text


def _row_texts(view) -> list[str]:
    """The text of each row of the table in ``view``, in the order shown."""
    rows = view.locator(".rtnb-table tbody tr[data-id]")
    rows.first.wait_for(timeout=150_000)
    return [row.inner_text() for row in rows.all()]


def _tick_rows(table, indexes: set[int]) -> None:
    """Tick exactly these rows (by their place in the table) of a table that ticks
    several, with clicks as a user's."""
    rows = table.locator("tbody tr[data-id]")
    rows.first.wait_for(timeout=240_000)
    for i in range(rows.count()):
        row = rows.nth(i)
        if ("rtnb-selected" in (row.get_attribute("class") or "")) != (i in indexes):
            row.click()


def _finished_run(runs: Path, name: str, values: list[float]) -> None:
    """A finished run on disk, as another kernel would have left it."""
    from rtnb.metrics._store import MetricsStore
    from rtnb.storage._metricslog import MetricsLog
    from rtnb.storage._rundir import RunDirectory

    run_dir = RunDirectory(str(runs), name)
    run_dir.ensure_writable()
    store = MetricsStore(log=MetricsLog(run_dir))
    store.begin([0])
    store.add(0, [(s, 100.0 + s, {"i": v}) for s, v in enumerate(values)])
    store.flush()
    record = {"run_name": name, "status": "stopped", "config": {"workers": 1}}
    run_dir.write_json("run.json", {**record, "started": 90.0, "updated": 120.0})


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
            ".js-plotly-plot .updatemenu-button", state="attached", timeout=240_000
        )
        page.keyboard.press("Shift+Enter")  # stop
        _wait_idle(page)
        page.keyboard.press("Control+s")
        page.wait_for_timeout(1500)
    # A new kernel: forget the old one, as closing JupyterLab would.
    for session in _api(url, "api/sessions"):
        _api(url, f"api/sessions/{session['id']}", method="DELETE")
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
            rendered.wait_for(timeout=240_000)
            saved_png = page.locator(".jp-RenderedPlotly img.plot-img").count()
            rendered.hover()
            page.wait_for_selector(
                ".js-plotly-plot .updatemenu-button", state="attached", timeout=240_000
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


def test_a_sweeps_trials_grow_live_and_its_best_resumes_with_a_click(lab, tmp_path):
    """A sweep of two trials on a reused group: the view's per-trial curves grow while
    it runs, picking a row shows only that trial, and once it is over the lasting
    figure and table stay while Resume carries the best trial on in the notebook's
    group (its checkpoint loaded, its config on the ranks). The trials are the sweep
    notebook's own (the demo's character model), and the manual's picture is taken
    of them live."""
    url, root = lab
    trial = _example_cell("sweep.ipynb", "%%rtnb sweep").split("\n", 1)[1]
    # At a pace that leaves the view time to be seen growing; and no trial reports its
    # last step before the test has picked a row: at the sweep's end the live view
    # gives way to the lasting figure of every trial, and a pick racing that end was
    # lost (seen at normal speed).
    picked = tmp_path / "picked"
    trial = trial.replace(
        "        rtnb.report(metrics, checkpoint=checkpoint)\n",
        "        rtnb.report(metrics, checkpoint=checkpoint)\n"
        "        __import__('time').sleep(0.2)\n"
        f"        while step == steps - 2 and not __import__('os').path.exists({str(picked)!r}):\n"
        "            __import__('time').sleep(0.1)\n",
    )
    runs = tmp_path / "runs"
    name = _notebook(
        root,
        [
            f"%load_ext rtnb\n%rtnb start --cpus-per-worker 0.5 --storage {runs} --name nb",
            "from ray import tune\nspace = {'lr': tune.grid_search([0.01, 0.0003]), 'steps': 40}",
            "%%rtnb sweep space --metric loss --mode min --cpus-per-worker 0.5 --name lr-search\n"
            + trial,
            "%rtnb wait\n%rtnb pull lr",
            "%rtnb stop",
        ],
    )
    noise: list[str] = []
    with _opened(url, name, tmp_path, noise) as page:
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        try:
            page.keyboard.press("Shift+Enter")  # the space
            _wait_idle(page)
            page.keyboard.press("Shift+Enter")  # the sweep
            view = page.locator(".jp-OutputArea-output:has(.rtnb-sweep-rows)")
            view.wait_for(timeout=240_000)
            # Both trials started (one after the other: the second's group starts later).
            both_drawn = (
                "() => { const c = document.querySelectorAll('.jp-Cell')[2];"
                " const p = c && c.querySelector('.js-plotly-plot');"
                " return p && p.data && p.data.length === 3 && p.data[1].y && p.data[1].y.length > 0; }"
            )
            try:
                page.wait_for_function(both_drawn, timeout=240_000)
            except Exception:
                # Seen beside CI's suite before widgets/_figure.py: a figure whose page
                # code took over 2 s to load stayed empty ([[]]); what it shows is kept.
                page.screenshot(path=str(tmp_path / "no_second_trial.png"), full_page=True)
                # Plotly's widget draws an empty placeholder (no ticks) as it is
                # attached, then the figure's data once attached.
                drawn = page.evaluate(
                    "() => [...document.querySelectorAll('.jp-Cell')[2]"
                    ".querySelectorAll('.js-plotly-plot')].map(p => ({traces: (p.data || [])"
                    ".map(t => [t.name, t.y ? t.y.length : 0]), placeholder: !!(p.layout"
                    " && p.layout.xaxis && Array.isArray(p.layout.xaxis.tickvals)),"
                    " attached: p.isConnected, height: p.offsetHeight}))"
                )
                raise AssertionError(
                    f"the sweep's live figure drew {drawn} in 240 s; page errors {errors[-5:]}"
                ) from None
            # The points of all trials together: on a slow machine the first trial may have
            # finished all its steps by the time the second one drew its first point.
            samples = _seen_growing(page, 60, cell=2, size=sum)
            assert len(samples) >= 3 and sum(samples[-1]) > sum(samples[0]), samples
            assert len(samples[-1]) == 3, "two trials and the stopped-early marks"
            _doc_picture(view, "sweep.png")
            # Pick trial 1's row: only its curve stays visible. The table is drawn
            # again each second while trials run: a click that landed as its rows were
            # replaced is made again.
            only_trial_1 = (
                "() => { const c = document.querySelectorAll('.jp-Cell')[2];"
                " const p = c && c.querySelector('.js-plotly-plot');"
                " return p && p.data && p.data[0].visible === false && p.data[1].visible !== false; }"
            )
            for attempt in range(3):
                _tick_rows(view.locator(".rtnb-sweep-rows"), {1})  # sorted by trial
                try:
                    page.wait_for_function(only_trial_1, timeout=60_000)
                    break
                except Exception:
                    page.screenshot(path=str(tmp_path / f"pick_{attempt}.png"), full_page=True)
                    if attempt == 2:
                        raise
            picked.touch()
            _wait_idle(page, timeout_s=240)
            cell = page.locator(".jp-Cell").nth(2)
            cell.locator(".jp-RenderedPlotly, .js-plotly-plot").first.wait_for(timeout=150_000)
            table = cell.locator(".jp-OutputArea-output:has-text('last loss')").first.inner_text()
            assert "lr=0.01" in table and "lr=0.0003" in table
            # The live view is gone (its buttons belong to closed widgets), the panel is up.
            page.wait_for_function(
                "() => !document.querySelectorAll('.jp-Cell')[2].querySelector('.rtnb-sweep-rows')",
                timeout=240_000,
            )
            resume = cell.locator(".rtnb-sweep-resume button:has-text('Resume')")
            resume.wait_for(timeout=240_000)
            resume.click()
            page.wait_for_selector("text=carries on in the notebook", timeout=240_000)
            page.locator(".jp-Cell").nth(3).click()
            page.keyboard.press("Escape")
            page.keyboard.press("Shift+Enter")  # wait for the resumed cell, pull lr
            _wait_idle(page, timeout_s=240)
            pulled = (
                page.locator(".jp-Cell").nth(3).locator(".jp-OutputArea-output").last.inner_text()
            )
            page.screenshot(path=str(tmp_path / "sweep.png"), full_page=True)
            page.keyboard.press("Shift+Enter")  # stop
            _wait_idle(page)
        finally:
            picked.touch()  # no trial left waiting, whatever failed

    # Adam at 0.01 learns far faster in 40 steps than at 0.0003: the best trial's lr.
    assert "0.01, 0.01" in pulled.replace("[", "").replace("]", ""), pulled
    assert not noise, f"the kernel heard from comms it had closed: {noise}"


# Trains the demo's model until the live view's input sets lr to 0.5 (every rank
# takes it at the same step, so both leave together), then rank 1 alone runs a
# validation pass while rank 0 sits in an all_reduce: the hang the doctor is for
# (the pass ends once the test has its picture).
INSIDE = (
    "%%rtrain\n"
    + DEMO_STEPS
    + """import torch.distributed as dist
rank = rtnb.get_context().world_rank
_, val_set = char_datasets()
def held_out(until):
    while True:
        for xb, yb in DataLoader(val_set, batch_size=256):
            if os.path.exists(until):
                return
            yield xb, yb
while True:
    lr = rtnb.control("lr", 0.003)
    for group in opt.param_groups:
        group["lr"] = lr
    t = torch.tensor([lr])
    dist.all_reduce(t)
    rtnb.report({**demo_step(), "lr": lr})
    if float(t) >= 1.0:
        break
    time.sleep(0.05)
if rank == 1:  # validation on rank 1 alone: rank 0 waits for it in the all_reduce
    with torch.no_grad():
        for xb, yb in held_out(FLAG):
            net(xb)
dist.all_reduce(torch.ones(1))
"""
)
# Rank 1's validation pass, by its lines in the cell as the notebook's editor numbers
# them (`%%rtrain` is line 1): where the doctor may find it.
_LINES = INSIDE.splitlines()
_HELD_OUT = _LINES.index("def held_out(until):")
VALIDATION_LINES = {1 + i for i in range(_HELD_OUT + 1, _HELD_OUT + 6)} | {
    1 + i
    for i, line in enumerate(_LINES)
    if line.strip().startswith(("for xb, yb in held_out", "net(xb)"))
}


def test_the_stacks_panel_a_control_input_and_a_ranks_debugger_prompt_in_jupyterlab(lab, tmp_path):
    """While a foreground cell keeps the kernel busy, the live view's Stacks button
    shows every rank's stack and a control changed from its input reaches the
    ranks (their clicks go to a kernel subshell); the hang doctor's stacks then
    appear unasked and name rank 1's line; a breakpoint on rank 1 is answered in
    JupyterLab's input box."""
    url, root = lab
    flag = tmp_path / "go"
    name = _notebook(
        root,
        [
            "%load_ext rtnb\n%rtnb start --cpus-per-worker 0.5 --storage rtnb_runs --hang-after 3",
            f"FLAG = {str(flag)!r}\n%rtnb push FLAG",
            INSIDE,
            "%%rtrain\nimport rtnb\nx = 40 + rtnb.get_context().world_rank\n"
            "rtnb.breakpoint(rank=1)\nx",
            "%rtnb stop",
        ],
    )
    with _opened(url, name, tmp_path) as page:
        page.keyboard.press("Shift+Enter")  # FLAG
        _wait_idle(page)
        page.keyboard.press("Shift+Enter")  # the training cell, in the foreground
        controls = page.locator(".rtnb-controls")
        controls.locator("input").first.wait_for(timeout=240_000)
        assert "lr" in controls.inner_text()
        assert _kernel_status(page) == "busy"
        page.locator("button:has-text('Stacks')").click()
        page.wait_for_selector(".rtnb-stacks:has-text('rank')", timeout=150_000)
        assert "no report or output" not in page.locator(".rtnb-stacks").inner_text()
        controls.locator("input").first.fill("0.5")
        controls.locator("button:has-text('Set')").click()
        page.wait_for_selector(".rtnb-controls:has-text('lr = 0.5 from step')", timeout=240_000)
        # The loop left at the change; rank 1 now waits: the doctor shows the stacks.
        stacks = page.locator(".rtnb-stacks:has-text('no report or output for')")
        stacks.wait_for(timeout=240_000)
        text = stacks.inner_text()
        seen = re.search(r"rank 1: in .*? at cell \[3\] line (\d+)", text)
        assert seen and int(seen.group(1)) in VALIDATION_LINES, (VALIDATION_LINES, text)
        assert "rank 0: in all_reduce" in text, text
        page.screenshot(path=str(tmp_path / "stacks.png"), full_page=True)
        _doc_picture(page.locator(".jp-Cell").nth(2).locator(".jp-OutputArea"), "stacks.png")
        flag.touch()
        _wait_idle(page, timeout_s=240)
        page.locator(".jp-Cell").nth(3).click()
        page.keyboard.press("Escape")
        page.keyboard.press("Shift+Enter")  # the breakpoint cell
        stdin = page.locator(".jp-Stdin-input")
        stdin.wait_for(timeout=240_000)
        assert "(Pdb rank 1)" in page.locator(".jp-Stdin-prompt").last.inner_text()
        stdin.fill("p x")
        stdin.press("Enter")
        page.wait_for_selector(".jp-Cell >> nth=3 >> text=41", timeout=150_000)
        # The answered prompt stays as text; the next one is a new input box.
        page.wait_for_function(
            "() => document.querySelectorAll('.jp-Stdin-input').length === 2", timeout=150_000
        )
        page.locator(".jp-Stdin-input").last.fill("c")
        page.locator(".jp-Stdin-input").last.press("Enter")
        _wait_idle(page, timeout_s=240)
        out = page.locator(".jp-Cell").nth(3).locator(".jp-OutputArea").inner_text()
        page.screenshot(path=str(tmp_path / "debugger.png"), full_page=True)
        page.locator(".jp-Cell").nth(4).click()
        page.keyboard.press("Escape")
        page.keyboard.press("Shift+Enter")  # stop
        _wait_idle(page)
    assert "(Pdb rank 1)" in out and "[rank 1] 41" in out and "[rank 0] 40" in out, out
    assert "[rank -1]" not in out
