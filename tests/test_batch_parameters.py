"""Any notebook runs with parameters: notebooks as nbformat, jupytext and VS Code
write them (no kernelspec, no language) run under `rtnb run` with and without
`-p`, `-f params.yaml` and `-y`, and the ranks see the values the run was given."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

RTNB = [sys.executable, "-m", "rtnb.batch.cli"]

PARAMETERS = "steps = 3\nlr = 0.5\ntag = 'default'"
BODY = [
    "%load_ext rtnb\n%rtnb start --workers 2 --cpus-per-worker 0.5 --name {name}\n"
    "%rtnb push steps lr tag",
    "%%rtrain\nimport rtnb\n(rtnb.get_context().get_world_rank(), steps, lr, tag)",
    "%rtnb stop",
]

JUPYTEXT_SOURCE = """# %% tags=["parameters"]
{parameters}

# %%
{cells[0]}

# %%
{cells[1]}

# %%
{cells[2]}
"""


def _nbformat_notebook(path: Path, name: str) -> None:
    nb = nbformat.v4.new_notebook()  # metadata: {} (no kernelspec, no language_info)
    cell = nbformat.v4.new_code_cell(PARAMETERS)
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [cell] + [nbformat.v4.new_code_cell(c.format(name=name)) for c in BODY]
    nbformat.write(nb, path)


def _jupytext_notebook(path: Path, name: str) -> None:
    jupytext = pytest.importorskip("jupytext")
    text = JUPYTEXT_SOURCE.format(parameters=PARAMETERS, cells=[c.format(name=name) for c in BODY])
    nb = jupytext.reads(text, fmt="py:percent")
    assert "kernelspec" not in nb.metadata
    jupytext.write(nb, path)


def _vscode_notebook(path: Path, name: str) -> None:
    """VS Code's shape before a kernel is picked: language_info without kernelspec."""
    _nbformat_notebook(path, name)
    nb = nbformat.read(path, as_version=4)
    nb.metadata = {
        "language_info": {"name": "python", "file_extension": ".py"},
        "orig_nbformat": 4,
    }
    nbformat.write(nb, path)


WRITERS = {
    "nbformat": _nbformat_notebook,
    "jupytext": _jupytext_notebook,
    "vscode": _vscode_notebook,
}


def _rank_values(output: Path) -> str:
    nb = nbformat.read(output, as_version=4)
    # papermill adds an injected-parameters cell when given parameters.
    cell = next(c for c in nb.cells if c.source.startswith("%%rtrain"))
    return "".join(
        o.get("data", {}).get("text/plain", "") + o.get("text", "") for o in cell.outputs
    )


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_notebook_without_language_runs_with_and_without_parameters(
    ray_cluster, tmp_path, writer
):
    src = tmp_path / f"{writer}.ipynb"
    WRITERS[writer](src, writer)
    assert not nbformat.read(src, as_version=4).metadata.get("kernelspec")

    plain = subprocess.run(
        [*RTNB, "run", str(src), "-o", str(tmp_path / "plain.ipynb")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "[rank 1] (1, 3, 0.5, 'default')" in _rank_values(tmp_path / "plain.ipynb")

    (tmp_path / "params.yaml").write_text("steps: 40\nlr: 0.01\ntag: from-file\n")
    given = subprocess.run(
        [
            *RTNB, "run", str(src), "-o", str(tmp_path / "given.ipynb"),
            "-f", str(tmp_path / "params.yaml"),
            "-y", "lr: 0.02",
            "-p", "tag", "from-p",
        ],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert given.returncode == 0, given.stderr[-3000:]
    # As papermill merges them: the file, then -y, then -p.
    values = _rank_values(tmp_path / "given.ipynb")
    assert "[rank 0] (0, 40, 0.02, 'from-p')" in values, values
    assert "[rank 1] (1, 40, 0.02, 'from-p')" in values, values


def test_bad_parameter_files_get_one_line(tmp_path):
    src = tmp_path / "nb.ipynb"
    _nbformat_notebook(src, "bad")
    cases = {
        "missing": (["-f", str(tmp_path / "nope.yaml")], "nope.yaml"),
        "not a mapping": (["-y", "[1, 2]"], "a mapping of names to values"),
        "bad yaml": (["-y", "a: [1"], "not valid YAML"),
        "secret in a file": (["-y", "api_token: abc"], "looks like a secret"),
        "bad name": (["-y", "1x: 2"], "not a Python identifier"),
    }
    for what, (args, expected) in cases.items():
        proc = subprocess.run(
            [*RTNB, "run", str(src), *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
        assert proc.returncode == 2, (what, proc.stderr)
        assert expected in proc.stderr and proc.stderr.count("\n") == 1, (what, proc.stderr)
        assert "abc" not in proc.stderr
