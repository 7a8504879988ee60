"""Checkpoints: a directory of files, saved by ranks, committed by the driver.

A rank's ``report(metrics, checkpoint=...)`` copies its files into
``{run}/checkpoints/<id>/`` (every rank writes its own files in parallel, nothing is
gathered) and tells the driver their sizes and XXH3-128 hashes. The driver commits
the checkpoint once every rank of the cell has reported that step, by writing
``_manifest.json`` *last*. Only directories with a manifest are listed or loaded;
files are verified against it before use.

XXH3-128 rather than SHA-256: the manifest guards against torn, truncated and
corrupted files, as the CRC32C of GCS and HDFS do; a cryptographic hash would add
nothing (whoever can rewrite a shard can rewrite the manifest) but costs 7x the CPU
(1.1 vs 7.7 GB/s per core here), and every rank hashes its shard on the core it
trains on. Manifests written with ``sha256`` still verify.

Verification re-hashes a file unless it is provably the file that was hashed at
commit: on a local disk the manifest also records each file's inode stamp (device,
inode, size, mtime and ctime in ns, which every write changes and no user call can
set back), as git's index and rsync's quick check do. Re-hashing 1 GB costs
about a second on a core, more than ``torch.load`` itself, so loading a checkpoint
saved on this disk costs no more than loading the file; ``verify(full=True)``
re-hashes every byte regardless (e.g. to look for disk corruption). ``Checkpoint`` mirrors
``ray.train.Checkpoint`` (``from_directory``, ``to_directory``, ``as_directory``,
``path``, ``filesystem``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import xxhash

from rtnb.core._context import current_rank
from rtnb.errors import CheckpointError
from rtnb.storage._layout import MANIFEST, state_file, state_file_rank

__all__ = ["MANIFEST", "Checkpoint", "describe_in_place", "snapshot", "upload_directory"]

_CHUNK = 4 * 1024 * 1024


def _filesystem_for(path: str):
    from pyarrow import fs as pafs

    if "://" in path:
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), os.path.abspath(path)


class Checkpoint:
    """A checkpoint directory on a local path or in storage (as ``ray.train.Checkpoint``).

    ``manifest`` is set for checkpoints rtnb committed; their files are checked
    against it before they are handed out.
    """

    def __init__(self, path: str, filesystem=None, manifest: dict | None = None) -> None:
        if filesystem is None:
            filesystem, path = _filesystem_for(path)
        self.path = path
        self.filesystem = filesystem
        self.manifest = manifest
        self._temporary = False
        # What from_state hashed while it wrote (file -> (digest, size)): the upload
        # links those files into the run and reads none of them again.
        self._written: dict[str, tuple[str, int]] = {}
        # (step, line) the ranks' step count moves to when a cell's
        # get_checkpoint() hands this checkpoint out; set by the driver.
        self.resume: tuple[int, int] | None = None

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> Checkpoint:
        path = os.fspath(path)
        if "://" not in path and not os.path.isdir(path):
            raise CheckpointError(f"Checkpoint.from_directory: {path!r} is not a directory")
        return cls(path)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Checkpoint:
        """A checkpoint of ``state`` (e.g. ``{"model": m.state_dict(), "optimizer": ...,
        "step": s}``) saved with ``torch.save`` as ``state-rank<R>.pt``, so every rank
        can save its own shard into the same checkpoint; load with :meth:`load_state`."""
        import torch

        folder = tempfile.mkdtemp(prefix="rtnb-ckpt-")
        name = state_file(current_rank())
        with open(os.path.join(folder, name), "wb") as file:
            writer = _HashingWriter(file)
            torch.save(state, writer)
        checkpoint = cls(folder)
        checkpoint._temporary = True  # removed once reported (the upload keeps the data)
        checkpoint._written[name] = writer.digest()
        return checkpoint

    def discard(self) -> None:
        """Remove the temp folder of a ``from_state`` checkpoint that is not kept."""
        if self._temporary:
            shutil.rmtree(self.path, ignore_errors=True)

    @property
    def id(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))

    @property
    def is_local(self) -> bool:
        return type(self.filesystem).__name__ == "LocalFileSystem"

    def _files(self) -> list[str]:
        from pyarrow import fs as pafs

        infos = self.filesystem.get_file_info(pafs.FileSelector(self.path, recursive=True))
        return sorted(
            posixpath.relpath(i.path, self.path) for i in infos if i.type == pafs.FileType.File
        )

    def verify(self, full: bool = False) -> None:
        """Raise CheckpointError unless every file in the manifest is there, intact.

        ``full=True`` re-hashes every file even when its inode stamp shows it is
        unchanged since commit."""
        if self.manifest is None:
            raise CheckpointError(
                f"{self.path!r} has no rtnb manifest, so its completeness and integrity cannot "
                "be checked; pass trusted=True to load it anyway"
            )
        for entry in self.manifest["files"]:
            path = self._path_of(entry)
            if not full and self.is_local and _unchanged_since_commit(path, entry):
                continue
            problem = _hash_problem(self.filesystem, path, entry)
            if problem:
                raise CheckpointError(f"checkpoint {self.id}: {problem}")

    def to_directory(self, path: str | None = None, trusted: bool = False) -> str:
        """Copy the files to local ``path`` (a new temp dir by default) and return it."""
        if not trusted:
            self.verify()
        target = path or tempfile.mkdtemp(prefix="rtnb-ckpt-")
        os.makedirs(target, exist_ok=True)
        if self._placed_elsewhere:
            sources = [(e["path"], self._path_of(e)) for e in self.manifest["files"]]
        else:
            sources = [(rel, posixpath.join(self.path, rel)) for rel in self._files()]
        for rel, source in sources:
            if rel == MANIFEST:
                continue
            dest = os.path.join(target, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with self.filesystem.open_input_stream(source) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, _CHUNK)
        return target

    def _path_of(self, entry: dict) -> str:
        """Where a manifest entry's file is: in this folder, or in the folder of the
        run's storage where it was committed in place (``at``: NO_UPLOAD, or where a
        checkpoint_upload_fn put it)."""
        return posixpath.join(entry.get("at") or self.path, entry["path"])

    @property
    def _placed_elsewhere(self) -> bool:
        return bool(self.manifest) and any("at" in e for e in self.manifest.get("files", ()))

    @contextlib.contextmanager
    def as_directory(self, trusted: bool = False) -> Iterator[str]:
        """A local directory with the files: the checkpoint itself when local."""
        if not trusted:
            self.verify()
        if self.is_local and not self._placed_elsewhere:
            yield self.path
            return
        folder = self.to_directory(trusted=True)
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def load_state(
        self,
        weights_only: bool = True,
        trusted: bool = False,
        map_location: Any = None,
        full_verify: bool = False,
    ) -> Any:
        """``torch.load`` of the state saved by :meth:`from_state`; ``weights_only`` by
        default, so a planted pickle payload is refused, not executed. The shard is
        checked against the manifest (see :meth:`verify`; ``full_verify=True``
        re-hashes it even when its inode stamp is unchanged)."""
        import torch

        if not trusted and self.manifest is None:
            self.verify()  # raises: no manifest
        with self.as_directory(trusted=True) as folder:
            shards = sorted(f for f in os.listdir(folder) if state_file_rank(f) is not None)
            if not shards:
                raise CheckpointError(
                    f"checkpoint {self.id} has no state saved with Checkpoint.from_state: "
                    "read its files with `with ckpt.as_directory(trusted=True) as folder:` "
                    "and your own torch.load"
                )
            # Each rank reads its own shard; when only some ranks saved (often rank 0
            # alone), the others read the lowest rank's.
            mine = state_file(current_rank())
            chosen = mine if mine in shards else min(shards, key=state_file_rank)
            path = os.path.join(folder, chosen)
            check = None if trusted else self._start_check(chosen, path, full_verify)
            try:
                state = torch.load(path, weights_only=weights_only, map_location=map_location)
            except Exception as exc:  # noqa: BLE001 - torch's unpickler errors
                # A damaged file usually breaks torch.load first: report the integrity
                # failure, which is the real cause, rather than the unpickler's error.
                if check is not None:
                    check.join()
                    if check.problem:
                        raise CheckpointError(f"checkpoint {self.id}: {check.problem}") from None
                if weights_only and "weights_only" in str(exc):
                    raise CheckpointError(
                        f"checkpoint {self.id}: {chosen} holds objects that are not plain "
                        "tensors/containers and was not loaded (weights_only=True). Load with "
                        "weights_only=False only if you trust where it came from"
                    ) from None
                raise
            if check is not None:
                check.join()
                if check.problem:
                    raise CheckpointError(f"checkpoint {self.id}: {check.problem}")
            return state

    def _start_check(self, rel: str, local_path: str, full: bool) -> _HashCheck | None:
        """Hash the file against the manifest in a thread while torch.load reads it
        (the hash releases the GIL); None when its inode stamp proves it unchanged.
        The state is only returned once the check passed."""
        entry = next((f for f in self.manifest["files"] if f["path"] == rel), None)
        if entry is not None and not full and _unchanged_since_commit(local_path, entry):
            return None
        check = _HashCheck(local_path, entry, rel)
        check.start()
        return check

    def __repr__(self) -> str:
        state = "committed" if self.manifest else "unverified"
        return f"Checkpoint({self.path!r}, {state})"

    def __reduce__(self):
        # pyarrow filesystems pickle with their settings (endpoint, region, ...).
        return (Checkpoint, (self.path, self.filesystem, self.manifest), {"resume": self.resume})

    @property
    def uri(self) -> str:
        if self.is_local:
            return self.path
        scheme = type(self.filesystem).__name__.replace("FileSystem", "").lower()
        return f"{scheme}://{self.path}" if scheme in ("s3", "gcs") else self.path


def _link(src: str, dst: str) -> bool:
    """Hard-link ``src`` as ``dst``, replacing a file there in one step: ranks that
    save the same file name link into one checkpoint folder at once, and removing
    ``dst`` before linking left a moment where another rank found it missing."""
    spare = f"{dst}.rtnb-link-{os.getpid()}-{threading.get_ident()}"
    try:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.link(src, spare)
        os.replace(spare, dst)
    except OSError:  # another device, or links not supported: copy instead
        return False
    finally:
        # A rename onto a link of the same file leaves both names (POSIX).
        with contextlib.suppress(OSError):
            os.remove(spare)
    return True


class _HashCheck(threading.Thread):
    def __init__(self, path: str, entry: dict | None, rel: str) -> None:
        super().__init__(daemon=True)
        self.path, self.entry, self.rel = path, entry, rel
        self.problem = ""

    def run(self) -> None:
        if self.entry is None:
            self.problem = f"{self.rel} is not in its manifest"
            return
        from pyarrow import fs as pafs

        self.problem = _hash_problem(pafs.LocalFileSystem(), self.path, self.entry)


def _hash_problem(filesystem, path: str, entry: dict) -> str:
    """What is wrong with ``path`` against its manifest ``entry``; "" when intact."""
    algorithm = _algorithm_of(entry)
    try:
        digest, size = _hash(filesystem, path, algorithm)
    except FileNotFoundError:
        return f"file {entry['path']!r} is missing"
    except OSError as exc:
        return f"file {entry['path']!r} cannot be read ({exc})"
    if size != entry["size"] or digest != entry[algorithm]:
        return (
            f"file {entry['path']!r} does not match its manifest "
            "(changed or truncated since it was committed)"
        )
    return ""


def _inode_stamp(path: str) -> dict:
    return _stamp_of(os.stat(path))


def _stamp_of(st: os.stat_result) -> dict:
    return {
        "dev": st.st_dev,
        "ino": st.st_ino,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
    }


def _unchanged_since_commit(path: str, entry: dict) -> bool:
    """True when ``path`` is provably the very file hashed at commit: same inode and
    size, and neither mtime nor ctime moved (any write moves ctime, which no call
    can set back). Stamps are only recorded for local storage."""
    stamp = entry.get("stamp")
    if not stamp:
        return False
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_size == entry["size"] and _stamp_of(st) == stamp


def _chunks(stream) -> Iterator[bytes]:
    while chunk := stream.read(_CHUNK):
        yield chunk


HASH = "xxh3_128"
_HASHES = {"xxh3_128": lambda: xxhash.xxh3_128(), "sha256": lambda: hashlib.sha256()}


def _algorithm_of(entry: dict) -> str:
    return next((name for name in _HASHES if name in entry), HASH)


def _hash(filesystem, path: str, algorithm: str = HASH) -> tuple[str, int]:
    with filesystem.open_input_stream(path) as src:
        return _digest(src, algorithm)


def _digest(src, algorithm: str = HASH, copy_to=None) -> tuple[str, int]:
    """Hash ``src`` to its end (writing each chunk to ``copy_to`` too, if given)."""
    digest = _HASHES[algorithm]()
    size = 0
    for chunk in _chunks(src):
        digest.update(chunk)
        size += len(chunk)
        if copy_to is not None:
            copy_to.write(chunk)
    return digest.hexdigest(), size


class _HashingWriter:
    """The file ``torch.save`` writes to, hashing each chunk as it goes by: the
    checkpoint's digest without reading the file back (torch writes a buffer's
    archive front to back, never seeking)."""

    def __init__(self, file) -> None:
        self._file = file
        self._hash = _HASHES[HASH]()
        self._size = 0

    def write(self, chunk) -> int:
        self._hash.update(chunk)
        self._size += memoryview(chunk).nbytes  # bytes or a tensor's buffer alike
        return self._file.write(chunk)

    def flush(self) -> None:
        self._file.flush()

    def digest(self) -> tuple[str, int]:
        return self._hash.hexdigest(), self._size


def snapshot(source: Checkpoint, given_up: bool = False) -> Checkpoint:
    """What an upload beside the loop reads: a user's local folder as it is now, so
    the cell may delete it or save the next checkpoint into it as soon as ``report``
    returns. ``given_up`` (``delete_local_checkpoint_after_upload``, the default with
    ``ASYNC``): the folder is removed once reported, so hard links keep its files
    for rtnb alone (no byte copied, and they may be linked into a run on the same
    disk, as ``from_state``'s are). Otherwise a copy on local disk: ``torch.save`` to
    the same path rewrites the file in place, which a link would see. rtnb's own
    temp files and a folder already in object storage are read where they are."""
    if source._temporary or not source.is_local:
        return source
    folder = tempfile.mkdtemp(prefix="rtnb-ckpt-")
    try:
        for rel in source._files():
            src, dst = os.path.join(source.path, rel), os.path.join(folder, rel)
            if not (given_up and _link(src, dst)):
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copy2(src, dst)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    taken = Checkpoint(folder)
    taken._temporary = True
    return taken


def describe_in_place(source: Checkpoint, run_fs, dest_path: str) -> list[dict]:
    """Manifest entries for files committed where they are (``NO_UPLOAD``, or where a
    ``checkpoint_upload_fn`` put them): hashed where they lie, with ``at`` (their
    folder) unless that is the checkpoint's own. They must be in the run's storage,
    which is what readers open; nothing is copied, and rtnb never deletes them."""
    if type(source.filesystem).__name__ != type(run_fs).__name__:
        raise CheckpointError(
            f"a checkpoint committed where it is must be in the run's storage, and "
            f"{source.uri!r} is not: report it with checkpoint_upload_mode SYNC or ASYNC "
            "to copy it there"
        )
    local = type(run_fs).__name__ == "LocalFileSystem"
    elsewhere = source.path.rstrip("/") != dest_path.rstrip("/")
    entries = []
    for rel in source._files():
        if rel == MANIFEST:
            continue
        full = posixpath.join(source.path, rel)
        digest, size = _hash(source.filesystem, full)
        entry: dict[str, Any] = {"path": rel, "size": size, HASH: digest}
        if elsewhere:
            entry["at"] = source.path
        if local:
            entry["stamp"] = _inode_stamp(full)
        entries.append(entry)
    return entries


def settle_same_names(entries: list[dict], filesystem, folder: str) -> list[dict]:
    """One manifest entry per file of a checkpoint whose ranks saved files of the same
    name into it (Ray Train merges the ranks' folders alike: the last one written is
    the file). Equal contents keep the lowest rank's entry; different ones keep the
    entry of the file that is there (hashed once, only in this case), so the
    checkpoint verifies and loads as the file it holds."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for entry in entries:
        groups.setdefault((entry.get("at") or "", entry["path"]), []).append(entry)
    settled = []
    for (at, rel), same in groups.items():
        if len(same) == 1 or len({(e["size"], e.get(HASH)) for e in same}) == 1:
            settled.append(same[0])
            continue
        try:
            digest, size = _hash(filesystem, posixpath.join(at or folder, rel))
        except OSError:
            settled.extend(same)  # gone already: the checkpoint's verify says so
            continue
        there = [e for e in same if e.get(HASH) == digest and e["size"] == size]
        settled.extend(there[-1:] or same)
    return settled


def upload_directory(source: Checkpoint, dest_fs, dest_path: str) -> list[dict]:
    """Copy ``source``'s files into ``dest_path``, hashing on the way; the file list
    (path, size, hash) for the manifest."""
    try:
        entries = _copy_files(source, dest_fs, dest_path)
    finally:
        # rtnb's own temp copy goes whether the upload worked or not.
        source.discard()
    if type(dest_fs).__name__ == "LocalFileSystem":
        # Stamped last: unlinking the temp copy's second name moved the ctime.
        for entry in entries:
            entry["stamp"] = _inode_stamp(posixpath.join(dest_path, entry["path"]))
    return entries


def _copy_files(source: Checkpoint, dest_fs, dest_path: str) -> list[dict]:
    entries = []
    local_to_local = source.is_local and type(dest_fs).__name__ == "LocalFileSystem"
    for rel in source._files():
        if rel == MANIFEST:
            continue
        # Same disk and a file only rtnb holds (from_state's temp copy): a hard link
        # instead of a second write. A user's own directory is always copied, since
        # rewriting its file in place (torch.save to the same path) would otherwise
        # rewrite the committed checkpoint too.
        if (
            local_to_local
            and source._temporary
            and _link(os.path.join(source.path, rel), os.path.join(dest_path, rel))
        ):
            # The file this rank linked (another rank saving the same name may have
            # replaced the run's link since; its bytes are its own to hash), hashed
            # as from_state wrote it when it was.
            known = source._written.get(rel)
            digest, size = known or _hash(dest_fs, os.path.join(source.path, rel))
            entries.append({"path": rel, "size": size, HASH: digest})
            continue
        target = posixpath.join(dest_path, rel)
        dest_fs.create_dir(posixpath.dirname(target), recursive=True)
        with (
            source.filesystem.open_input_stream(posixpath.join(source.path, rel)) as src,
            dest_fs.open_output_stream(target) as out,
        ):
            digest, size = _digest(src, copy_to=out)
        entries.append({"path": rel, "size": size, HASH: digest})
    return entries
