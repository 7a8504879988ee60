"""The manual: built strictly and offline, its references generated from the code,
its pictures the browser tests' own, and every code example run in a real kernel.

A renamed flag, a removed function or an example that no longer works fails here,
not in the reader's notebook.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from tests._docs import ROOT, doc_pages, examples, notebook_of
from tests.conftest import CLUSTER_CPUS, wait_for_free_cpus

MKDOCS = Path(sys.executable).parent / "mkdocs"
README_LINES = 250


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as `.ci/run` builds it: `mkdocs build --strict`, every warning fatal."""
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-5000:]
    return out


def _text(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


def test_the_magics_reference_lists_every_subcommand_and_flag_the_parsers_accept(site):
    from rtnb.magics._help import parser_flags
    from rtnb.magics._magics import SUBCOMMANDS, RtrainMagics

    text = _text(site / "reference" / "magics.html")
    for sub in SUBCOMMANDS:
        assert f"usage: %rtnb {sub.name}" in text, sub.name
        for flag in sub.flags():
            assert flag in text, f"%rtnb {sub.name} {flag}"
    for flag in parser_flags(RtrainMagics.rtrain_cell.parser):
        assert flag in text, f"%%rtrain {flag}"


def test_the_command_line_reference_lists_every_command_and_option(site):
    import argparse

    from rtnb.batch.cli import _parser

    text = _text(site / "reference" / "cli.html")
    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in commands.choices.items():
        assert f"usage: rtnb {name}" in text, name
        for action in command._actions:
            for option in action.option_strings:
                assert option in text, f"rtnb {name} {option}"


def test_the_api_reference_renders_every_public_name_from_its_docstring(site):
    import rtnb

    page = (site / "reference" / "api.html").read_text()
    for name in rtnb._EXPORTS:
        assert f'id="rtnb.{name}"' in page or f">rtnb.{name}<" in page, name
    # The docstring itself, not only a heading: Session's first line.
    first_line = rtnb.Session.__doc__.strip().splitlines()[0]
    assert html.escape(first_line, quote=False)[:40] in page


def test_troubleshooting_lists_every_message_rtnb_raises(site):
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import hooks
    finally:
        sys.path.remove(str(ROOT / "docs"))
    sites = hooks.raise_sites()
    assert len(sites) > 150, "the raise sites were not found"
    text = " ".join(_text(site / "troubleshooting.html").split())
    for raised in sites:
        assert raised.message.replace("`", "")[:60] in text, raised
    # One the user meets first, as the magic prints it.
    assert "%rtnb has no subcommand {sub}" in text


def test_the_architecture_page_draws_every_state_and_transition_of_the_controller(site):
    from rtnb.driver.lifecycle._states import _ALLOWED, GroupState

    page = (site / "architecture.html").read_text()
    start = page.index('<svg class="rtnb-states"')
    drawn = page[start : page.index("</svg>", start)]
    for state in GroupState:
        assert f">{state}</text>" in drawn, state
    # One arrow per transition the state machine allows, and no other.
    assert drawn.count("marker-end=") == sum(len(targets) for targets in _ALLOWED.values())
    text = " ".join(_text(site / "architecture.html").split())
    assert "recovering" in text and "resizing" in text and "Recovery.recover" in text


def test_the_site_needs_nothing_from_the_network(site):
    """No stylesheet, script, font or image from another host: the site opens offline
    (Material's offline plugin; fonts off)."""
    fetched = re.compile(r"""(?:src|href)\s*=\s*["'](https?:)?//""", re.I)
    css_import = re.compile(r"""url\(\s*["']?(https?:)?//""", re.I)
    for path in site.rglob("*"):
        if path.suffix == ".html":
            # Links a reader clicks (<a href>) may point anywhere; what loads may not.
            loads = re.findall(r"<(?:script|link|img|iframe|source)\b[^>]*>", path.read_text())
            bad = [tag for tag in loads if fetched.search(tag)]
            assert not bad, f"{path.relative_to(site)} loads {bad[:3]}"
        elif path.suffix == ".css":
            assert not css_import.search(path.read_text()), path.relative_to(site)


def test_every_picture_the_pages_show_is_one_the_browser_tests_take(site):
    """The pictures come from tests/test_browser.py (never drawn by hand), and every
    one of them is on a page and in the built site."""
    images = ROOT / "docs" / "images"
    shown = set()
    for page in doc_pages():
        shown |= set(re.findall(r"\]\((?:docs/)?images/([\w.-]+\.png)\)", page.read_text()))
    browser_tests = (ROOT / "tests" / "test_browser.py").read_text()
    # A call's name argument, on the call's line or the next ones (as ruff wraps it).
    taken = set(re.findall(r'\b_doc_picture\((?:[^;]{0,200}?)"([\w.-]+\.png)"\s*\)', browser_tests))
    assert shown and shown <= taken, f"shown but no test takes them: {sorted(shown - taken)}"
    assert taken <= shown, f"taken but on no page: {sorted(taken - shown)}"
    for name in shown:
        assert (images / name).stat().st_size > 5_000, name
        assert (site / "images" / name).exists(), name


def test_the_readme_is_one_screen_of_the_users_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines"
    text = "\n".join(lines)
    # Its two set-up commands, as .ci/run runs them.
    assert "bash .ci/setup && .venv/bin/rtnb demo" in text
    assert "bash .ci/setup && .venv/bin/python -m pytest -q" in text


# Words about how rtnb was made, not about rtnb: a work item's number, a machine
# borrowed for a while, the tools it was built with, a stretch of work's time.
PROCESS_WORDS = re.compile(
    r"\b(?:stops?|issues?)\s+#?\d+\b"
    r"|\blent\s+(?:GPU|machine|through)|\b(?:GPU|machine|none|nothing)\s+was\s+lent\b"
    r"|\bdevice\s+tool\b|\bstructure\s+tool\b|\bduplicates\s+--change\b"
    r"|\b(?:a|this|the|that)\s+session\s+(?:had|ran\s+out|was\s+given)\b"
    r"|\bwork\s+items?\b",
    re.IGNORECASE,
)


def user_facing_files() -> list[Path]:
    """What a user reads: the README, the change log, the manual, the notebooks, the
    deploy recipes, the messages and comments of every shipped module."""
    found = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "CONTRIBUTING.md"]
    for folder, patterns in {
        "docs": ("*.md",),
        "notebooks": ("*.ipynb",),
        "deploy": ("*",),
        "rtnb": ("*.py", "*.c", "*.ipynb", "*.md"),
        "magics": ("*.py",),
        "widgets": ("*.py", "*.js", "*.css"),
        "benchmarks": ("*.py", "*.md"),
    }.items():
        for pattern in patterns:
            found += [p for p in (ROOT / folder).rglob(pattern) if p.is_file()]
    return [p for p in found if p.exists() and "__pycache__" not in p.parts]


