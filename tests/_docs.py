"""The code examples of the manual (docs/*.md) and the README, as notebooks to run.

Each ```python block of a page is one notebook cell, in page order: magics and
cell magics work as in JupyterLab, later blocks use earlier ones' variables. A marker
comment on the line before a fence changes how its block is treated:

- ``<!-- not run: REASON -->``: shown but not run (a GPU, a remote address, a prompt
  to answer); the reason is required, and the test lists them.
- ``<!-- raises: ErrorName -->``: the block must fail with exactly that error (a
  page showing the one line a mistake gets).

Other languages (```bash, ```text, …) are shell commands or output, not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(`{3,})(\S*)\s*$")
MARKER = re.compile(r"^<!--\s*(not run|raises):\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Example:
    page: str  # relative to the repository root
    line: int  # the fence's line, 1-based
    code: str
    not_run: str = ""  # why it is not run ("" : it runs)
    raises: str = ""  # the error it must end with ("" : it must succeed)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def doc_pages() -> list[Path]:
    """The pages whose examples run: every page of the site, and the README."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def examples(path: Path) -> list[Example]:
    lines = path.read_text().splitlines()
    found: list[Example] = []
    page = path.relative_to(ROOT).as_posix()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, language = opening.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), len(lines))
        if language == "python":
            marker = MARKER.match(lines[i - 1].strip()) if i > 0 else None
            kind, value = marker.groups() if marker else ("", "")
            found.append(
                Example(
                    page,
                    i + 1,
                    "\n".join(lines[i + 1 : end]),
                    not_run=value if kind == "not run" else "",
                    raises=value if kind == "raises" else "",
                )
            )
        i = end + 1
    return found


def notebook_of(path: Path):
    """The page's runnable examples as a notebook (None when it has none); a block
    that must raise is tagged so the run goes on past it."""
    import nbformat

    runnable = [e for e in examples(path) if not e.not_run]
    if not runnable:
        return None
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    for example in runnable:
        cell = nbformat.v4.new_code_cell(example.code)
        cell.metadata["rtnb_example"] = {"where": example.where, "raises": example.raises}
        if example.raises:
            cell.metadata["tags"] = ["raises-exception"]
        nb.cells.append(cell)
    return nb
