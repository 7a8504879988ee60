"""Validated configuration of a worker group (the options of ``%rtnb start``)."""

from __future__ import annotations

import ipaddress
import os
import re
import time
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

from rtnb.core._redact import redact_uri
from rtnb.errors import ConfigError

__all__ = [
    "SessionConfig",
    "declared_defaults",
    "parse_ranks",
    "parse_workers",
    "STRATEGIES",
    "BACKENDS",
    "FILE_MODES",
]

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
BACKENDS = ("gloo", "nccl")
FILE_MODES = ("auto", "ship", "off")
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HOST_PORT = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")


def _patterns(value: object, option: str) -> tuple[str, ...]:
    """``--excludes 'data/,*.ckpt'`` (or a list) as a tuple of patterns."""
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{option} takes patterns as in .gitignore, e.g. 'data/,*.ckpt'")
    return tuple(v.strip() for v in value if v.strip())


def default_run_name() -> str:
    """A run's name when none is given: ``run-DATE-TIME``."""
    return time.strftime("run-%Y%m%d-%H%M%S")


@dataclass(frozen=True)
class SessionConfig:
    """Options of a worker group; names follow Ray Train's ScalingConfig/RunConfig.

    ``address`` is None for an embedded local Ray (or the cluster that
    ``RAY_ADDRESS`` names), ``"auto"``, ``HOST:PORT`` or ``ray://HOST:PORT``.

    Frozen: a group's size changes only as an argument of the controller's
    transitions (``scale``, a policy's ``Shrink``), which swap in a
    :meth:`resized` copy once the new group runs; nothing holds a config that
    changes under it.
    """

    workers: int = 2
    # Elastic (``--workers MIN-MAX``, Ray Train's ``num_workers=(min, max)``): the
    # group has as many ranks as the cluster places, up to ``workers``, at least this.
    min_workers: int | None = None
    gpu: bool = False
    cpus_per_worker: float = 1.0
    strategy: str = "PACK"
    address: str | None = None
    storage: str | None = None
    name: str | None = None
    backend: str | None = None
    max_failures: int = 0
    keep: int | None = None
    score: str | None = None
    mode: str = "min"
    # Seconds an interrupted cell gets to stop at a report() boundary before rtnb
    # raises inside the ranks, and again before it rebuilds the group.
    tensorboard: bool = False
    # MLflow tracking: None off; "" a store in the run directory; else a tracking URI.
    mlflow: str | None = None
    # Local --storage is refused when ranks span nodes unless it is declared shared.
    allow_local_storage: bool = False
    stop_grace_s: float = 3.0
    # A running cell that reported and printed nothing for this long is shown with
    # every rank's stack (the hang doctor); 0 turns it off.
    hang_after_s: float = 120.0
    # Where an embedded Ray listens: 127.0.0.1 unless asked (--listen HOST), so a
    # laptop on a shared network exposes nothing. Ignored when joining a cluster.
    listen: str | None = None
    connect_timeout_s: float = 15.0
    placement_timeout_s: float = 30.0
    env: dict[str, str] = field(default_factory=dict)
    # The notebook's folder on ranks whose node cannot see it (like a Ray Job's
    # working_dir, kept in step before each cell): "auto" copies it only there, "ship"
    # to every rank, "off" never. Patterns as in .gitignore.
    files: str = "auto"
    excludes: tuple[str, ...] = ()
    includes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._validate()

    def resized(self, workers: int | tuple[int, int]) -> SessionConfig:
        """These options at another size: N ranks, ``(MIN, MAX)`` for an elastic
        group, 0 for local mode (validated)."""
        return replace(self, workers=workers, min_workers=None)

    def _normalize(self, name: str, value: object) -> None:
        # The one write a frozen config makes: its own normal form, while it is built.
        object.__setattr__(self, name, value)

    def _validate(self) -> None:
        if isinstance(self.workers, (tuple, list)):
            high, low = _elastic(self.workers)
            self._normalize("workers", high)
            self._normalize("min_workers", low)
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 0:
            raise ConfigError(
                f"--workers must be a whole number ≥ 1 (or 0: local mode, in this kernel), "
                f"got {self.workers!r}"
            )
        if self.min_workers is not None:
            _elastic((self.min_workers, self.workers))
            if self.min_workers == self.workers:
                self._normalize("min_workers", None)  # N-N is N
        if not self.cpus_per_worker >= 0:
            raise ConfigError(f"--cpus-per-worker must be ≥ 0, got {self.cpus_per_worker!r}")
        self._normalize("strategy", str(self.strategy).upper())
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"--strategy {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if self.backend is None:
            self._normalize("backend", "nccl" if self.gpu else "gloo")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.backend == "nccl" and not self.gpu:
            raise ConfigError("--backend nccl needs GPUs: add --gpu, or use --backend gloo")
        if self.address is not None:
            self._normalize("address", _check_address(self.address))
        if self.name is not None:
            check_name(self.name, "--name")
        if self.listen is not None:
            if self.address is not None:
                raise ConfigError(
                    "--listen sets where an embedded Ray listens; a cluster joined with "
                    "--address listens where it was started"
                )
            try:
                ipaddress.ip_address(self.listen)
            except ValueError:
                raise ConfigError(
                    f"--listen {self.listen!r} is not an IP address of this machine "
                    "(e.g. 127.0.0.1, the default, or 0.0.0.0 to accept other nodes)"
                ) from None
        if self.max_failures < 0:
            raise ConfigError(f"--max-failures must be ≥ 0, got {self.max_failures}")
        if self.keep is not None and self.keep < 1:
            raise ConfigError(f"--keep must be ≥ 1, got {self.keep}")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"--mode must be 'min' or 'max', got {self.mode!r}")
        if not self.stop_grace_s > 0:
            raise ConfigError(f"--stop-grace must be > 0 seconds, got {self.stop_grace_s!r}")
        if not (isinstance(self.hang_after_s, (int, float)) and self.hang_after_s >= 0):
            raise ConfigError(
                f"--hang-after must be ≥ 0 seconds (0: off), got {self.hang_after_s!r}"
            )
        if self.files not in FILE_MODES:
            raise ConfigError(f"--files {self.files!r} is not one of {', '.join(FILE_MODES)}")
        for name in ("excludes", "includes"):
            self._normalize(name, _patterns(getattr(self, name), f"--{name}"))
        if not isinstance(self.env, dict):
            raise ConfigError(
                f"env must be a dict of environment variables for the ranks, got "
                f"{type(self.env).__name__}"
            )
        bad = sorted(
            str(k) for k, v in self.env.items() if not (isinstance(k, str) and isinstance(v, str))
        )
        if bad:
            raise ConfigError(
                f"env values must be strings (names and values): check {', '.join(bad)}"
            )

    @property
    def local(self) -> bool:
        """Local mode (``--workers 0``): one rank in the kernel's own process."""
        return self.workers == 0

    @property
    def world_size(self) -> int:
        """How many ranks the group asks for (local mode's one included; an elastic
        group's most)."""
        return max(1, self.workers)

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None

    @property
    def workers_text(self) -> str:
        """``--workers`` as typed: ``4``, ``2-4`` (elastic) or ``0`` (local mode)."""
        return f"{self.min_workers}-{self.workers}" if self.elastic else str(self.workers)

    @property
    def storage_path(self) -> str:
        """Where run directories go: --storage, else ``$RTNB_STORAGE``, else
        ``./rtnb_runs`` made absolute."""
        if self.storage is None:
            return os.environ.get("RTNB_STORAGE") or str(Path("rtnb_runs").resolve())
        if "://" in self.storage:
            return self.storage
        return str(Path(self.storage).expanduser().resolve())

    def to_dict(self) -> dict:
        """The options as recorded in run.json: no secret in them. Environment
        variables are kept by name only; credentials in URIs are masked."""
        record = asdict(self)
        record["env"] = sorted(self.env)
        record["storage"] = redact_uri(self.storage)
        record["address"] = redact_uri(self.address)
        record["mlflow"] = redact_uri(self.mlflow) if self.mlflow else self.mlflow
        return record


def declared_defaults() -> dict[str, object]:
    """Each option's default as declared, before validation fills in what depends on
    other options: a parser must offer these, not a validated instance's values (whose
    backend is already "gloo", so ``--gpu`` would not get nccl)."""
    return {f.name: f.default for f in fields(SessionConfig) if f.default is not MISSING}


def check_name(name: object, what: str = "run name") -> str:
    """A run name someone typed: it becomes one directory, so nothing in it may
    lead elsewhere (no separators, no '..', no control characters)."""
    if isinstance(name, str) and any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ConfigError(
            f"{what} {name!r} contains a control character: use only letters, digits, "
            "'.', '_' and '-' (it names a directory under the storage path)"
        )
    # fullmatch: a `$` would also accept a name ending in a newline.
    if not isinstance(name, str) or not _RUN_NAME.fullmatch(name) or ".." in name:
        raise ConfigError(
            f"{what} {name!r} must start with a letter or digit and use only letters, "
            "digits, '.', '_' and '-' (no '..'): it names a directory under the storage path"
        )
    return name


def parse_workers(text: str) -> int | tuple[int, int]:
    """``--workers`` as typed: ``N``, or ``(MIN, MAX)`` from ``MIN-MAX``; one line for
    anything else."""
    text = str(text).strip()
    try:
        sizes = [int(part) for part in text.split("-", 1)]
    except ValueError:
        raise ConfigError(
            f"--workers {text!r} is not a number of ranks (4), a range MIN-MAX for an "
            "elastic group (2-4), or 0 (local mode)"
        ) from None
    if len(sizes) == 1:
        return sizes[0]
    high, low = _elastic(sizes)
    return (low, high)


def _elastic(sizes) -> tuple[int, int]:
    """(max, min) of an elastic group's sizes (min, max); one line when they are wrong."""
    try:
        low, high = (int(n) for n in sizes)
    except (TypeError, ValueError):
        raise ConfigError(
            f"--workers {sizes!r}: an elastic group is MIN-MAX, two whole numbers (2-4)"
        ) from None
    if low < 1:
        raise ConfigError(
            f"--workers {low}-{high}: an elastic group has at least 1 rank (local mode is "
            "--workers 0, on its own)"
        )
    if low > high:
        raise ConfigError(
            f"--workers {low}-{high}: MIN is more than MAX; write the smaller first ({high}-{low})"
        )
    return high, low


def _check_address(address: str) -> str:
    address = address.strip()
    if address == "auto":
        return address
    if address.startswith("ray://"):
        rest = address[len("ray://") :]
        if _HOST_PORT.match(rest):
            return address
    elif "://" not in address and _HOST_PORT.match(address):
        return address
    raise ConfigError(
        f"--address {address!r} is not 'auto', HOST:PORT (the GCS port of a `ray start "
        "--head` cluster, usually 6379) or ray://HOST:PORT (Ray Client, usually 10001)"
    )


def parse_ranks(spec: str | None, world_size: int) -> list[int]:
    """Turn ``"0,2"``, ``"1-3"`` or ``"all"`` into a sorted rank list within the group."""
    if spec is None or spec.strip() in ("", "all"):
        return list(range(world_size))
    ranks: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi:
                    raise ValueError
                ranks.update(range(lo, hi + 1))
            else:
                ranks.add(int(part))
        except ValueError:
            raise ConfigError(
                f"--ranks {spec!r} is not a list like 0,1 or a range like 0-3"
            ) from None
    bad = sorted(r for r in ranks if not 0 <= r < world_size)
    if bad:
        raise ConfigError(
            f"--ranks {spec!r} names rank {bad[0]}, but the group has ranks 0-{world_size - 1}"
        )
    return sorted(ranks)
