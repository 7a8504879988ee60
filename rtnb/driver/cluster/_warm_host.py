"""The per-user warm Ray: a loopback Ray that outlives one kernel, with rank processes
that have already imported torch, so the next ``%rtnb start`` takes about a second.

Runs as its own process (``python -m rtnb.driver.cluster._warm_host``), started by the first
kernel that wants it (:mod:`rtnb.driver.cluster._warm_client`). That process is the Ray driver of
the warm Ray; Ray's own processes die with it. One :class:`WarmPool` actor keeps
the spare ranks and the leases:

* a kernel attaches with its pid and detaches when its session stops; the pool
  checks four times a second that each attached kernel is still alive (a zombie
  is dead: a killed kernel's parent may reap it only minutes later), and kills
  the ranks a dead kernel had claimed, so their CPUs are free at once;
* with no kernel attached for ``idle_s`` (10 minutes unless ``RTNB_WARM_RAY_IDLE_S``
  says otherwise), the pool says so and this process shuts the Ray down, removes
  its state file and exits. A SIGTERM does the same at once.

Spare ranks hold no CPU in Ray's accounting (``num_cpus=0``): the kernel that
claims them reserves its CPUs with its own placement group, so capacity checks
and "stop frees the CPUs" behave as for cold ranks. Spares are made again after
each claim, importing torch in a thread at the lowest CPU priority, so a
``restart`` or ``scale`` of the same size is warm too and the user's first cell
does not wait for them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["POOL_NAME", "POOL_NAMESPACE", "WarmPool", "kernel_alive", "main"]

POOL_NAME = "rtnb-warm-pool"
POOL_NAMESPACE = "rtnb-warm"
# A claim's size is remembered as the number of spares to keep; more would hold
# memory (a rank with torch imported is ~250 MB) for a size nobody asked for.
MAX_SPARES = 8
# After a claim, the user's first cells come first; spares are made after this.
REFILL_DELAY_S = 3.0
# How often the host notes the processes its Ray started (see _NodeProcesses).
_NOTE_PROCESSES_S = 10.0


# How often the pool looks at the attached kernels: a dead kernel's ranks (busy in
# its last cell, maybe) end within about this much.
WATCH_S = 0.25


def _started(pid: int) -> float | None:
    """When process ``pid`` started (None if it is gone): with the pid, who it is."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def kernel_alive(pid: int, started: float | None) -> bool:
    """Whether the kernel that attached as ``pid`` still runs.

    A killed kernel stays a zombie until its parent (the Jupyter server, nbclient)
    reaps it, which can take minutes; signal 0 still reaches a zombie, so the
    process state is read instead. The start time tells a new process that took
    the pid from the kernel."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and (
            started is None or proc.create_time() == started
        )
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # another user's process: not ours to judge
        return True


class WarmPool:
    """Spare rank actors and the kernels attached to this Ray (a Ray actor)."""

    def __init__(
        self,
        idle_s: float,
        spares: int,
        started: list | tuple = (),
        first_kernel: int | None = None,
    ) -> None:
        """``started``: (actor, warm-up ref) pairs of spares the host began before
        this pool's process was up (see :func:`start_spare`); ``first_kernel``: the
        kernel that launched this Ray, which holds it from the start (it attaches
        only once it has joined, which on a slow machine takes longer than a short
        idle time: the Ray must not end under it meanwhile). Should that kernel die
        first, the watchdog lets its lease go as any other's."""
        self._idle_s = idle_s
        self._target = min(MAX_SPARES, max(0, spares))
        self._lock = threading.Lock()
        # Bumped on every change the state file shows, so the host rewrites it at once
        # (a `rtnb warm stop` right after a kernel's `%rtnb stop` sees it detached).
        self._changed = threading.Condition(self._lock)
        self._version = 0
        self._spares: list[Any] = []
        # ids of the spares whose warm_up has ended (torch imported): a spare taken
        # before that makes its kernel wait for the import.
        self._ready: set[int] = set()
        self._claimed: dict[int, list[Any]] = {}
        self._leases: dict[int, float | None] = {}
        self._detached: dict[int, str] = {}  # a detached group's host pid -> its run
        if first_kernel is not None:
            self._leases[first_kernel] = _started(first_kernel)
        self._idle_since = time.monotonic()
        self._idle_since_wall = time.time()
        self._idle = threading.Event()
        for actor, warmed in started:
            self._spares.append(actor)
            self._note_when_warm(actor, warmed)
        self._refill(delay_s=0.0, background=False)
        threading.Thread(target=self._watch, name="rtnb-warm-watchdog", daemon=True).start()

    # ---- kernels ---------------------------------------------------------------------
    def attach(self, pid: int, detached_run: str | None = None) -> None:
        """A kernel (or a detached group's host, named by its run) uses this Ray."""
        with self._lock:
            self._leases.setdefault(pid, _started(pid))
            if detached_run is not None:
                self._detached[pid] = detached_run
            self._bump()

    def detach(self, pid: int) -> None:
        with self._lock:
            self._leases.pop(pid, None)
            self._detached.pop(pid, None)
            actors = self._claimed.pop(pid, [])
            if not self._leases:
                self._went_idle()
            self._bump()
        self._kill(actors)

    def claim(self, pid: int, count: int) -> list[Any]:
        """``count`` rank actors for the kernel ``pid``: the spares first, new ones for
        the rest (made at once, since that kernel is waiting)."""
        with self._lock:
            self._leases.setdefault(pid, _started(pid))
            taken, self._spares = self._spares[:count], self._spares[count:]
            self._ready.difference_update(id(actor) for actor in taken)
            self._bump()
            self._target = min(MAX_SPARES, max(self._target, count))
        taken += [self._new_rank(background=False) for _ in range(count - len(taken))]
        with self._lock:
            self._claimed.setdefault(pid, []).extend(taken)
            self._bump()
        self._refill(delay_s=REFILL_DELAY_S, background=True)
        return taken

    @staticmethod
    def usage_before_start() -> dict[str, Any]:
        """The usage of a pool whose process is still starting."""
        return {
            "kernels": [],
            "detached": [],
            "spares": 0,
            "spares_ready": 0,
            "claimed": 0,
            "idle_since": round(time.time(), 1),
        }

    def usage(self) -> dict[str, Any]:
        """Who uses this Ray, for the state file (``%rtnb warm``, ``rtnb warm``)."""
        with self._lock:
            return self._usage()

    def next_usage(self, seen_version: int, timeout_s: float) -> tuple[int, dict[str, Any]]:
        """The usage once it differs from ``seen_version``'s (or after ``timeout_s``)."""
        with self._changed:
            self._changed.wait_for(lambda: self._version != seen_version, timeout_s)
            return self._version, self._usage()

    def is_idle(self) -> bool:
        """True once no kernel has been attached for the idle time."""
        return self._idle.is_set()

    def _usage(self) -> dict[str, Any]:
        return {
            "kernels": sorted(pid for pid in self._leases if pid not in self._detached),
            "detached": sorted(self._detached.values()),
            "spares": len(self._spares),
            "spares_ready": sum(1 for actor in self._spares if id(actor) in self._ready),
            "claimed": sum(len(a) for a in self._claimed.values()),
            "idle_since": None if self._leases else round(self._idle_since_wall, 1),
        }

    def _bump(self) -> None:
        self._version += 1
        self._changed.notify_all()

    def _went_idle(self) -> None:
        self._idle_since = time.monotonic()
        self._idle_since_wall = time.time()

    # ---- spares ----------------------------------------------------------------------
    def _new_rank(self, background: bool) -> Any:
        actor, warmed = start_spare(background)
        self._note_when_warm(actor, warmed)
        return actor

    def _note_when_warm(self, actor: Any, warmed: Any) -> None:
        """Count ``actor`` ready once its warm-up (``warmed``) ended."""
        import ray

        def note_when_warm() -> None:
            try:
                ray.get(warmed)
            except Exception:  # noqa: BLE001 - a spare killed while it imported
                return
            with self._lock:
                # Unless a kernel took it meanwhile (its id is then no spare's); a spare
                # warm before the refill listed it counts once it is listed.
                if not any(actor is a for taken in self._claimed.values() for a in taken):
                    self._ready.add(id(actor))
                    self._bump()

        threading.Thread(target=note_when_warm, name="rtnb-warm-ready", daemon=True).start()

    def _refill(self, delay_s: float, background: bool) -> None:
        def refill() -> None:
            if delay_s:
                time.sleep(delay_s)
            while True:
                with self._lock:
                    if len(self._spares) >= self._target:
                        return
                actor = self._new_rank(background)
                with self._lock:
                    self._spares.append(actor)
                    self._bump()

        if delay_s:
            threading.Thread(target=refill, name="rtnb-warm-refill", daemon=True).start()
        else:
            refill()

    # ---- leases ----------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._idle.is_set():
            time.sleep(WATCH_S)
            gone: list[Any] = []
            with self._lock:
                dead = [
                    pid for pid, started in self._leases.items() if not kernel_alive(pid, started)
                ]
                for pid in dead:
                    del self._leases[pid]
                    self._detached.pop(pid, None)
                    gone += self._claimed.pop(pid, [])
                    if not self._leases:
                        self._went_idle()
                    self._bump()
                idle = not self._leases and time.monotonic() - self._idle_since > self._idle_s
                if idle:
                    self._idle.set()
                    self._bump()
            self._kill(gone)

    @staticmethod
    def _kill(actors: list[Any]) -> None:
        import ray

        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass


def start_spare(background: bool) -> tuple[Any, Any]:
    """A spare rank actor, importing torch (at the lowest CPU priority when
    ``background``): the actor and the ref its warm-up ends with."""
    import ray

    from rtnb.worker._actor import ACTOR_CONCURRENCY, RankActor

    actor = (
        ray.remote(RankActor)
        .options(num_cpus=0, max_concurrency=ACTOR_CONCURRENCY, max_restarts=0)
        .remote(None, {})
    )
    return actor, actor.warm_up.remote(background)


# A Unix socket's path holds at most 107 bytes, and Ray puts its sockets at
# TEMP/session_<date>_<time>_<pid>/sockets/plasma_store: this many after TEMP.
_RAY_SOCKET_TAIL = len("/session_2026-11-29_14-10-45_051662_4194304/sockets/plasma_store")
_UNIX_PATH_MAX = 107


def private_ray_dir() -> Path:
    """The warm Ray's temp dir: fresh for each warm Ray (a dead Ray's files in a
    reused one can make a later one wait for it), and apart from /tmp/ray, which is
    the user's Ray's. Under the user's TMPDIR, unless that is too long for Ray's
    socket paths (a job's scratch folder can be): then under /tmp, as Ray does on
    macOS, rather than a start that fails."""
    prefix = f"rtnb-warm-{os.getuid()}-"
    base = tempfile.gettempdir()
    made = len(os.path.join(base, prefix)) + len("12345678")  # mkdtemp's random part
    if made + _RAY_SOCKET_TAIL > _UNIX_PATH_MAX and os.access("/tmp", os.W_OK):
        base = "/tmp"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


