"""The architecture's import rules (the team's ../shared/DESIGN.md, section 2; docs/architecture.md)."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


# ---- the module graph of the engine (docs/architecture.md, "Who may import whom") ----
#
# Every `import` / `from ... import` anywhere in a module counts (inside functions
# too: a lazy import still runs in that process), except under `if TYPE_CHECKING:`.

ENGINE = REPO / "rtnb"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _engine_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ENGINE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST, type_checking: bool):
    """Import statements at any depth; those under `if TYPE_CHECKING:` only with
    ``type_checking``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test) and not type_checking:
            for other in child.orelse:
                if isinstance(other, (ast.Import, ast.ImportFrom)):
                    yield other
                else:
                    yield from _import_nodes(other, type_checking)
        else:
            yield from _import_nodes(child, type_checking)


def _rtnb_imports(
    name: str, path: Path, modules: dict[str, Path], type_checking: bool = False
) -> set[str]:
    """The rtnb modules ``name`` imports; ``from pkg import sub`` counts as ``pkg.sub``
    when that submodule exists."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), type_checking):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, *([base] if base else [])])
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        found.update(t for t in targets if t == "rtnb" or t.startswith("rtnb."))
    return found


def _import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Who imports whom at run time; with ``type_checking``, also what only type
    checkers import (a cycle hidden there is still a cycle of the design)."""
    modules = _engine_modules()
    return {
        name: _rtnb_imports(name, path, modules, type_checking) for name, path in modules.items()
    }


def _part(module: str) -> str:
    """The engine part a module belongs to: 'core', 'driver', 'errors', ... ('' for
    the public face, rtnb/__init__.py)."""
    return module.split(".")[1] if "." in module else ""


# part -> (the parts it may import, or None for any) and (the parts it must not import)
_RULES: dict[str, tuple[set[str] | None, set[str]]] = {
    "errors": ({"errors"}, set()),  # the leaf everything else builds on
    "core": ({"core", "errors"}, set()),
    "storage": ({"core", "errors", "storage"}, set()),
    "metrics": ({"core", "errors", "metrics"}, set()),
    "worker": (None, {"driver", "batch"}),
    "batch": (None, {"driver", "worker"}),
}


def _violations(part: str) -> list[tuple[str, str]]:
    allowed, forbidden = _RULES[part]
    found = []
    for module, targets in sorted(_import_graph().items()):
        if _part(module) != part:
            continue
        for target in sorted(targets):
            other = _part(target)
            if (allowed is not None and other not in allowed) or other in forbidden:
                found.append((module, target))
    return found


def test_the_import_graph_sees_every_kind_of_import():
    graph = _import_graph()
    assert "rtnb.worker._compat" in graph["rtnb.worker._actor"]  # from pkg import submodule
    assert "rtnb.storage._checkpoint" in graph["rtnb.worker._runtime"]  # inside a function
    typed = _import_graph(type_checking=True)
    assert "rtnb.driver.session._session" not in graph["rtnb"]  # under TYPE_CHECKING ...
    assert "rtnb.driver.session._session" in typed["rtnb"]  # ... which the cycle rule counts
    assert not {t for t in graph["rtnb"] if t.startswith("rtnb.driver")}  # the lazy face


