"""MkDocs hooks: the parts of the manual that are written from the code at build time.

A page holds a marker comment; the build puts the generated text in its place:

- ``<!-- rtnb:magics -->``: every ``%rtnb`` subcommand and ``%%rtrain`` flag, as the
  magics' parsers print them (``rtnb.magics._magics.reference``);
- ``<!-- rtnb:states -->``: the worker group's states and allowed transitions;
- ``<!-- rtnb:state-diagram -->``: the same transitions drawn (an inline SVG, no
  script and nothing fetched);
- ``<!-- rtnb:cli -->``: the ``rtnb`` command line, as ``rtnb COMMAND --help`` prints it;
- ``<!-- rtnb:api -->``: every public name of ``rtnb``, from its docstring (mkdocstrings);
- ``<!-- rtnb:errors -->``: every error rtnb raises on purpose, read from the raise
  sites in ``rtnb/``, ``magics/`` and ``widgets/`` (class, message, where), so a new or
  reworded message is in the troubleshooting page of the same commit.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("rtnb", "magics", "widgets")
# The order the troubleshooting page lists them in: errors.py's tree, then IPython's
# UsageError (a mistake in a magic's line).
ERROR_CLASSES = (
    "ConfigError",
    "ClusterError",
    "SessionError",
    "WaitTimeout",
    "CellError",
    "CellInterrupted",
    "StorageError",
    "WorkerGroupError",
    "CheckpointError",
    "RtnbError",
    "UsageError",
)
BUILT_AT_RUN_TIME = "(composed at run time; see where it is raised)"


@dataclass(frozen=True)
class RaiseSite:
    error: str  # the class raised
    message: str  # the message's template; {name} where a value goes
    where: str  # module:function


def _template(node: ast.expr, assigned: dict[str, ast.expr], depth: int = 0) -> str | None:
    """The text of a message expression: literals as they are, interpolated values as
    ``{expression}``; None when it cannot be read without running the code."""
    if depth > 4:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            else:
                assert isinstance(value, ast.FormattedValue)
                parts.append(_interpolated(value))
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = _template(node.left, assigned, depth + 1)
        right = _template(node.right, assigned, depth + 1)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.Name) and node.id in assigned:
        return _template(assigned[node.id], assigned, depth + 1)
    if isinstance(node, ast.IfExp):
        body = _template(node.body, assigned, depth + 1)
        other = _template(node.orelse, assigned, depth + 1)
        if body is not None and other is not None:
            return f"{body} / {other}"
    if isinstance(node, (ast.Name, ast.Call, ast.Attribute, ast.Subscript)):
        return "{" + readable(node) + "}"
    return None


# Calls that only format a value: the placeholder names the value itself.
_FORMATTING = {"str", "repr", "len", "one_line", "redact_uri", "redact_text", "sorted", "list"}
_AN_ERROR = {"exc", "error", "err", "e"}


def _interpolated(value: ast.FormattedValue) -> str:
    """A message's f-string field as the page shows it: a constant as its text, a
    plural ending as ``(s)``, anything else as a ``{placeholder}`` in words."""
    inner = value.value
    if isinstance(inner, ast.Constant):
        return repr(inner.value) if value.conversion == ord("r") else str(inner.value)
    if (
        isinstance(inner, ast.IfExp)
        and isinstance(inner.body, ast.Constant)
        and isinstance(inner.orelse, ast.Constant)
        and inner.orelse.value == ""
    ):
        return f"({inner.body.value})"
    return "{" + readable(inner) + "}"


def _words(identifier: str) -> str:
    return identifier.strip("_").replace("_", " ").lower()


def readable(node: ast.expr) -> str:
    """What a message's interpolated value is, in words a user reads: ``{the error}``
    for ``one_line(exc)``, ``{run name}`` for ``self._run_name``, ``{type of value}``
    for ``type(value).__name__``, ``{names}`` for ``', '.join(names)``."""
    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        if node.args and (name in _FORMATTING or name in ("join", "map")):
            return readable(node.args[-1])
        if isinstance(func, ast.Attribute) and name in ("get", "lower", "upper", "strip", "shown"):
            return readable(func.value)  # a lookup or a spelling of the same value
        return _words(name)  # what the function gives: cell_name() -> cell name
    if isinstance(node, ast.BinOp):
        return readable(node.left)
    if isinstance(node, ast.IfExp):
        return readable(node.body)
    if isinstance(node, ast.BoolOp):  # `x or 'none'`: the value is x's
        return readable(node.values[0])
    if isinstance(node, ast.Subscript):
        return readable(node.value)
    if isinstance(node, ast.Attribute):
        if node.attr == "__name__" and isinstance(node.value, ast.Call):
            inner = node.value
            if getattr(inner.func, "id", "") == "type" and inner.args:
                return f"type of {readable(inner.args[0])}"
        if isinstance(node.value, ast.Name) and node.value.id in _AN_ERROR:
            return "the error"
        if node.attr == "value":  # an enum's value: the enum names it
            return readable(node.value)
        return _words(node.attr)
    if isinstance(node, ast.Name):
        return "the error" if node.id in _AN_ERROR else _words(node.id)
    return ast.unparse(node)


def raise_sites() -> list[RaiseSite]:
    """Every ``raise SomeError(message)`` of rtnb's own errors (and UsageError) in the
    package, one per distinct (class, message)."""
    found: dict[tuple[str, str], RaiseSite] = {}
    for package in SOURCES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            module = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
            for function in ast.walk(tree):
                if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                assigned = {
                    target.id: node.value
                    for node in ast.walk(function)
                    if isinstance(node, ast.Assign)
                    for target in node.targets
                    if isinstance(target, ast.Name)
                }
                for node in ast.walk(function):
                    site = _site(node, assigned, f"{module}:{function.name}")
                    if site is not None:
                        found.setdefault((site.error, site.message), site)
    order = {name: i for i, name in enumerate(ERROR_CLASSES)}
    return sorted(found.values(), key=lambda s: (order[s.error], s.where, s.message))


def _site(node: ast.AST, assigned: dict[str, ast.expr], where: str) -> RaiseSite | None:
    if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
        return None
    func = node.exc.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
    if name not in ERROR_CLASSES or not node.exc.args:
        return None
    message = _template(node.exc.args[0], assigned)
    if message == "{str(exc)}":
        return None  # a re-raise of an error listed at its own site (ConfigError -> UsageError)
    if message is None or (
        message.startswith("{") and message.endswith("}") and message.count("{") == 1
    ):
        return RaiseSite(name, BUILT_AT_RUN_TIME, where)
    return RaiseSite(name, " ".join(message.split()), where)


# What the user was doing when a message comes, by the module that raises it (the
# first prefix that matches); the page groups the messages under these.
ACTIVITIES = (
    ("Typing a magic's line", ("magics.",)),
    ("Sweeps", ("rtnb.driver.tuning.",)),
    (
        "Batch runs, Ray Jobs, export and import",
        ("rtnb.batch.", "rtnb.driver.scripts."),
    ),
    (
        "Training that outlives the notebook (detached, attach)",
        ("rtnb.driver.detached.",),
    ),
    ("Ray Data", ("rtnb.driver.ranks._datasets",)),
    (
        "Checkpoints, runs and tracking",
        (
            "rtnb.storage.",
            "rtnb.metrics.",
            "rtnb.driver.cells._commits",
            "rtnb.driver.session._run_access",
            "rtnb.driver.session._runs",
            "rtnb.driver.session._tracking",
            "rtnb.driver.cells._resume",
        ),
    ),
    (
        "Starting a group and reaching Ray",
        (
            "rtnb.core.",
            "rtnb.driver.cluster.",
            "rtnb.driver.ranks._group",
            "rtnb.driver.ranks._local",
            "rtnb.driver.session._session",
        ),
    ),
    ("Running cells (the ranks' API included)", ("rtnb.",)),
    ("Views", ("widgets.",)),
)


def activity_of(where: str) -> str:
    module = where.split(":")[0] + "."
    return next(title for title, prefixes in ACTIVITIES if module.startswith(prefixes))


def error_table() -> str:
    """The troubleshooting page's generated part: what each error class means, then
    every message, grouped by what the user was doing when it comes."""
    import rtnb.errors

    sites = raise_sites()
    out: list[str] = ["| error | what it means |", "| --- | --- |"]
    for error in ERROR_CLASSES:
        if not any(s.error == error for s in sites):
            continue
        doc = (
            getattr(rtnb.errors, error, None).__doc__
            if error != "UsageError"
            else (
                "A mistake in a magic's line (an unknown subcommand or flag, a bad value): "
                "IPython prints it as one line and the cell runs nothing."
            )
        )
        summary = " ".join((doc or "").strip().split("\n\n")[0].split())
        out.append(f"| `{error}` | {_markdown_cell(summary)} |")
    out.append("")
    for title, _prefixes in ACTIVITIES:
        rows = [s for s in sites if activity_of(s.where) == title]
        if not rows:
            continue
        out += [f"### {title}", "", f"| message ({len(rows)}) | error |", "| --- | --- |"]
        for row in rows:
            out.append(f"| {_markdown_cell(row.message)} | `{row.error}` |")
        out.append("")
    return "\n".join(out)


def _markdown_cell(message: str) -> str:
    """A message as a table cell: its `code` spans kept, everything else escaped so
    ``{x[:300]}`` or ``*args`` in a message is shown as written."""

    def escaped(text: str) -> str:
        for char in "\\`[]*_<{}":
            text = text.replace(char, "\\" + char)
        return text

    parts = message.split("`")
    if len(parts) % 2 == 0:  # an odd number of backticks: no code spans at all
        return escaped(message).replace("|", "\\|")
    parts[::2] = [escaped(part) for part in parts[::2]]
    return "`".join(parts).replace("|", "\\|")


def _magics_reference() -> str:
    from rtnb.magics._magics import reference

    return reference()


API_SECTIONS = (
    ("In the notebook", lambda module: module.startswith(("rtnb.driver", "rtnb.core"))),
    (
        "Runs, metrics and checkpoints",
        lambda module: module.startswith(("rtnb.storage", "rtnb.metrics")),
    ),
    (
        "Inside a cell (on every rank), named as in ray.train",
        lambda module: module.startswith("rtnb.worker"),
    ),
    ("Errors", lambda module: module == "rtnb.errors"),
)


def api_reference() -> str:
    """Every public name of ``rtnb`` (its lazy export table), rendered by mkdocstrings
    from the docstring where the name is defined: a new export is in the reference
    without anyone writing a line for it."""
    from rtnb import _EXPORTS

    out: list[str] = []
    for title, belongs in API_SECTIONS:
        names = [name for name, module in _EXPORTS.items() if belongs(module)]
        out += [f"## {title}", ""]
        for name in names:
            out += [f"::: rtnb.{name}", ""]
    return "\n".join(out)


def cli_reference() -> str:
    """``rtnb --help`` and each command's ``--help``, from the command line's parser."""
    import argparse

    from rtnb.batch.cli import _parser

    parser = _parser()
    out = ["```text", parser.format_help().rstrip(), "```"]
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in commands.choices.items():
        out += ["", f"### `rtnb {name}`", "", "```text", command.format_help().rstrip(), "```"]
    return "\n".join(out)


def state_table() -> str:
    """The worker group's states and the transitions its state machine allows (the
    table ``StateMachine.to`` checks every change against)."""
    from rtnb.driver.lifecycle._states import _ALLOWED, GroupState

    lines = ["| state | may become |", "| --- | --- |"]
    for state in GroupState:
        targets = ", ".join(f"`{t}`" for t in GroupState if t in _ALLOWED[state])
        lines.append(f"| `{state}` | {targets} |")
    return "\n".join(lines)


# Where each state sits in the drawing (x, y of its box's centre): the ways of a cell
# across the middle, the rebuilds on the right, the end at the bottom.
_STATE_PLACES = {
    "new": (70, 50),
    "starting": (240, 50),
    "ready": (430, 50),
    "resizing": (650, 50),
    "stopped": (70, 200),
    "recovering": (270, 200),
    "running": (430, 200),
    "restarting": (650, 200),
    "failed": (140, 350),
    "stopping": (540, 350),
}
_BOX_W, _BOX_H = 110, 34


def _edge(a: tuple[int, int], b: tuple[int, int]) -> str:
    """A curved arrow from box ``a`` to box ``b``, bent to its left so that the way
    back is a separate curve."""
    (x1, y1), (x2, y2) = a, b
    dx, dy = x2 - x1, y2 - y1
    length = (dx * dx + dy * dy) ** 0.5
    nx, ny = -dy / length, dx / length
    cx, cy = (x1 + x2) / 2 + 22 * nx, (y1 + y2) / 2 + 22 * ny

    def border(x: float, y: float, tx: float, ty: float) -> tuple[float, float]:
        # Where the line from a box's centre towards (tx, ty) leaves the box.
        ux, uy = tx - x, ty - y
        scale = min(
            (_BOX_W / 2 + 4) / abs(ux) if ux else float("inf"),
            (_BOX_H / 2 + 4) / abs(uy) if uy else float("inf"),
        )
        return x + ux * scale, y + uy * scale

    sx, sy = border(x1, y1, cx, cy)
    ex, ey = border(x2, y2, cx, cy)
    return (
        f'<path d="M{sx:.0f},{sy:.0f} Q{cx:.0f},{cy:.0f} {ex:.0f},{ey:.0f}" '
        'fill="none" stroke="currentColor" stroke-opacity="0.55" marker-end="url(#rtnb-arrow)"/>'
    )


def state_diagram() -> str:
    """The controller's states and every transition its table allows, as an inline
    SVG drawn from the same table ``StateMachine.to`` checks (``lifecycle/_states.py``)."""
    from rtnb.driver.lifecycle._states import _ALLOWED, GroupState

    missing = {str(state) for state in GroupState} - set(_STATE_PLACES)
    if missing:
        raise ValueError(f"docs/hooks.py: place the new states {sorted(missing)} in the drawing")
    parts = [
        '<svg class="rtnb-states" viewBox="0 0 720 390" width="720" role="img" '
        'aria-label="The worker group\'s states and transitions" '
        'xmlns="http://www.w3.org/2000/svg" font-family="sans-serif" font-size="13">',
        '<defs><marker id="rtnb-arrow" viewBox="0 0 10 10" refX="9" refY="5" '
        'markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
        '<path d="M0,0 L10,5 L0,10 z" fill="currentColor"/></marker></defs>',
    ]
    for state in GroupState:
        for target in GroupState:
            if target in _ALLOWED[state]:
                parts.append(_edge(_STATE_PLACES[str(state)], _STATE_PLACES[str(target)]))
    for state in GroupState:
        x, y = _STATE_PLACES[str(state)]
        parts.append(
            f'<rect x="{x - _BOX_W // 2}" y="{y - _BOX_H // 2}" width="{_BOX_W}" '
            f'height="{_BOX_H}" rx="8" fill="var(--md-default-bg-color, white)" '
            'stroke="currentColor"/>'
            f'<text x="{x}" y="{y + 4}" text-anchor="middle" fill="currentColor">{state}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


GENERATED = {
    "<!-- rtnb:magics -->": _magics_reference,
    "<!-- rtnb:errors -->": error_table,
    "<!-- rtnb:api -->": api_reference,
    "<!-- rtnb:cli -->": cli_reference,
    "<!-- rtnb:states -->": state_table,
    "<!-- rtnb:state-diagram -->": state_diagram,
}


_SPHINX_ROLE = re.compile(r":(?:class|func|meth|attr|mod|exc|data|obj):(?=<code>)")


def on_page_content(html: str, page, config, files) -> str:  # noqa: ARG001 (MkDocs' signature)
    """The docstrings' Sphinx roles (``:class:`Result```) as plain code, as IPython's
    help shows them, rather than the role's name in front of it."""
    return _SPHINX_ROLE.sub("", html)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (MkDocs' signature)
    for marker, make in GENERATED.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown
