"""The architecture's import rules (DESIGN.md section 2)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_importing_rtnb_loads_no_display_code():
    probe = (
        "import sys, rtnb\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'IPython', 'ipywidgets', 'plotly', 'ipykernel'})\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import rtnb pulled in {out.stdout.strip()}"


def _imports(folder: Path, top_level_only: bool = False) -> dict[str, set[str]]:
    found = {}
    for path in folder.rglob("*.py"):
        names = set()
        tree = ast.parse(path.read_text())
        for node in tree.body if top_level_only else ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        found[str(path.relative_to(REPO))] = names
    return found


def test_engine_widgets_and_magics_import_only_what_they_may():
    for path, names in _imports(REPO / "rtnb").items():
        assert not {n for n in names if n.split(".")[0] in ("IPython", "ipywidgets", "plotly")}, (
            path
        )
    # load_ipython_extension reaches rtnb.magics lazily; nothing may at import time.
    for path, names in _imports(REPO / "rtnb", top_level_only=True).items():
        assert not {n for n in names if n.startswith(("rtnb.widgets", "rtnb.magics"))}, path
    for path, names in _imports(REPO / "widgets").items():
        assert not {n for n in names if n.split(".")[0] == "ray"}, f"{path} calls Ray"
        assert not any(n.startswith("rtnb.magics") for n in names), path
    for path, names in _imports(REPO / "magics").items():
        assert not {n for n in names if n.split(".")[0] == "ray"}, (
            f"{path} should go through rtnb.Session"
        )


def test_magics_and_widgets_are_installed_inside_the_rtnb_namespace():
    import rtnb.magics
    import rtnb.widgets

    assert Path(rtnb.magics.__file__).parent == REPO / "magics"
    assert Path(rtnb.widgets.__file__).parent == REPO / "widgets"
    probe = "import importlib.util as u; print(u.find_spec('magics'), u.find_spec('widgets'))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd="/", check=True
    )
    assert out.stdout.strip() == "None None", "generic top-level packages must not be installed"