class _NodeProcesses:
    """The processes this host's Ray started (its descendants, each with its start
    time, so a reused pid is never taken for one). When the GCS is lost the rest
    of the node would wait out Ray's reconnect time (a minute and more) before it
    ends, and the raylet's agents, handed to init then, have been seen to outlive
    it for hours: the host ends the Ray at once and every process it noted."""

    def __init__(self) -> None:
        self.seen: dict[int, str] = {}
        self._gcs: tuple[int, str] | None = None

    def note(self) -> None:
        stats: dict[int, tuple[str, list[str]]] = {}
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
            stat = _stat(entry.name) if entry.name.isdigit() else None
            if stat is not None:
                stats[int(entry.name)] = stat
                children.setdefault(int(stat[1][1]), []).append(int(entry.name))
        todo = [os.getpid()]
        while todo:
            for pid in children.get(todo.pop(), []):
                todo.append(pid)
                name, fields = stats[pid]
                self.seen.setdefault(pid, fields[19])
                if name == "gcs_server" and self._gcs is None:
                    self._gcs = (pid, fields[19])

    def gcs_lost(self) -> bool:
        """The GCS this host started has ended (a zombie counts: this host reaps it)."""
        if self._gcs is None:
            return False
        stat = _stat(str(self._gcs[0]))
        return stat is None or stat[1][19] != self._gcs[1] or stat[1][0] in "ZX"

    def end_strays(self) -> None:
        for pid, started in self.seen.items():
            stat = _stat(str(pid))
            if stat is not None and stat[1][19] == started and stat[1][0] not in "ZX":
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def _stat(pid: str) -> tuple[str, list[str]] | None:
    """A process's name and ``/proc/<pid>/stat``'s fields after it (state, ppid, …)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()


def _write_state(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rtnb.driver.cluster._warm_host")
    parser.add_argument("--state", required=True, type=Path)
    parser.add_argument("--key", required=True)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--spares", type=int, default=2)
    parser.add_argument("--idle-s", type=float, default=600.0)
    parser.add_argument("--first-kernel", type=int, default=None)
    args = parser.parse_args(argv)

    from rtnb.core._startup import defer_unused_imports

    defer_unused_imports()
    from rtnb.driver.cluster._embedded import start_embedded_ray

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    # Leave the launching kernel's directory: this process outlives it.
    os.chdir(args.state.parent)
    import ray

    private_dir = private_ray_dir()
    ray_processes = _NodeProcesses()
    gcs_lost = False
    start_embedded_ray(ray, num_cpus=args.cpus, namespace=POOL_NAMESPACE, private_dir=private_dir)
    try:
        # The first spares begin with the pool, not once its process is up: their
        # torch import is what the first kernel waits for longest.
        first = [start_spare(background=False) for _ in range(min(MAX_SPARES, args.spares))]
        pool = (
            ray.remote(WarmPool)
            .options(name=POOL_NAME, num_cpus=0, max_concurrency=16)
            .remote(args.idle_s, args.spares, first, args.first_kernel)
        )
        # Written before the pool is up (its name is taken already): the waiting
        # kernel joins this Ray while the pool's process starts, and its first call
        # to the pool waits for it. Its usage follows below.
        state = {
            "key": args.key,
            "pid": os.getpid(),
            "address": ray.get_runtime_context().gcs_address,
            "cpus": args.cpus,
            "started": time.time(),
            "temp_dir": str(private_dir),
            "idle_s": args.idle_s,
            **WarmPool.usage_before_start(),
        }
        _write_state(args.state, state)
        print(f"warm Ray ready for {args.key} (pid {os.getpid()})", flush=True)
        version = -1
        noted_at = 0.0
        while not stop.is_set():
            if time.monotonic() - noted_at > _NOTE_PROCESSES_S:
                ray_processes.note()
                noted_at = time.monotonic()
            if ray_processes.gcs_lost():
                print("the warm Ray's GCS ended: shutting down", flush=True)
                gcs_lost = True
                break
            try:
                version, usage = ray.get(pool.next_usage.remote(version, 1.0), timeout=30)
                if ray.get(pool.is_idle.remote(), timeout=30):
                    print("no kernel attached for the idle time: shutting down", flush=True)
                    break
            except Exception as exc:  # noqa: BLE001 - the pool died: nothing to keep
                print(f"warm pool gone ({exc}): shutting down", flush=True)
                break
            if any(state[name] != value for name, value in usage.items()) and not stop.is_set():
                state.update(usage)
                _write_state(args.state, state)
    finally:
        try:
            current = json.loads(args.state.read_text())
            if current.get("pid") == os.getpid():
                args.state.unlink()
        except (OSError, ValueError):
            pass
        ray_processes.note()
        if gcs_lost:
            ray_processes.end_strays()  # first: a driver's shutdown may wait on the GCS
        ray.shutdown()
        ray_processes.end_strays()
        shutil.rmtree(private_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