@pytest.mark.parametrize("part", sorted(_RULES))
def test_each_part_imports_only_what_it_may(part):
    bad = _violations(part)
    allowed, forbidden = _RULES[part]
    rule = (
        f"may import only {', '.join(sorted(allowed))}"
        if allowed is not None
        else f"must not import {', '.join(sorted(forbidden))}"
    )
    assert not bad, f"rtnb.{part} {rule}, but:\n" + "\n".join(f"  {m} -> {t}" for m, t in bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle a depth-first search closes, each as a path a -> ... -> a.
    A package's face importing its own submodules is an edge like any other: a
    submodule that imports the face back (``rtnb`` -> ``rtnb.magics`` -> ``from rtnb
    import``) closes a cycle."""
    edges = {
        module: sorted(t for t in targets if t in graph and t != module)
        for module, targets in graph.items()
    }
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in edges[module]:
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    return cycles


def test_cycle_finder_reports_the_path():
    graph = {"rtnb.a": {"rtnb.b"}, "rtnb.b": {"rtnb.c"}, "rtnb.c": {"rtnb.a"}, "rtnb": {"rtnb.a"}}
    assert _cycles(graph) == [["rtnb.a", "rtnb.b", "rtnb.c", "rtnb.a"]]
    # Through a package's face: the root loads a subpackage that imports the root.
    face = {"rtnb": {"rtnb.magics"}, "rtnb.magics": {"rtnb.magics._m"}, "rtnb.magics._m": {"rtnb"}}
    assert _cycles(face) == [["rtnb", "rtnb.magics", "rtnb.magics._m", "rtnb"]]


def test_no_import_cycles_between_engine_modules():
    cycles = _cycles(_import_graph(type_checking=True))
    assert not cycles, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


def _front_modules() -> dict[str, Path]:
    """rtnb.magics.* and rtnb.widgets.* (installed inside the rtnb namespace)."""
    found = {}
    for folder in ("magics", "widgets"):
        for path in sorted((REPO / folder).rglob("*.py")):
            found["rtnb." + _module_name(path)] = path
    return found


def test_no_import_cycles_among_the_engine_the_magics_and_the_widgets():
    """Counting imports inside functions and under TYPE_CHECKING."""
    modules = {**_engine_modules(), **_front_modules()}
    graph = {name: _rtnb_imports(name, path, modules, True) for name, path in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


def test_the_magics_reach_the_engine_only_through_its_public_face():
    """The magics bind to the driver's and storage's faces (``from rtnb.driver import
    Session``), never to a private driver or storage module: what a magic does is a
    public call. (Not the package root: it loads the magics, which would close a
    cycle.)"""
    modules = {**_engine_modules(), **_front_modules()}
    for name, path in _front_modules().items():
        if not name.startswith("rtnb.magics"):
            continue
        private = sorted(
            target
            for target in _rtnb_imports(name, path, modules, True)
            if target.startswith(("rtnb.driver.", "rtnb.storage.")) or target == "rtnb"
        )
        assert not private, f"{name} imports {private}"


@pytest.mark.parametrize("package", ["rtnb", "rtnb.driver", "rtnb.storage"])
def test_each_face_names_what_it_exports_and_loads_it_on_first_use(package):
    face = importlib.import_module(package)
    table = face._EXPORTS if package == "rtnb" else face._FACE
    assert set(face.__all__) >= set(table), set(table) - set(face.__all__)
    for name in table:
        assert getattr(face, name) is getattr(importlib.import_module(table[name]), name)
    with pytest.raises(AttributeError, match=f"module {package!r} has no attribute 'nope'"):
        face.nope  # noqa: B018 - the lookup is the test


def test_a_rank_using_the_public_face_loads_no_driver_or_batch_code():
    probe = (
        "import rtnb, sys; rtnb.report; rtnb.Checkpoint; rtnb.get_context; "
        "print(sorted(m for m in sys.modules if m.startswith(('rtnb.driver','rtnb.batch'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"a rank process loaded {out.stdout.strip()}"


# The modules that hold Ray actors: the worker group (the rank protocol), the warm
# Ray's own pool, and a detached group's host and its followers (which call the host,
# never a rank). Everything else in the driver calls ranks through WorkerGroup.
_ACTOR_HOLDERS = {
    "rtnb/driver/ranks/_group.py",
    "rtnb/driver/cluster/_warm_client.py",
    "rtnb/driver/cluster/_warm_host.py",
    "rtnb/driver/detached/_client.py",
}
# The modules that start Ray tasks of their own, on no rank: a checkpoint's validation,
# and the question of which versions a cluster's nodes run.
_TASK_STARTERS = {"rtnb/driver/tools/_validation.py", "rtnb/driver/cluster/_versions.py"}


def test_only_the_worker_group_modules_call_a_rank():
    callers = []
    for path in sorted((REPO / "rtnb").rglob("*.py")):
        relative = str(path.relative_to(REPO))
        if relative in _ACTOR_HOLDERS | _TASK_STARTERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "remote":
                callers.append(f"{relative}:{node.lineno}")
    assert callers == [], f".remote outside the worker-group modules: {callers}"


# The calls of a cell's rank protocol, and the commands a cell's stops and live
# changes send: only a cell's Execution sequences them (the groups define the calls).
_CELL_PROTOCOL = {"relay", "relay_answers", "poll"}
_CELL_COMMANDS = {"Hold", "Release", "Stop", "StopAt", "Interrupt"}
_PROTOCOL_OWNERS = {
    "rtnb/driver/ranks/_execution.py",
    "rtnb/driver/ranks/_group.py",
    "rtnb/driver/ranks/_local.py",
}


def _protocol_calls(tree: ast.AST) -> list[str]:
    return [
        f"{node.lineno}: {ast.unparse(node.func)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (
            isinstance(node.func, ast.Attribute)
            and node.func.attr in _CELL_PROTOCOL
            and node.args  # a rank's call names its rank (a process's poll() does not)
            and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "self")
            or isinstance(node.func, ast.Name)
            and node.func.id in _CELL_COMMANDS
        )
    ]


def test_only_a_cells_execution_sequences_the_rank_protocol():
    callers = []
    for path in sorted((REPO / "rtnb" / "driver").rglob("*.py")):
        relative = str(path.relative_to(REPO))
        if relative not in _PROTOCOL_OWNERS:
            callers += [f"{relative}:{hit}" for hit in _protocol_calls(ast.parse(path.read_text()))]
    assert callers == [], f"rank protocol calls outside the cell's Execution: {callers}"
    planted = "group.poll(rank)\nproc.poll()\nself.poll(1)\ngroup.command(0, Hold(1))"
    assert [hit.split(": ")[1] for hit in _protocol_calls(ast.parse(planted))] == [
        "group.poll",
        "Hold",
    ]


def _journal_writes(tree: ast.AST) -> list[str]:
    return [
        f"{node.lineno}: {ast.unparse(node.func)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("append", "append_control")
        and "journal" in ast.unparse(node.func.value)
    ]


def test_only_the_controller_and_its_cell_flow_write_the_journal():
    owners = {"rtnb/driver/control/_controller.py", "rtnb/driver/cells/_flow.py"}
    writers = []
    for path in sorted((REPO / "rtnb" / "driver").rglob("*.py")):
        relative = str(path.relative_to(REPO))
        if relative not in owners:
            writers += [f"{relative}:{hit}" for hit in _journal_writes(ast.parse(path.read_text()))]
    assert writers == [], f"journal entries written outside the controller: {writers}"
    planted = (
        "self._journal.append(EntryKind.CHECKPOINT)\nsteps.append(1)\njournal.append_control(1)"
    )
    assert len(_journal_writes(ast.parse(planted))) == 2


def _class_sizes(tree: ast.AST) -> dict[str, int]:
    return {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }


def test_no_driver_class_over_500_lines_and_the_session_and_the_cells_owners_within_300():
    sizes = {}
    for path in sorted((REPO / "rtnb" / "driver").rglob("*.py")):
        for name, size in _class_sizes(ast.parse(path.read_text())).items():
            sizes[f"{path.relative_to(REPO / 'rtnb' / 'driver')}:{name}"] = size
    over = {name: size for name, size in sizes.items() if size > 500}
    assert over == {}, f"driver classes over 500 lines: {over}"
    # What stays in them is their flow; a feature is an observer, a control a command.
    for owner in (
        "session/_session.py:Session",
        "cells/_handle.py:CellHandle",
        "cells/_flow.py:CellFlow",
        "control/_controller.py:Controller",
    ):
        assert sizes[owner] <= 300, (owner, sizes[owner])
    assert len(sizes) > 80, "the rule sees every driver class"
    assert _class_sizes(ast.parse("class A:\n    x = 1\n    y = 2\n")) == {"A": 3}


def _private_reaches(tree: ast.AST) -> list[str]:
    """``other._name`` where ``other`` is neither ``self``/``cls`` nor a module this
    file imported: one object touching another's private attribute."""
    modules = {
        (alias.asname or alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ({"self", "cls"} | modules):
            continue
        found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_driver_object_touches_another_ones_private_attributes():
    offenders = []
    for path in sorted((REPO / "rtnb" / "driver").rglob("*.py")):
        relative = str(path.relative_to(REPO))
        offenders += [f"{relative}:{hit}" for hit in _private_reaches(ast.parse(path.read_text()))]
    assert offenders == [], f"private attributes reached from outside their class: {offenders}"
    planted = "session._lifecycle.group\nhandle._done.wait()\nself._x\nservices._probe()"
    assert len(_private_reaches(ast.parse("from ray import services\n" + planted))) == 2


_LAYOUT_NAMES = ("checkpoints", "metrics", "logs", "journal", "tensorboard", "notebooks")
_LAYOUT_FILES = ("run.json", "_manifest.json", "index.json", "sweep.json", "journal-spool")
_LAYOUT_PREFIXES = tuple(f"{n}/" for n in _LAYOUT_NAMES) + ("rank-", "state-rank", "ahead-")


def _path_literals(tree: ast.AST) -> list[int]:
    """Lines where a run's file is named by a literal: "run.json", a checkpoint's
    manifest or the index, a layout folder as a path argument, or a string/f-string
    part starting with "checkpoints/" etc. or a rank's "rank-" file."""
    found = []
    for node in ast.walk(tree):
        texts: list[str] = []
        if isinstance(node, ast.Call):
            texts = [
                a.value
                for a in node.args
                if isinstance(a, ast.Constant) and isinstance(a.value, str)
            ]
            called = node.func.attr if isinstance(node.func, ast.Attribute) else ""
            called = called or (node.func.id if isinstance(node.func, ast.Name) else "")
            folder_arg = called in ("join", "exists", "shown", "RankAppendLog") and any(
                t in _LAYOUT_NAMES for t in texts
            )
            if folder_arg:
                found.append(node.lineno)
        if isinstance(node, ast.JoinedStr):
            texts = [v.value for v in node.values if isinstance(v, ast.Constant)][:1]
        if any(t in _LAYOUT_FILES or t.startswith(_LAYOUT_PREFIXES) for t in texts):
            found.append(node.lineno)
    return found


def test_every_path_of_a_run_comes_from_the_run_layout():
    offenders = []
    for path in sorted((REPO / "rtnb").rglob("*.py")):
        relative = str(path.relative_to(REPO))
        if relative == "rtnb/storage/_layout.py":
            continue
        offenders += [f"{relative}:{line}" for line in _path_literals(ast.parse(path.read_text()))]
    assert offenders == [], f"run paths spelled outside rtnb/storage/_layout.py: {offenders}"
    # The rule sees what it is for.
    planted = (
        'run_dir.exists("run.json")\nposixpath.join(base, "checkpoints")\nf"checkpoints/{cid}"\n'
        'join(folder, "_manifest.json")\nf"rank-{rank}.log"\nf"state-rank{rank}.pt"\n'
        'name.startswith("ahead-")\nwrite_json("sweep.json", record)'
    )
    assert len(_path_literals(ast.parse(planted))) == 8


def test_one_output_adapter_decides_live_widget_or_lasting_output(monkeypatch):
    """Only NotebookOutput asks whether a live frontend is there; the magics hand it
    both renderings (RTNB_LIVE forces either, as a user can)."""
    from rtnb.widgets import NotebookOutput

    askers = sorted(
        str(path.relative_to(REPO))
        for folder in ("magics", "widgets")
        for path in (REPO / folder).rglob("*.py")
        if "has_live_frontend(" in path.read_text()
    )
    assert askers == ["widgets/_frontend.py", "widgets/_output.py"], askers
    output = NotebookOutput()
    for forced, expected in (("1", "widget"), ("0", "text")):
        monkeypatch.setenv("RTNB_LIVE", forced)
        assert output.show(live=lambda: "widget", lasting=lambda: "text") == expected


# ---- the driver's rooms (docs/architecture.md, "The driver's sub-packages") ---------
#
# Lowest first: a sub-package may import only those before it, and another
# sub-package only through its face (its __init__), never a private module of it.
DRIVER_ROOMS = [
    "cluster",
    "lifecycle",
    "ranks",
    "tools",
    "cells",
    "control",
    "scripts",
    "detached",
    "session",
    "tuning",
]


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["rtnb", "driver"] else None


def _room_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        room = _room(module)
        if room is None or module == f"rtnb.driver.{room}":
            continue
        for target in sorted(targets):
            other = _room(target)
            if other is None or other == room:
                continue
            if DRIVER_ROOMS.index(other) > DRIVER_ROOMS.index(room):
                found.append(f"{module} -> {target} (up: {room} is below {other})")
            elif target != f"rtnb.driver.{other}":
                found.append(f"{module} -> {target} (past the face of {other})")
    return found


def test_the_driver_is_rooms_by_concern_each_importing_only_those_below_through_their_faces():
    rooms = sorted(
        p.name for p in (REPO / "rtnb" / "driver").iterdir() if (p / "__init__.py").is_file()
    )
    assert rooms == sorted(DRIVER_ROOMS), "a room of the driver missing from the rule"
    loose = [p.name for p in (REPO / "rtnb" / "driver").glob("*.py") if p.name != "__init__.py"]
    assert loose == [], "a driver module outside a room"
    for room in DRIVER_ROOMS:
        doc = ast.get_docstring(
            ast.parse((REPO / "rtnb" / "driver" / room / "__init__.py").read_text())
        )
        assert doc and doc.count(". ") == 0, f"rtnb.driver.{room} says in one line what it holds"
    bad = _room_violations(_import_graph(type_checking=True))
    assert not bad, "driver rooms:\n" + "\n".join("  " + line for line in bad)
    planted = {
        "rtnb.driver.ranks._group": {"rtnb.driver.cells._handle", "rtnb.driver.cluster"},
        "rtnb.driver.cells._flow": {"rtnb.driver.ranks._group", "rtnb.driver.cells._handle"},
    }
    assert _room_violations(planted) == [
        "rtnb.driver.cells._flow -> rtnb.driver.ranks._group (past the face of ranks)",
        "rtnb.driver.ranks._group -> rtnb.driver.cells._handle (up: ranks is below cells)",
    ]


def _near_names(stems: list[str]) -> list[tuple[str, str]]:
    """Module names one of which is the other plus a suffix (``_cell``/``_cells``,
    ``_warm``/``_warmhost``): a reader cannot tell them apart."""
    return [(a, b) for a in stems for b in stems if a != b and b.startswith(a)]


def test_no_two_driver_modules_differ_by_a_plural_or_a_suffix():
    stems = sorted(
        {p.stem for p in (REPO / "rtnb" / "driver").rglob("_*.py") if p.name != "__init__.py"}
    )
    assert _near_names(stems) == []
    assert _near_names(["_cell", "_cells", "_warm", "_warmhost", "_flow"]) == [
        ("_cell", "_cells"),
        ("_warm", "_warmhost"),
    ]


def test_every_engine_package_is_in_the_wheel():
    """pyproject lists the packages by name: a new folder left out of that list is
    missing from the wheel a team installs (and only a fresh venv would show it)."""
    import tomllib

    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {
        _module_name(p) for p in ENGINE.rglob("__init__.py") if "_lazy_imports" not in p.parts
    }
    assert folders - listed == set()


_RUNTIME_PARTS = (
    "_runtime.py",
    "_code.py",
    "_reporting.py",
    "_stopping.py",
    "_controls.py",
    "_debug.py",
    "_profile.py",
    "_uploads.py",
)


def test_the_rank_runtime_and_its_parts_touch_no_others_private_fields():
    """RankRuntime's parts (controls and triggers, the debugger, the profiler, the
    uploads) share its condition, never each other's fields or the runtime's."""
    offenders = []
    for name in _RUNTIME_PARTS:
        path = REPO / "rtnb" / "worker" / name
        offenders += [f"{name}:{hit}" for hit in _private_reaches(ast.parse(path.read_text()))]
    assert offenders == []
    sizes = _class_sizes(ast.parse((REPO / "rtnb" / "worker" / "_runtime.py").read_text()))
    assert sizes["RankRuntime"] <= 450, sizes["RankRuntime"]


def test_load_ext_imports_neither_ray_nor_torch_nor_numpy():
    """``%load_ext rtnb`` is on every kernel's way to its first result: what the
    magics import there is paid before a group exists (Ray comes with the start,
    numpy with the first plot, torch only on the ranks)."""
    probe = (
        "import sys, IPython, rtnb, rtnb.magics; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'torch', 'numpy'}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"%load_ext rtnb imported {out.stdout.strip()}"


def _names_defined(tree: ast.AST) -> set[str]:
    """Every attribute assigned (``x.NAME = ...``), module global and function or
    method a module defines."""
    names: set[str] = set()
    for node in ast.walk(tree):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        for target in targets:
            if isinstance(target, ast.Attribute):
                names.add(target.attr)
            elif isinstance(target, ast.Name):
                names.add(target.id)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
    return names


def test_the_c_report_path_sits_beside_the_fields_it_reads_and_reads_only_those():
    """``report()``'s C path reads a rank's reporting fields and its report buffer's
    slots by name: it lives beside the module whose fields they are, and every name
    it interns is one that module (or the buffer's ``__slots__``) defines, so a
    renamed field fails here rather than in a rank's first report."""
    c_file = ENGINE / "worker" / "_fastreport.c"
    assert c_file.exists() and not list(ENGINE.glob("core/*.c")), "the C path sits in worker/"
    reads = set(re.findall(r'INTERN\(\w+, "(\w+)"\)', c_file.read_text()))
    assert {"_stop_requested", "_reports", "_cols"} <= reads, "the reads were found"
    reporting = _names_defined(ast.parse((ENGINE / "worker" / "_reporting.py").read_text()))
    reports = ast.parse((ENGINE / "core" / "_reports.py").read_text())
    slots = {
        element.value
        for node in ast.walk(reports)
        if isinstance(node, ast.ClassDef) and node.name == "ReportColumns"
        for item in node.body
        if isinstance(item, ast.Assign) and getattr(item.targets[0], "id", "") == "__slots__"
        for element in item.value.elts
    }
    assert slots, "ReportColumns declares its slots"
    # ``locked``: the method of the threading.Lock the reporting part holds.
    unknown = reads - reporting - slots - {"locked"}
    assert not unknown, f"the C path reads names its neighbours do not define: {unknown}"


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _control_names() -> set[str]:
    """Each command's name and the runtime calls its ``apply`` makes: the names a
    per-control method on an actor or a group would carry."""
    tree = ast.parse((ENGINE / "worker" / "_commands.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name != "RankCommand":
            names.add(_snake(node.name))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "runtime"
        ):
            names.add(node.func.attr)
    return names


def _methods_naming_a_control(path: Path, classes: set[str], controls: set[str]) -> list[str]:
    return [
        f"{node.name}.{item.name}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name in classes
        for item in node.body
        if isinstance(item, ast.FunctionDef) and item.name in controls
    ]


def test_a_control_is_a_command_that_neither_the_actor_nor_a_group_names(tmp_path):
    """Adding a control is its command in ``worker/_commands.py`` and, when it needs
    one, the runtime part that does it: the actor, the groups and the rank protocol
    carry every control through ``command``, so none of them has a method for one."""
    controls = _control_names()
    assert {"stop", "hold", "release", "stack", "pull", "push", "debug_poll"} <= controls
    assert not controls & {"run", "poll", "relay", "command"}, "the hot paths stay calls"
    named = _methods_naming_a_control(
        ENGINE / "worker" / "_actor.py", {"RankActor"}, controls
    ) + _methods_naming_a_control(
        ENGINE / "driver" / "ranks" / "_group.py", {"RankGroup", "WorkerGroup"}, controls
    )
    named += _methods_naming_a_control(
        ENGINE / "driver" / "ranks" / "_execution.py", {"RankCalls"}, controls
    )
    named += _methods_naming_a_control(
        ENGINE / "driver" / "ranks" / "_local.py", {"LocalGroup"}, controls
    )
    named += _methods_naming_a_control(
        REPO / "tests" / "_threaded_group.py", {"ThreadedGroup"}, controls
    )
    assert named == [], f"per-control methods beside the command channel: {named}"
    planted = tmp_path / "planted.py"
    planted.write_text("class WorkerGroup:\n    def hold(self, rank):\n        pass\n")
    assert _methods_naming_a_control(planted, {"WorkerGroup"}, controls) == ["WorkerGroup.hold"]
