"""A rank's side of the notebook's folder: seen in place or copied, and reloaded.

A rank that sees the kernel's folder on its own disk works in it; one that does not
works in a private copy, which each cell's request brings up to date
(``rtnb-files-PID-*`` in the node's temporary directory: removed when the rank exits,
or by the next rank on that node if it was killed). Either way, before a cell runs,
a module imported from the folder whose file changed since is reloaded as IPython's
``%autoreload`` does it: the classes and functions already made from it take the
new code too.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import shutil
import sys
import tempfile
import types
from typing import Any

from rtnb.core._folder import (
    FOLDER_ROOT,
    OWN_PACKAGES,
    PACKAGES_ROOT,
    FileStat,
    FolderChanges,
    FolderRoot,
    installation_dirs,
)

__all__ = ["RankFolder"]

_PREFIX = "rtnb-files-"


class RankFolder:
    """The code folders of one rank (none until the group opens them)."""

    def __init__(self) -> None:
        self.private: str | None = None
        self.copied: tuple[str, ...] = ()
        self._held: dict[str, str] = {}
        self._watched: tuple[str, ...] = ()
        self._installed: tuple[str, ...] = ()
        # Every module name already looked at, and of those the ones imported from the
        # folders: name -> (its file, the file's stat when last loaded).
        self._seen: set[str] = set()
        self._modules: dict[str, tuple[str, FileStat]] = {}
        self._seen_at: tuple[int, str | None] = (0, None)

    def open(self, roots: list[FolderRoot], copy_all: bool) -> tuple[str, ...]:
        """Work in the kernel's folder where this node sees it, else in a private copy
        (``copy_all``: always). Returns the keys of the roots to be copied here."""
        copied = tuple(r.key for r in roots if copy_all or not r.seen_here())
        places: list[str] = []
        if copied:
            _sweep_orphans()
            self.private = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-")
            atexit.register(shutil.rmtree, self.private, True)
            os.makedirs(os.path.join(self.private, FOLDER_ROOT), exist_ok=True)
            os.makedirs(os.path.join(self.private, PACKAGES_ROOT), exist_ok=True)
        for root in roots:
            if root.key in copied:
                assert self.private is not None
                places.append(os.path.join(self.private, root.key))
            else:
                places.append(root.path)
        folder = places[0]
        with contextlib.suppress(OSError):
            os.chdir(folder)
        entries = [folder]
        if any(r.key.startswith(PACKAGES_ROOT + "/") for r in roots if r.key in copied):
            entries.append(os.path.join(self.private or "", PACKAGES_ROOT))
        for root, place in zip(roots[1:], places[1:]):
            if root.key not in copied:
                entries.append(os.path.dirname(place))
        for entry in reversed(entries):
            if entry in sys.path:
                sys.path.remove(entry)
            sys.path.insert(0, entry)
        self.copied = copied
        self._watched = tuple(p if p.endswith(".py") else os.path.join(p, "") for p in places)
        self._installed = installation_dirs()
        return copied

    def apply(self, changes: FolderChanges | None) -> None:
        """Write what ``changes`` brings that this copy lacks; delete what went."""
        if changes is None or self.private is None:
            return
        for key, data in changes.written.items():
            if not _copied(key, self.copied) or self._held.get(key) == changes.digests.get(key):
                continue
            path = self._path(key)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            temporary = f"{path}.rtnb-tmp"
            with open(temporary, "wb") as f:
                f.write(data)
            os.replace(temporary, path)  # a reader never sees half a file
            self._held[key] = changes.digests.get(key, "")
        for key in changes.deleted:
            if _copied(key, self.copied):
                with contextlib.suppress(OSError):
                    os.remove(self._path(key))
                self._held.pop(key, None)

    def _path(self, key: str) -> str:
        path = os.path.normpath(os.path.join(self.private or "", key))
        if not path.startswith(os.path.join(self.private or "", "")):
            raise ValueError(f"a file key outside the rank's copy: {key!r}")
        return path

    def before_cell(self, changes: FolderChanges | None) -> list[str]:
        """Bring the copy up to date and reload what changed: a line to show the user
        (empty when nothing was reloaded)."""
        self.apply(changes)
        reloaded, failed = self.reload_stale()
        lines = []
        if reloaded:
            lines.append(f"rtnb: reloaded {', '.join(reloaded)} (changed since imported)")
        for name, error in failed:
            lines.append(
                f"rtnb: {name} changed but did not reload ({error}); the cell runs with the old one"
            )
        return lines

    def after_cell(self) -> None:
        """Note the files of the modules a cell imported as they are now, so an edit
        made before the next cell is seen as one."""
        if self._watched:
            self._note_new_modules()

    def _note_new_modules(self) -> None:
        # Twice a cell on every rank, against thousands of modules (torch, Ray): a cell
        # that imported nothing leaves sys.modules' size and its newest entry as they
        # were (imports append), so it costs a comparison.
        now = _modules_mark()
        if now == self._seen_at:
            return
        for name, module in list(sys.modules.items()):
            if name not in self._seen:
                self._seen.add(name)
                known = self._classify(module)
                if known is not None:
                    self._modules[name] = known
        self._seen_at = now

    def reload_stale(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Reload the modules imported from the folders whose file changed since they
        were loaded (in the order they were first imported): the names reloaded, and
        (name, error) of those whose new code failed (kept as they were, as
        ``%autoreload`` keeps them; tried again after the next edit)."""
        if not self._watched:
            return [], []
        self._note_new_modules()
        stale = []
        for name, known in list(self._modules.items()):
            module = sys.modules.get(name)
            if module is None:
                continue
            filename, loaded = known
            now = _stat(filename)
            if now is not None and now != loaded:
                stale.append((name, module, filename, now))
        reloaded, failed = [], []
        for name, module, filename, now in stale:
            self._modules[name] = (filename, now)
            try:
                _reload_in_place(module)
            except Exception as exc:  # noqa: BLE001 - the user's edit may raise anything
                failed.append((name, f"{type(exc).__name__}: {exc}"))
            else:
                reloaded.append(name)
        return reloaded, failed

    def _classify(self, module: Any) -> tuple[str, FileStat] | None:
        filename = getattr(module, "__file__", None)
        if not isinstance(filename, str) or not filename.endswith(".py"):
            return None
        if getattr(module, "__name__", "").partition(".")[0] in OWN_PACKAGES:
            return None  # rtnb itself, run from a clone the notebook sits in
        filename = os.path.realpath(filename)
        if not filename.startswith(self._watched) or filename.startswith(self._installed):
            return None
        stat = _stat(filename)
        return (filename, stat) if stat is not None else None


