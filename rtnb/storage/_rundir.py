"""The run directory ``{storage}/{run}/`` on a local path or any pyarrow-supported URI.

Holds ``run.json`` (config, ranks, status) now; metrics and checkpoints go under it.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import time
from typing import Any

from rtnb.core._redact import redact_text, redact_uri
from rtnb.errors import ConfigError, one_line

__all__ = ["BATCH_RUNS_ENV", "RunDirectory"]

# Set by `rtnb run` for its kernel: a file where each started session appends its
# run directory, so the runner can keep the output notebook inside it.
BATCH_RUNS_ENV = "RTNB_BATCH_RUNS_FILE"


class RunDirectory:
    def __init__(self, storage: str, run_name: str) -> None:
        from pyarrow import fs as pafs

        # Query parameters (e.g. s3://b/p?endpoint_override=...&scheme=http) configure
        # the filesystem; the run name goes into the path before them.
        base, _, query = storage.partition("?")
        if "://" not in base:
            # A local path as a user types it, or as rtnb shows one (rtnb_runs/run-...):
            # relative to the kernel's folder, "~" its user's home.
            base = os.path.abspath(os.path.expanduser(base))
        # The real URI (it may carry credentials) stays in memory; ``uri`` is what
        # is shown and stored.
        self._uri = f"{base.rstrip('/')}/{run_name}" + (f"?{query}" if query else "")
        self.uri = redact_uri(self._uri)
        self._made: set[str] = set()  # folders this object already created
        try:
            self.fs, self.path = pafs.FileSystem.from_uri(
                self._uri if "://" in self._uri else f"file://{self._uri}"
            )
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types
            raise ConfigError(
                f"--storage {redact_uri(storage)!r} is not a path or URI rtnb can use: "
                f"{redact_text(one_line(exc))}"
            ) from None

    @property
    def location(self) -> str:
        """The run's URI with the credentials it came with, to reopen it in this
        process; never shown or stored (``uri`` is)."""
        return self._uri

    @property
    def is_local(self) -> bool:
        return type(self.fs).__name__ == "LocalFileSystem"

    def exists(self, name: str) -> bool:
        from pyarrow import fs as pafs

        return self.fs.get_file_info(posixpath.join(self.path, name)).type != pafs.FileType.NotFound

    def ensure_writable(self) -> None:
        """Create the directory and prove it takes a file, before any rank starts."""
        try:
            self.fs.create_dir(self.path, recursive=True)
            probe = posixpath.join(self.path, ".rtnb-write-probe")
            with self.fs.open_output_stream(probe) as out:
                out.write(b"ok")
            self.fs.delete_file(probe)
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(
                f"storage {self.uri!r} is not writable ({redact_text(one_line(exc))}); pass --storage a directory "
                "or bucket you can write to"
            ) from None

    def write_bytes(self, name: str, data: bytes) -> str:
        """Write ``data`` to ``name``, creating its folder; returns the file's URI or path."""
        target = posixpath.join(self.path, name)
        folder = posixpath.dirname(target)
        if folder not in self._made:
            self.fs.create_dir(folder, recursive=True)
            self._made.add(folder)
        self._write_atomically(target, data)
        return self.shown(name)

    def location_of(self, name: str) -> str:
        """The URI or path of ``name`` in this run that reopens it (with the storage's
        query, credentials included): for a user's upload function, never shown."""
        base, _, query = self._uri.partition("?")
        return f"{base}/{name}" + (f"?{query}" if query else "")

    def shown(self, name: str) -> str:
        """The URI or path of ``name`` in this run, as messages show it (masked)."""
        base, _, query = self.uri.partition("?")
        return f"{base}/{name}" + (f"?{query}" if query else "")

    def write_json(self, name: str, payload: dict[str, Any]) -> None:
        self.write_bytes(name, json.dumps(payload, indent=2, default=str).encode())

    def _write_atomically(self, target: str, data: bytes) -> None:
        # Write-then-rename so a reader never sees half a file.
        tmp = f"{target}.tmp-{time.time_ns()}"
        if self.is_local:
            # The journal writes twice per cell: plain file calls cost a fraction
            # of pyarrow's stream and move on a local disk.
            with open(tmp, "wb") as out:
                out.write(data)
            os.replace(tmp, target)
            return
        with self.fs.open_output_stream(tmp) as out:
            out.write(data)
        self.fs.move(tmp, target)

    def remove(self, name: str) -> None:
        """Delete file ``name`` of this run; gone already is fine."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(posixpath.join(self.path, name))

    def read_json(self, name: str) -> dict[str, Any]:
        with self.fs.open_input_stream(posixpath.join(self.path, name)) as src:
            return json.loads(src.read())
