"""Keeping import-time work that rtnb never uses out of the processes it starts.

Every Ray process imports ``jsonschema``, which imports ``rfc3987_syntax`` when
it is installed (JupyterLab's dependencies bring it) and builds its IRI grammar
at import: ~2.5 s of CPU per process, in the kernel, in each of an embedded Ray's
agents and workers, and so in every rank. The folder :data:`LAZY_IMPORTS_PATH`
holds a stand-in that imports the real module on first use; rtnb puts it first
on the import path of this process and of an embedded Ray's processes.
``RTNB_EAGER_IMPORTS=1`` turns this off (everything imports as without rtnb).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

__all__ = ["LAZY_IMPORTS_PATH", "defer_unused_imports", "lazy_imports_for_children"]

LAZY_IMPORTS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lazy_imports")
_DEFERRED = ("rfc3987_syntax",)


def _enabled() -> bool:
    return os.environ.get("RTNB_EAGER_IMPORTS", "") in ("", "0")


def defer_unused_imports() -> None:
    """Make this process's later ``import ray`` skip the unused grammar build."""
    if not _enabled() or all(name in sys.modules for name in _DEFERRED):
        return
    sys.path.insert(0, LAZY_IMPORTS_PATH)
    try:
        for name in _DEFERRED:
            with contextlib.suppress(ImportError):
                __import__(name)
    finally:
        sys.path.remove(LAZY_IMPORTS_PATH)


def with_lazy_imports(pythonpath: str | None) -> str:
    """``PYTHONPATH`` with the stand-ins first (the user's entries kept after)."""
    parts = [p for p in (pythonpath or "").split(os.pathsep) if p and p != LAZY_IMPORTS_PATH]
    return os.pathsep.join([LAZY_IMPORTS_PATH, *parts])


@contextlib.contextmanager
def lazy_imports_for_children() -> Iterator[None]:
    """Processes started inside this block (an embedded Ray's raylet, and through
    it every agent and worker) find the stand-ins first."""
    if not _enabled():
        yield
        return
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = with_lazy_imports(before)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before
