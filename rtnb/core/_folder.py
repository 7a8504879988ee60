"""The notebook's folder as ranks on other machines get it: what is shipped, and how
a change is found.

Like a Ray Job's ``working_dir``, but kept in step between cells: the kernel walks
its folder (and the local packages it imported from outside site-packages), leaves
out what ``.gitignore``, the default excludes and ``--excludes`` name, files that
may hold secrets unless ``--includes`` names them, files over
:data:`LARGE_FILE_BYTES` and whatever passes :data:`FOLDER_CAP_BYTES`; a rank that
cannot see the folder gets the files into a private directory. Both ends import
this module: the records here are what crosses Ray.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import site
import socket
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_EXCLUDES",
    "FOLDER_CAP_BYTES",
    "FOLDER_ROOT",
    "FileStat",
    "FolderChanges",
    "FolderRoot",
    "FolderWalk",
    "LARGE_FILE_BYTES",
    "MAX_ENTRIES",
    "OWN_PACKAGES",
    "PACKAGES_ROOT",
    "SECRET_PATTERNS",
    "apply_cap",
    "digest",
    "installation_dirs",
    "path_signature",
    "walk_root",
]

# rtnb's own packages: installed on every node (the version check says so), never
# copied, never reloaded.
OWN_PACKAGES = frozenset({"rtnb", "magics", "widgets"})

# Where a root's files go under a rank's private directory (keys are "ROOT/relpath").
FOLDER_ROOT = "folder"
PACKAGES_ROOT = "packages"

# Ray's own working_dir refuses more than 500 MiB; a notebook's code and configs are
# kilobytes, so a folder past this holds data, which belongs in shared storage.
FOLDER_CAP_BYTES = 100 * 2**20
LARGE_FILE_BYTES = 10 * 2**20
# A walk that meets this many entries is in a home directory or a dataset, not a
# project folder: it stops, and says so, rather than stat the disk before each cell.
MAX_ENTRIES = 20_000

# Never worth shipping: tools' caches, environments, version control, rtnb's own runs.
DEFAULT_EXCLUDES = (
    ".git/",
    ".hg/",
    ".svn/",
    "__pycache__/",
    "*.pyc",
    ".ipynb_checkpoints/",
    ".venv/",
    "venv/",
    ".tox/",
    ".nox/",
    "node_modules/",
    ".mypy_cache/",
    ".pytest_cache/",
    ".ruff_cache/",
    "*.egg-info/",
    ".DS_Store",
    "rtnb_runs/",
    "mlruns/",
    "wandb/",
    "lightning_logs/",
)
# Files that may hold credentials: shipped only when --includes names them.
SECRET_PATTERNS = (
    ".env",
    ".env.*",
    "*.env",
    ".envrc",
    "*.pem",
    "*.key",
    "*.p12",
    "*.pfx",
    "*.keystore",
    "*.jks",
    "id_rsa*",
    "id_dsa*",
    "id_ecdsa*",
    "id_ed25519*",
    ".netrc",
    ".pgpass",
    ".pypirc",
    ".npmrc",
    ".git-credentials",
    ".aws/",
    ".ssh/",
    ".gnupg/",
    ".kube/",
    ".docker/",
    "credentials",
    "credentials.json",
    "service-account*.json",
    "client_secret*.json",
    "secret.*",
    "secrets.*",
    "*.secret",
    "secrets/",
)


@dataclass(frozen=True)
class FolderRoot:
    """A folder the kernel reads code from: the notebook's (``key`` FOLDER_ROOT, the
    working directory) or a local package (``PACKAGES_ROOT/NAME``), with what tells
    a rank whether the same folder is on its disk (:meth:`seen_here`)."""

    key: str
    path: str
    host: str
    identity: tuple[int, int]  # (st_dev, st_ino) on the kernel's machine
    signature: str

    @classmethod
    def of(cls, key: str, path: str) -> FolderRoot:
        try:
            st = os.stat(path)
            identity = (st.st_dev, st.st_ino)
        except OSError:
            identity = (-1, -1)
        return cls(key, path, socket.gethostname(), identity, path_signature(path))

    def seen_here(self) -> bool:
        """The kernel's folder is this process's: the same file on the same machine
        (a namespace with another mount there is not), else, on another machine, a
        folder at the same path with the same code in it (a shared file system)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        if socket.gethostname() == self.host:
            return (st.st_dev, st.st_ino) == self.identity
        return bool(self.signature) and path_signature(self.path) == self.signature


@dataclass(frozen=True)
class FileStat:
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class FolderChanges:
    """Files for a rank's private copy: ``written`` maps a key to its bytes,
    ``deleted`` keys go. ``digests`` name each written file's content, so a rank that
    has it already writes nothing (a cell sent to ranks of different ages)."""

    written: dict[str, bytes] = field(default_factory=dict)
    deleted: tuple[str, ...] = ()
    digests: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.written or self.deleted)


@dataclass
class FolderWalk:
    """One walk of the roots: every file shipped, by key, and what was left out."""

    files: dict[str, FileStat] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)  # key -> absolute path
    secrets: list[str] = field(default_factory=list)
    large: list[tuple[str, int]] = field(default_factory=list)
    over_cap: list[str] = field(default_factory=list)
    truncated: bool = False

    def notes(self) -> list[str]:
        """One line per kind of thing left out, naming it and the way to change it."""
        lines = []
        if self.secrets:
            lines.append(
                f"left out {_some(self.secrets)}, which may hold secrets: name them with "
                "--includes to ship them"
            )
        if self.large:
            named = ", ".join(f"{k} ({s / 2**20:.0f} MiB)" for k, s in self.large[:3])
            more = f" and {len(self.large) - 3} more" if len(self.large) > 3 else ""
            lines.append(
                f"left out {named}{more}: over {LARGE_FILE_BYTES // 2**20} MiB; read data "
                "from shared storage (S3, NFS), or name it with --includes"
            )
        if self.over_cap:
            lines.append(
                f"left out {_some(self.over_cap)}: the folder passed "
                f"{FOLDER_CAP_BYTES // 2**20} MiB (code first, then the smallest files); "
                "leave data out with --excludes"
            )
        if self.truncated:
            lines.append(
                f"the folder has over {MAX_ENTRIES} entries: only the first were shipped; "
                "start the notebook in its project folder, or leave some out with --excludes"
            )
        return lines


def _some(keys: list[str]) -> str:
    names = ", ".join(k.split("/", 1)[-1] for k in keys[:3])
    return f"{names} and {len(keys) - 3} more" if len(keys) > 3 else names


def installation_dirs() -> tuple[str, ...]:
    """Where this Python's own and installed packages live (each ending in a
    separator): code there is the environment's, not the notebook's, even inside the
    notebook's folder (a project's own .venv)."""
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    dirs.update(p for p in sysconfig.get_paths().values() if p)
    try:
        dirs.update(site.getsitepackages())
        dirs.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site module
        pass
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs if d)


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def path_signature(path: str) -> str:
    """What a folder's top level (or a file) holds: names and kinds, and the size and
    whole-second time of its Python files, which a running notebook does not rewrite
    (its autosaves and outputs would make two looks at one folder differ)."""
    try:
        if os.path.isfile(path):
            st = os.stat(path)
            return digest(f"{os.path.basename(path)}:{st.st_size}:{int(st.st_mtime)}".encode())
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError:
        return ""
    parts = []
    for entry in entries[:500]:
        try:
            if entry.is_dir(follow_symlinks=False):
                parts.append(f"d:{entry.name}")
            elif entry.name.endswith(".py"):
                st = entry.stat(follow_symlinks=False)
                parts.append(f"f:{entry.name}:{st.st_size}:{int(st.st_mtime)}")
            else:
                parts.append(f"f:{entry.name}")
        except OSError:
            continue
    return digest("\n".join(parts).encode())


class _Patterns:
    """gitignore-style patterns of one folder: ``dir/`` only folders, a leading or inner
    ``/`` anchors to the folder, ``**`` any depth, ``!`` takes a match back."""

    def __init__(self, lines: Iterable[str]) -> None:
        self.rules: list[tuple[re.Pattern[str], bool, bool]] = []
        for raw in lines:
            line = raw.rstrip("\n").rstrip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            line = line[1:] if negate else line
            dir_only = line.endswith("/")
            line = line.strip("/") if dir_only else line
            anchored = "/" in line.lstrip("/") or line.startswith("/")
            line = line.lstrip("/")
            if not line:
                continue
            self.rules.append((_compile(line, anchored), dir_only, negate))

    def matches(self, relpath: str, is_dir: bool) -> bool | None:
        """True ignored, False taken back by a ``!`` rule, None when no rule speaks."""
        verdict = None
        for regex, dir_only, negate in self.rules:
            if dir_only and not is_dir:
                continue
            if regex.match(relpath):
                verdict = not negate
        return verdict


def _compile(pattern: str, anchored: bool) -> re.Pattern[str]:
    parts = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            parts.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            parts.append(".*")
            i += 2
        elif pattern[i] == "*":
            parts.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            parts.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2 :]:
            close = pattern.index("]", i + 2)
            body = pattern[i + 1 : close]
            parts.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = close + 1
        else:
            parts.append(re.escape(pattern[i]))
            i += 1
    # A pattern that names a folder also covers everything in it.
    return re.compile(("" if anchored else "(?:.*/)?") + "".join(parts) + r"(?:/.*)?\Z")


def _load_gitignore(folder: str) -> _Patterns | None:
    try:
        with open(os.path.join(folder, ".gitignore"), encoding="utf-8", errors="replace") as f:
            return _Patterns(f)
    except OSError:
        return None


def walk_root(
    root: FolderRoot,
    walk: FolderWalk,
    excludes: tuple[str, ...],
    includes: tuple[str, ...],
    budget: list[int],
) -> None:
    """Add ``root``'s files to ``walk`` (stat only: no file is read). ``budget`` is the
    entries the walk may still meet, shared by all roots."""
    rules = [_Patterns(DEFAULT_EXCLUDES), _Patterns(excludes)]
    secrets, wanted = _Patterns(SECRET_PATTERNS), _Patterns(includes)
    if os.path.isfile(root.path):
        with contextlib.suppress(OSError):
            _keep(walk, root.key, root.path, os.stat(root.path))
        return
    for rel, path, is_dir, stat in _entries(root.path, rules, budget, walk):
        if is_dir:
            continue
        key = f"{root.key}/{rel}"
        # (as a folder: a named folder names all it holds)
        named = wanted.matches(rel, True)
        if not named and _secret(secrets, rel):
            walk.secrets.append(key)
            continue
        if stat.st_size > LARGE_FILE_BYTES and not named:
            walk.large.append((key, stat.st_size))
            continue
        _keep(walk, key, path, stat)


def _secret(secrets: _Patterns, rel: str) -> bool:
    # A secret folder (.aws/) hides all it holds: test each leading folder too.
    parts = rel.split("/")
    for depth in range(1, len(parts)):
        if secrets.matches("/".join(parts[:depth]), True):
            return True
    return bool(secrets.matches(rel, False))


def _keep(walk: FolderWalk, key: str, path: str, stat: os.stat_result) -> None:
    walk.files[key] = FileStat(stat.st_size, stat.st_mtime_ns)
    walk.paths[key] = path


def _entries(
    top: str, rules: list[_Patterns], budget: list[int], walk: FolderWalk
) -> Iterator[tuple[str, str, bool, os.stat_result]]:
    """(relpath, path, is_dir, stat) under ``top``, pruning ignored folders; each
    folder's .gitignore applies below it."""
    stack: list[tuple[str, str, list[tuple[str, _Patterns]]]] = [(top, "", [])]
    while stack:
        folder, prefix, ignores = stack.pop()
        own = _load_gitignore(folder)
        scoped = ignores + [(prefix, own)] if own is not None else ignores
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            if budget[0] <= 0:
                walk.truncated = True
                return
            budget[0] -= 1
            rel = prefix + entry.name
            try:
                is_dir = entry.is_dir(follow_symlinks=True)
                stat = entry.stat(follow_symlinks=True)
            except OSError:
                continue  # a broken link, a file gone meanwhile
            if _ignored(rel, is_dir, rules, scoped):
                continue
            if is_dir and _environment(entry.path):
                continue  # a virtualenv or conda env, whatever its name: never the project's code
            if is_dir:
                stack.append((entry.path, rel + "/", scoped))
            else:
                yield rel, entry.path, False, stat


def _environment(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, "pyvenv.cfg")) or os.path.isdir(
        os.path.join(folder, "conda-meta")
    )


def _ignored(
    rel: str, is_dir: bool, rules: list[_Patterns], scoped: list[tuple[str, _Patterns]]
) -> bool:
    verdict: bool | None = None
    for patterns in rules:
        said = patterns.matches(rel, is_dir)
        verdict = said if said is not None else verdict
    for prefix, patterns in scoped:
        said = patterns.matches(rel[len(prefix) :], is_dir)
        verdict = said if said is not None else verdict
    return bool(verdict)


def apply_cap(walk: FolderWalk) -> None:
    """Keep code first, then the smallest files, up to :data:`FOLDER_CAP_BYTES`."""
    total = sum(s.size for s in walk.files.values())
    if total <= FOLDER_CAP_BYTES:
        return
    order = sorted(walk.files, key=lambda k: (not k.endswith(".py"), walk.files[k].size, k))
    kept = 0
    for key in order:
        size = walk.files[key].size
        if kept + size <= FOLDER_CAP_BYTES:
            kept += size
            continue
        walk.over_cap.append(key)
        del walk.files[key]
        del walk.paths[key]