def _modules_mark() -> tuple[int, str | None]:
    return len(sys.modules), next(reversed(sys.modules), None)


def _reload_in_place(module: Any) -> None:
    """``importlib.reload``, then the functions and classes the old module made take
    the new code (the objects built from them, a model made before the edit, run
    it), as ``%autoreload`` does; a reload that raises leaves the module as it was."""
    old = dict(module.__dict__)
    try:
        importlib.reload(module)
    except BaseException:
        module.__dict__.clear()
        module.__dict__.update(old)
        raise
    for name, was in old.items():
        now = module.__dict__.get(name)
        if now is None or now is was or getattr(was, "__module__", None) != module.__name__:
            continue
        if isinstance(was, type) and isinstance(now, type):
            _update_class(was, now)
            module.__dict__[name] = was  # isinstance() of older objects stays true
        elif isinstance(was, types.FunctionType) and isinstance(now, types.FunctionType):
            _update_function(was, now)


def _update_function(was: types.FunctionType, now: types.FunctionType) -> None:
    for attr in ("__code__", "__defaults__", "__kwdefaults__", "__doc__", "__annotations__"):
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            setattr(was, attr, getattr(now, attr))
    # (a closure's cells cannot be swapped: such a function keeps its old code)


def _update_class(was: type, now: type) -> None:
    for attr in list(was.__dict__):
        if attr not in now.__dict__ and attr not in ("__dict__", "__weakref__"):
            with contextlib.suppress(AttributeError, TypeError):
                delattr(was, attr)
    for attr, value in now.__dict__.items():
        if attr in ("__dict__", "__weakref__", "__module__", "__qualname__"):
            continue
        old_value = was.__dict__.get(attr)
        if isinstance(old_value, types.FunctionType) and isinstance(value, types.FunctionType):
            _update_function(old_value, value)
            continue
        with contextlib.suppress(AttributeError, TypeError):
            setattr(was, attr, value)


def _sweep_orphans() -> None:
    """Remove the copies of ranks that were killed (no exit handler ran): the pid in a
    copy's name is no longer a process."""
    import psutil  # (Ray's own dependency)

    top = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for entry in os.scandir(top):
            pid = entry.name[len(_PREFIX) :].partition("-")[0]
            if entry.name.startswith(_PREFIX) and pid.isdigit() and not psutil.pid_exists(int(pid)):
                shutil.rmtree(entry.path, ignore_errors=True)


def _copied(key: str, roots: tuple[str, ...]) -> bool:
    return any(key == root or key.startswith(root + "/") for root in roots)


def _stat(path: str) -> FileStat | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return FileStat(st.st_size, st.st_mtime_ns)