def test_user_facing_text_speaks_of_rtnb_alone():
    said = []
    for path in user_facing_files():
        text = path.read_text(errors="replace")
        for match in PROCESS_WORDS.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            said.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)!r}")
    assert not said, "text about how rtnb was made, not about rtnb:\n" + "\n".join(said)


def test_from_ray_train_maps_every_field_of_the_configs_a_script_sets():
    """Each field of the Ray Train configs a user sets has its row (its rtnb flag or
    call, or "none" and why): a field a newer Ray adds fails here."""
    import dataclasses
    import inspect

    import ray.train
    from ray.train.torch import TorchTrainer

    page = (ROOT / "docs" / "ray-train.md").read_text()
    configs = [
        ray.train.ScalingConfig,
        ray.train.RunConfig,
        ray.train.CheckpointConfig,
        ray.train.FailureConfig,
    ]
    wanted = {c.__name__: [f.name for f in dataclasses.fields(c)] for c in configs}
    wanted["DataConfig"] = list(inspect.signature(ray.train.DataConfig).parameters)
    wanted["TorchTrainer"] = list(inspect.signature(TorchTrainer).parameters)
    wanted["Result"] = [
        f.name for f in dataclasses.fields(ray.train.Result) if not f.name.startswith("_")
    ] + ["get_best_checkpoint"]
    for name, fields in wanted.items():
        section = page.split(f"**`{name}", 1)[-1].split("\n**", 1)[0]
        missing = [f for f in fields if f"`{f}" not in section]
        assert not missing, f"docs/ray-train.md's {name} table lacks {missing}"


