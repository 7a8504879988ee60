"""The kernel's side of the notebook's folder on a group's ranks.

At the group's start each rank says which of the kernel's code folders (the working
directory, local packages imported from outside site-packages) it cannot see on its
own disk; those get a private copy (:mod:`rtnb.core._folder` says what is left out).
Before each cell the kernel stats the folders again and puts what changed since
each target rank's copy into the cell's request, so the cell runs on the files the
notebook has now: no extra round trip, nothing sent when nothing changed. On a
local Ray, or a shared file system, nothing is copied; the ranks reload modules
whose files changed either way (``worker/_folder.py``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rtnb.core._folder import (
    FOLDER_ROOT,
    MAX_ENTRIES,
    OWN_PACKAGES,
    PACKAGES_ROOT,
    FileStat,
    FolderChanges,
    FolderRoot,
    FolderWalk,
    apply_cap,
    digest,
    installation_dirs,
    walk_root,
)
from rtnb.core._messages import CellRequest

__all__ = ["FolderSync", "kernel_roots"]


def kernel_roots(cwd: str | None = None) -> list[FolderRoot]:
    """The folders the kernel's code comes from: its working directory, then each
    top-level package or module it imported from outside the Python installation
    (an editable install, a folder put on ``sys.path``)."""
    cwd = os.path.realpath(cwd or os.getcwd())
    roots = [FolderRoot.of(FOLDER_ROOT, cwd)]
    installed = installation_dirs() + _own_dirs()
    seen: set[str] = set()
    for name, module in list(sys.modules.items()):
        if "." in name or name in OWN_PACKAGES or name == "__main__":
            continue
        path = _module_root(module)
        if path is None or path in seen:
            continue
        if path == cwd or path.startswith(cwd + os.sep) or path.startswith(installed):
            continue
        if not _importable_by_name(name, path):
            continue  # loaded from a file by path (torch.compile's generated code, ...)
        seen.add(path)
        key = f"{PACKAGES_ROOT}/{os.path.basename(path)}"
        roots.append(FolderRoot.of(key, path))
    return roots


def _module_root(module: Any) -> str | None:
    filename = getattr(module, "__file__", None)
    if not isinstance(filename, str) or not filename.endswith(".py"):
        return None  # built in, a namespace package, a C extension
    return _module_root_of_file(filename)


def _importable_by_name(name: str, path: str) -> bool:
    """Whether ``import NAME`` finds this file (a folder on ``sys.path``, an editable
    install's finder): only such code can be imported on a rank from its copy."""
    parents = {os.path.realpath(p) for p in sys.path if p}
    if os.path.dirname(path) in parents:
        return True
    # Ask the finders themselves (importlib.util.find_spec answers from sys.modules).
    for finder in sys.meta_path:
        try:
            spec = finder.find_spec(name, None)
        except Exception:  # noqa: BLE001 - a third-party finder may raise anything
            continue
        origin = getattr(spec, "origin", None)
        if isinstance(origin, str):
            return _module_root_of_file(origin) == path
    return False


def _module_root_of_file(filename: str) -> str:
    path = os.path.realpath(filename)
    return os.path.dirname(path) if os.path.basename(path) == "__init__.py" else path


def _own_dirs() -> tuple[str, ...]:
    # rtnb's own trees (what it vendors under them included) are on every node.
    dirs = []
    for name in OWN_PACKAGES:
        root = _module_root(sys.modules.get(name))
        if root is not None:
            dirs.append(os.path.join(root, ""))
    return tuple(dirs)


class FolderSync:
    """What each rank that copies the folders has, and what to send it next."""

    def __init__(
        self,
        roots: list[FolderRoot],
        shipping: dict[int, tuple[str, ...]],
        excludes: tuple[str, ...],
        includes: tuple[str, ...],
    ) -> None:
        self.roots = [r for r in roots if any(r.key in keys for keys in shipping.values())]
        self.shipping = shipping
        self._excludes, self._includes = excludes, includes
        self._stats: dict[str, FileStat] = {}
        self._digests: dict[str, str] = {}
        self._held: dict[int, dict[str, str]] = {rank: {} for rank in shipping}
        self.last_walk = FolderWalk()

    @classmethod
    def open(
        cls,
        mode: str,
        excludes: tuple[str, ...],
        includes: tuple[str, ...],
        ask: Callable[[list[FolderRoot], bool], list[tuple[str, ...]]],
        send: Callable[[dict[int, FolderChanges]], None],
    ) -> FolderSync | None:
        """Ask each rank which roots it needs copied (``ask``: one answer per rank),
        and ``send`` those ranks the whole of them. None when no rank needs a copy."""
        if mode == "off":
            return None
        roots = kernel_roots()
        needs = ask(roots, mode == "ship")
        shipping = {rank: keys for rank, keys in enumerate(needs) if keys}
        if not shipping:
            return None
        sync = cls(roots, shipping, excludes, includes)
        changes = sync.changes_for(list(shipping))
        send(changes)
        return sync

    @property
    def notes(self) -> list[str]:
        return self.last_walk.notes()

    def shipped_summary(self) -> str:
        files = self.last_walk.files
        size = sum(s.size for s in files.values())
        ranks = ", ".join(str(r) for r in sorted(self.shipping))
        return (
            f"copied {len(files)} files ({size / 1024:.0f} KiB) of the notebook's folder"
            + (" and local packages" if len(self.roots) > 1 else "")
            + f" to rank{'s' if len(self.shipping) > 1 else ''} {ranks}, whose node cannot "
            "see it; edits reach them before each cell"
        )

    def stamp(self, request: CellRequest, ranks: Sequence[int]) -> CellRequest:
        """``request`` with what the target ranks' copies lack (unchanged when nothing).
        One request goes to all of them (the relay), so it carries the union: a rank
        writes only the files whose digest it does not hold."""
        targets = [r for r in ranks if r in self.shipping]
        if not targets:
            return request
        merged = _merge(list(self.changes_for(targets).values()))
        return dataclasses.replace(request, files=merged) if merged else request

    def changes_for(self, ranks: Sequence[int]) -> dict[int, FolderChanges]:
        """Walk the roots and return, per rank, what its copy lacks; counted as held
        from now on (the request that carries it is the rank's next cell)."""
        walk = FolderWalk()
        budget = [MAX_ENTRIES]
        for root in self.roots:
            walk_root(root, walk, self._excludes, self._includes, budget)
        apply_cap(walk)
        self.last_walk = walk
        contents: dict[str, bytes] = {}
        for key, stat in walk.files.items():
            if self._stats.get(key) != stat or key not in self._digests:
                data = _read(walk.paths[key])
                if data is None:
                    continue
                contents[key] = data
                self._digests[key] = digest(data)
            self._stats[key] = stat
        for gone in [k for k in self._stats if k not in walk.files]:
            del self._stats[gone]
            self._digests.pop(gone, None)
        out: dict[int, FolderChanges] = {}
        for rank in ranks:
            held = self._held[rank]
            roots = self.shipping[rank]
            written, digests = {}, {}
            for key, value in self._digests.items():
                if held.get(key) == value or not _under(key, roots):
                    continue
                data = contents.get(key)
                if data is None:
                    data = _read(walk.paths[key])
                    if data is None:
                        continue
                    contents[key] = data
                written[key], digests[key] = data, value
            deleted = tuple(k for k in held if k not in self._digests)
            for key in deleted:
                del held[key]
            held.update(digests)
            out[rank] = FolderChanges(written, deleted, digests)
        return out


def _merge(changes: list[FolderChanges]) -> FolderChanges:
    written: dict[str, bytes] = {}
    digests: dict[str, str] = {}
    deleted: set[str] = set()
    for c in changes:
        written.update(c.written)
        digests.update(c.digests)
        deleted.update(c.deleted)
    return FolderChanges(written, tuple(sorted(deleted)), digests)


def _under(key: str, roots: tuple[str, ...]) -> bool:
    return any(key.startswith(root + "/") or key == root for root in roots)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None  # gone or unreadable since the walk: the next cell's walk says