def test_every_example_not_run_says_why():
    for page in doc_pages():
        for example in examples(page):
            if example.not_run:
                assert len(example.not_run) > 8, f"{example.where}: give the reason"


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "page",
    [p.relative_to(ROOT).as_posix() for p in doc_pages() if notebook_of(p) is not None],
)
def test_every_code_example_runs(page, ray_cluster, tmp_path):
    """The page's examples as one notebook in a fresh kernel on the session's cluster,
    in a folder of its own; a block marked `raises` must fail with that error."""
    assert wait_for_free_cpus(CLUSTER_CPUS, timeout=60) >= CLUSTER_CPUS, "a page left ranks"
    nb = notebook_of(ROOT / page)
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    try:
        client.execute()
    except CellExecutionError as exc:
        where = _failed_cell(nb)
        pytest.fail(f"{where}: the example failed\n{str(exc)[-3000:]}", pytrace=False)
    finally:
        nbformat.write(nb, tmp_path / "page.ipynb")
    for cell in nb.cells:
        meta = cell.metadata["rtnb_example"]
        errors = [o for o in cell.outputs if o.output_type == "error"]
        # IPython prints a magic's UsageError as one line on stderr, not as an error.
        errors += [
            nbformat.NotebookNode(ename="UsageError", evalue=o.text)
            for o in cell.outputs
            if o.output_type == "stream" and o.name == "stderr" and o.text.startswith("UsageError")
        ]
        if meta["raises"]:
            assert errors and errors[0].ename == meta["raises"], (
                f"{meta['where']}: should raise {meta['raises']}, got "
                f"{[e.ename + ': ' + e.evalue for e in errors] or 'no error'}"
            )
    shutil.rmtree(tmp_path / "rtnb_runs", ignore_errors=True)


def _failed_cell(nb) -> str:
    for cell in nb.cells:
        if (
            any(o.output_type == "error" for o in cell.get("outputs", []))
            and not cell.metadata["rtnb_example"]["raises"]
        ):
            return cell.metadata["rtnb_example"]["where"]
    return "a cell"


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_readmes_training_cell_saves_and_resumes_at_one_rank(ray_cluster, tmp_path):
    """The README's way to save and load a model (the plain module `prepare_model`
    was given, not `model.module`) holds where `prepare_model` does not wrap: one
    rank trains, saves, and `%rtnb resume` goes on from the step after the saved one."""
    assert wait_for_free_cpus(CLUSTER_CPUS, timeout=60) >= CLUSTER_CPUS, "a page left ranks"
    training = next(e.code for e in examples(ROOT / "README.md") if e.code.startswith("%%rtrain"))
    cells = [
        "%load_ext rtnb\n%rtnb start --workers 1",
        training,
        "%rtnb resume 19",
        "%rtrain start",
        "%rtnb stop",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    try:
        client.execute()
    except CellExecutionError as exc:
        pytest.fail(f"the README's cell at one rank failed\n{str(exc)[-3000:]}", pytrace=False)
    shown = " ".join(
        o.get("text") or o.get("data", {}).get("text/plain", "") for o in nb.cells[3].outputs
    )
    assert re.search(r"\b20\b", shown), f"resume 19 goes on at step 20, got {shown!r}"
