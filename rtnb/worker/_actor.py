"""The Ray actor that hosts one rank: a thin shell around :class:`RankRuntime`.

Ray runs its methods on a small thread pool (``max_concurrency``), so control
calls (poll, stop, pull) are served while the cell thread is busy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from rtnb.core._folder import FolderChanges, FolderRoot
from rtnb.core._messages import CellRequest, CellState, RankPlace, from_wire, to_wire
from rtnb.core._net import local_addresses
from rtnb.worker._capture import release_capture
from rtnb.worker._channel import GIVE_WAY_S, ChannelServer
from rtnb.worker._commands import RankCommand
from rtnb.worker._runtime import RankContext, RankRuntime
from rtnb.worker._stopping import CellStopped
from rtnb.worker._torchrun import (
    install_torchrun_compat,
    remove_torchrun_compat,
    torchrun_environment,
)

__all__ = ["ACTOR_CONCURRENCY", "RAY_OWNED_ENV", "RELAY_FROM_RANKS", "RankActor", "poll_timing"]

# Variables a rank gets from Ray for itself, not from the kernel that adopts it.
RAY_OWNED_ENV = ("RAY_", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "PYTHONPATH")

# One long-poll, one control call and one pull/push can be in flight at once.
ACTOR_CONCURRENCY = 4
# A rank answers a long-poll as soon as something happens; this is only the
# longest a quiet rank holds one call open.
POLL_WAIT_S = 0.25
# Output and reports are held this long on the rank to batch them per round trip.
BATCH_S = 0.1


# From this many ranks, a group without an open channel (a Ray Client) starts its
# cells through rank 0's relay (see RankActor.relay):
# each Ray call costs the kernel ~0.2 ms of CPU on a small machine, one per rank,
# while the relay costs rank 0 its store round trips and a listener's wake-up.
# Measured on 2 cores (trivial cells back to back, messages pickled by rtnb): at 2
# ranks direct calls take 1.7-2.5 ms a cell, the relay 3.0-3.3; at 3, 2.7-3.4 vs
# 3.0-3.6; at 4 the relay wins, 3.5-4.4 vs 4.0-5.1.
RELAY_FROM_RANKS = 4
_CELL_KEY = "rtnb/cell/{}"
_ANSWER_KEY = "rtnb/answer/{}/{}"
_RELAY_KEPT_CELLS = 256
# A listener's blocking read of the next cell gives up after this and reads again.
# torch's store client logs two warning lines for every read or wait that times
# out, so it is as long as its poll() takes (32-bit milliseconds): an idle group
# logs nothing for 24 days.
_RELAY_LISTEN_S = 24 * 24 * 3600.0
# A relayed rank's answer when it has none to give (the driver asks it directly).
_NO_ANSWER = b"-"
# How long a direct run() waits for the listener to read a relayed cell's token.
_HEAR_S = 5.0


def poll_timing(world_size: int) -> tuple[float, float]:
    """(longest hold, batching window) of a poll for a group of ``world_size``.

    Each answered poll costs the kernel ~1.5-2 ms of CPU in Ray's call machinery
    (measured on the 2-core development VM), so past 4 ranks the batching window
    grows with the group: at 32 ranks a reporting rank answers about once a
    second (0.8 s window) and a quiet one every 1.6 s, instead of 10 and 4 times
    a second, which alone would take a third of a core. A cell's end and a pause
    for a stop still answer at once.
    """
    batch = min(1.0, BATCH_S * max(1.0, world_size / 4))
    return max(POLL_WAIT_S, min(2.0, 2 * batch)) if world_size > 4 else POLL_WAIT_S, batch


class RankActor:
    """One rank. Made with its ``context`` (a cold start), or with ``None`` as a spare
    of the warm Ray that imports torch ahead (:meth:`warm_up`) and becomes a rank
    when a kernel claims it (:meth:`adopt`)."""

    def __init__(self, context: dict[str, Any] | None, env: dict[str, str]) -> None:
        self._rendezvous: socket.socket | None = None
        self._channel: ChannelServer | None = None
        self._relay: Any = None
        self._relayed = 0  # rank 0: the last token relayed
        self._sweeper: _KeySweeper | None = None  # rank 0: deletes spent relay keys
        self._closer: _AnswerCloser | None = None  # rank 0: see _gather
        # Ranks but 0: the listener's progress through the tokens.
        self._hearing = threading.Condition()
        self._heard_token = 0
        self._listening = False
        self._warm = threading.Event()  # set once torch is imported (or failed to be)
        self.runtime: RankRuntime
        if context is not None:
            self._become_rank(context, env)
            # torch's import is most of a cold rank's start (~1.5 s of CPU): begun
            # now, it overlaps what the kernel asks before it needs torch
            # (set_placement), instead of starting there.
            threading.Thread(
                target=self._import_torch, name="rtnb-import-torch", daemon=True
            ).start()

    def _become_rank(self, context: dict[str, Any], env: dict[str, str]) -> None:
        os.environ.update(env)
        self.runtime = RankRuntime(RankContext(**context))
        from rtnb.worker import _compat

        _compat.install_ray_train_aliases()

    def _import_torch(self) -> None:
        with contextlib.suppress(BaseException):  # set_placement's own import says why
            import torch  # noqa: F401
            import torch.distributed  # noqa: F401
        self._warm.set()

    def warm_up(self, background: bool) -> None:
        """Import what every rank needs (torch above all) before any kernel asks.
        ``background``: at the lowest CPU priority, in a thread of its own (Linux
        priorities are per thread), so the ranks already training keep the CPUs."""

        def imports() -> None:
            if background:
                with contextlib.suppress(OSError, AttributeError):
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            try:
                import torch  # noqa: F401
                import torch.distributed  # noqa: F401
            finally:
                self._warm.set()

        thread = threading.Thread(target=imports, name="rtnb-warm-up", daemon=True)
        thread.start()
        thread.join()

    def adopt(
        self, context: dict[str, Any], env: dict[str, str], sys_path: list[str], cwd: str
    ) -> None:
        """Become rank ``context['world_rank']`` of the claiming kernel's group, in its
        working directory and with its import path (a cold rank inherits both)."""
        self._warm.wait(120)
        with contextlib.suppress(OSError):
            os.chdir(cwd)
        # The kernel's environment, not the one of the kernel that started the warm
        # Ray (which may have held other credentials); Ray's own variables stay.
        for name in [n for n in os.environ if n not in env and not n.startswith(RAY_OWNED_ENV)]:
            del os.environ[name]
        sys.path[:0] = [p for p in sys_path if p not in sys.path]
        self._become_rank(context, env)
        threads = env.get("OMP_NUM_THREADS")
        if threads and "torch" in sys.modules:
            # torch read OMP_NUM_THREADS when the spare imported it, before this env.
            sys.modules["torch"].set_num_threads(int(threads))

    def renew(self, run_name: str, storage_path: str) -> None:
        """Become this rank of run ``run_name`` with a fresh namespace, keeping the
        process, its torch import and its process group: a sweep's next trial on
        the same group starts without paying a group's start. Process-wide state
        (torch's RNG, modules the last trial imported) carries over."""
        old = self.runtime
        if old.state is CellState.RUNNING:
            raise RuntimeError(f"rank {old.context.world_rank} is still running a cell")
        old.close()
        release_capture()
        old.namespace.clear()
        # A cell's functions hold its namespace in a cycle: the last trial's model and
        # optimizer go now, not when the collector happens to run.
        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        context = dataclasses.replace(
            old.context, run_name=run_name, storage_path=storage_path, extra={}
        )
        self.runtime = RankRuntime(context)
        self.runtime.folder = old.folder  # the same process: its copy of the files stays

    # ---- set-up ----------------------------------------------------------------------
    def describe(self) -> RankPlace:
        import ray

        return RankPlace(
            pid=os.getpid(),
            hostname=socket.gethostname(),
            node_ip=ray.util.get_node_ip_address(),
            node_id=ray.get_runtime_context().get_node_id(),
            gpu_ids=tuple(str(g) for g in ray.get_gpu_ids()),
        )

    def open_folder(self, roots: list[FolderRoot], copy_all: bool) -> tuple[str, ...]:
        """Work in the kernel's code folders, or a private copy where this node cannot
        see them: the keys of those to copy (:class:`~rtnb.worker._folder.RankFolder`)."""
        return self.runtime.folder.open(roots, copy_all)

    def apply_files(self, changes: FolderChanges) -> None:
        self.runtime.folder.apply(changes)

    def open_rendezvous(self, host: str) -> int:
        """Rank 0: a listening socket on ``host`` for torch.distributed's store; its
        port. The socket is handed to the store itself (no port race, and it listens
        on ``host`` only, not on every interface as a store opened by port would)."""
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.bind((host, 0))
        sock.listen(128)
        self._rendezvous = sock
        return sock.getsockname()[1]

    def set_placement(
        self, local_rank: int, local_world_size: int, node_rank: int, nodes: int = 1
    ) -> str:
        ctx = self.runtime.context
        ctx.local_rank, ctx.local_world_size, ctx.node_rank = (
            local_rank,
            local_world_size,
            node_rank,
        )
        # Every variable torchrun gives a worker: a torchrun script reads them as is.
        os.environ.update(
            torchrun_environment(
                ctx.world_rank,
                ctx.world_size,
                local_rank,
                local_world_size,
                node_rank,
                nodes,
                ctx.run_name,
            )
        )
        # torch is imported by here, on every rank at once, so the start's "ranks"
        # phase holds that cost and "process group" only the rendezvous. The import
        # begun in __init__ is waited for; an import that failed there fails here.
        self._warm.wait()
        import torch
        import torch.distributed  # noqa: F401

        if ctx.backend == "nccl":
            if not torch.cuda.is_available():
                build = "a CPU-only build" if torch.version.cuda is None else "no GPU visible"
                raise RuntimeError(
                    f"rank {ctx.world_rank} on {socket.gethostname()} got a GPU from Ray, but "
                    f"torch {torch.__version__} there sees none ({build}): install torch's "
                    "CUDA build on the cluster's nodes (pytorch.org's --index-url for your "
                    "CUDA), or drop --gpu"
                )
            # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU, so it is cuda:0 here.
            torch.cuda.set_device(0)
            ctx.device = "cuda:0"
        else:
            # accelerate (under a Hugging Face Trainer's TrainingArguments) takes a
            # process without an accelerator as distributed only when told it runs
            # on CPU; else each rank trains alone, as each worker of TorchTrainer.fit()
            # does on CPU. A user's own setting wins.
            os.environ.setdefault("ACCELERATE_USE_CPU", "true")
        return ctx.device

    def init_distributed(self, master_addr: str, master_port: int, timeout_s: float) -> bool:
        import torch.distributed as dist

        ctx = self.runtime.context
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        bind_collectives_to(_interface_of(_node_address(master_addr)))
        timeout = timedelta(seconds=timeout_s)
        listening = self._rendezvous
        store = dist.TCPStore(
            master_addr,
            master_port,
            ctx.world_size,
            is_master=listening is not None,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listening.fileno() if listening is not None else None,
        )
        dist.init_process_group(
            backend=ctx.backend,
            store=store,
            rank=ctx.world_rank,
            world_size=ctx.world_size,
            timeout=timeout,
        )
        install_torchrun_compat()
        return dist.is_initialized()

    def shutdown_distributed(self) -> None:
        import torch.distributed as dist

        remove_torchrun_compat()
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- the open channel --------------------------------------------------------------
    def open_channel(self, host: str, key: bytes) -> int:
        """Listen on ``host`` for the kernel's open channel (``worker/_channel.py``),
        which carries this rank's ``run`` and ``poll`` calls; its port."""
        if self._channel is not None:
            self._channel.close()
        self._channel = ChannelServer(
            self.run, self.poll, self.start, key, self.runtime.context.world_rank
        )
        return self._channel.open(host)

    def reach_peers(self, addresses: dict[int, tuple[str, int]], timeout_s: float) -> list[int]:
        """Rank 0 of a fanning group: connect to the other ranks' channels; the ranks
        reached (see ``ChannelServer.reach_peers``)."""
        assert self._channel is not None, "the rank's channel is open first"
        return self._channel.reach_peers(addresses, timeout_s)

    # ---- the cell relay (groups of RELAY_FROM_RANKS and more) -------------------------
    def open_relay(self, master_addr: str, master_port: int) -> None:
        """Join the cell relay: a client of the group's own store (rank 0's TCPStore).
        Every rank but 0 listens there for the cells rank 0 relays and runs them in
        the listening thread itself: every cell of such a rank runs in that one
        thread (a direct ``run`` waits for it), so thread-local state such as
        ``torch.set_grad_enabled(False)`` holds from cell to cell, and a relayed
        cell costs no hand-off between threads (on a small machine, with 32 ranks
        waking at once, those hand-offs were a sixth of a trivial cell)."""
        self._relay = self._store_client(master_addr, master_port)
        if self.runtime.context.world_rank == 0:
            self._sweeper = _KeySweeper(self._store_client(master_addr, master_port))
            self._closer = _AnswerCloser(self._store_client(master_addr, master_port))
        else:
            self._listening = True
            threading.Thread(target=self._listen, name="rtnb-cell-relayed", daemon=True).start()

    @staticmethod
    def _store_client(master_addr: str, master_port: int) -> Any:
        import torch.distributed as dist

        return dist.TCPStore(
            master_addr,
            master_port,
            is_master=False,
            timeout=timedelta(seconds=_RELAY_LISTEN_S),
            wait_for_workers=False,
        )

    def relay(
        self, request: bytes | CellRequest, ranks: list[int], wait_s: float
    ) -> dict[int, bytes | None]:
        """Rank 0: start a cell (``request``, whose token orders the relay) on ``ranks`` with one write to the group's store (every
        listening rank wakes at once) and gather the ranks' answers from it: one Ray
        call for the whole group instead of one per rank. A rank's answer is its final
        update (pickled, as the rank sent it) when the cell ended with nothing else
        to deliver, else None: the driver then asks that rank directly (``run`` with
        the same token, which does not start the cell twice).

        Rank 0 waits up to ``wait_s`` for the answers (``GIVE_WAY_S`` once its own
        cell has output or reports, or runs long), then closes the missing ones, so
        a listener still running the cell finds its answer closed and writes
        nothing that would stay in the store."""
        from ray import cloudpickle

        request = from_wire(request)
        store, token = self._relay, request.token
        assert token is not None, "a relayed cell has a dispatch token"
        # A token the driver took without this call reaching the store (a relay
        # that failed before writing its cell) is marked as skipped: the listeners
        # read the tokens in order and would otherwise wait for it for ever.
        for skipped in range(self._relayed + 1, token):
            store.set(_CELL_KEY.format(skipped), b"")
        self._relayed = max(self._relayed, token)
        store.set(
            _CELL_KEY.format(token),
            cloudpickle.dumps((request, ranks)),
        )
        answers: dict[int, bytes | None] = {}
        if 0 in ranks:
            started = self.runtime.start_cell(request)
            own = self.runtime.final_update(POLL_WAIT_S) if started else None
            answers[0] = to_wire(own) if own is not None else None
            if own is None:
                # Rank 0 has output or reports to deliver, or a long cell: the
                # others get a moment more (a cell where only rank 0 prints still
                # brings their answers back here), not the whole wait.
                wait_s = min(wait_s, GIVE_WAY_S)
        keys = {r: _ANSWER_KEY.format(token, r) for r in ranks if r != 0}
        if keys:
            values = self._gather(list(keys.values()), wait_s)
            for rank, value in zip(keys, values):
                answers[rank] = None if value == _NO_ANSWER else value
            self._sweeper.delete(list(keys.values()))
        if token > _RELAY_KEPT_CELLS:
            self._sweeper.delete([_CELL_KEY.format(token - _RELAY_KEPT_CELLS)])
        return answers

    def _gather(self, keys: list[str], wait_s: float) -> list[bytes]:
        """The listeners' answers, each closed with ``_NO_ANSWER`` if it is not in
        after ``wait_s``. The wait itself never times out (torch's store client
        logs two warning lines for every wait that does, which a user-started Ray
        streams into the notebook): the answers still missing are closed from
        another connection (the same compare_set a late listener then loses to),
        which ends the wait. One answer (a group of 2) is one blocking read, which
        returns it as it lands: no check, wait and read, three round trips."""
        store, closer = self._relay, self._closer
        if len(keys) == 1:
            with closer.armed(keys, wait_s):
                return [store.get(keys[0])]
        if not store.check(keys):
            with closer.armed(keys, wait_s):
                store.wait(keys)
        return store.multi_get(keys)

    def _listen(self) -> None:
        from ray import cloudpickle

        store, rank, token = self._relay, self.runtime.context.world_rank, 1
        try:
            while True:
                try:
                    payload = store.get(_CELL_KEY.format(token))
                except Exception as exc:  # noqa: BLE001
                    if "timeout" in str(exc).lower():
                        continue  # an idle group: keep listening
                    return  # the store is gone with rank 0: so is this group
                if payload:  # (empty: a token that was never relayed)
                    try:
                        self._run_relayed(store, rank, *cloudpickle.loads(payload))
                    except CellStopped:
                        pass  # an interrupt that landed just after its cell ended
                # (after the cell too: it also covers a token not for this rank, and
                # one whose start raised before _run_relayed marked it heard)
                self._heard(token)
                token += 1
        finally:
            with self._hearing:
                self._listening = False
                self._hearing.notify_all()

    def _run_relayed(self, store, rank: int, request: CellRequest, ranks: list[int]) -> None:
        if rank not in ranks:
            return
        token = request.token
        try:
            started = self.runtime.start_cell(request, in_caller=True)
        except Exception:  # noqa: BLE001 - the driver's direct call reports it
            started = False
        self._heard(token)  # a direct run() for this token can go on: it is started
        answer = None
        if started:
            self.runtime.execute(request)
            answer = self.runtime.final_update(0.0)
        with contextlib.suppress(Exception):
            # compare_set: rank 0 may have closed this answer (it stopped waiting).
            store.compare_set(
                _ANSWER_KEY.format(token, rank),
                b"",
                to_wire(answer) if answer is not None else _NO_ANSWER,
            )

    def _heard(self, token: int) -> None:
        with self._hearing:
            self._heard_token = max(self._heard_token, token)
            self._hearing.notify_all()

    def _await_listener(self, token: int) -> None:
        """A direct run() of a relayed cell on a listening rank: wait until the
        listener has read ``token`` (rank 0 wrote it before the driver asks anyone)
        so the cell runs in the listening thread; if it does not come (the relay
        failed before writing it), the cell thread starts it instead."""
        with self._hearing:
            self._hearing.wait_for(
                lambda: self._heard_token >= token or not self._listening, _HEAR_S
            )

    # ---- cells -------------------------------------------------------------------------
    def run(self, request: bytes | CellRequest) -> bytes:
        """Start a cell (unless the relay already did, under the request's token) and
        long-poll once, so a short cell costs one round trip. Requests and updates
        cross Ray pickled (:func:`~rtnb.core._messages.to_wire`)."""
        request = from_wire(request)
        if request.token is not None and self._listening:
            self._await_listener(request.token)
        self.runtime.start_cell(request)
        return to_wire(self.runtime.wait(POLL_WAIT_S, BATCH_S))

    def poll(self, wait_s: float = POLL_WAIT_S, batch_s: float = BATCH_S) -> bytes:
        return to_wire(self.runtime.wait(wait_s, batch_s))

    def start(self, request: bytes, wait_s: float) -> bytes | None:
        """Start a cell (once per token) and answer with its final update if it ends
        within ``wait_s`` (at most a long-poll's hold) with nothing else to
        deliver, else None: the kernel then asks this rank directly. Nothing is
        drained, so an answer that is let go loses nothing."""
        if not self.runtime.start_cell(from_wire(request)):
            return None
        final = self.runtime.final_update(min(wait_s, POLL_WAIT_S))
        return to_wire(final) if final is not None else None

    # ---- control ----------------------------------------------------------------------
    def command(self, command: RankCommand, payload: Any = None) -> Any:
        """Every control call (stop, hold, debug, stacks, values, …): the runtime
        applies it (:mod:`rtnb.worker._commands`)."""
        return self.runtime.command(command, payload)


class _AnswerCloser:
    """Rank 0: closes the relay answers still missing at a deadline, from a connection
    and a thread of its own that live as long as the group (a timer thread started
    and joined per cell cost a trivial cell ~0.1 ms on a small machine). Arming and
    disarming wake the thread only when it sleeps with nothing armed, or until a
    later deadline than the new one: cells in quick succession cost it one wake-up
    per deadline, not two per cell."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._cond = threading.Condition()
        self._armed: tuple[float, list[str]] | None = None
        self._idle = False
        self._wakes_at = 0.0  # the deadline the thread sleeps until, when not idle
        self._closing = False
        threading.Thread(target=self._run, name="rtnb-relay-closer", daemon=True).start()

    def arm(self, keys: list[str], wait_s: float) -> None:
        with self._cond:
            deadline = time.monotonic() + wait_s
            self._armed = (deadline, keys)
            # A shorter wait (rank 0 giving way) than the one slept on must not wait
            # for the longer one.
            if self._idle or deadline < self._wakes_at:
                self._cond.notify_all()

    def disarm(self) -> None:
        """Once this returns, nothing of the last arm() is closed any more: a close
        after the sweeper deleted a key would leave that key in the store."""
        with self._cond:
            self._armed = None
            self._cond.wait_for(lambda: not self._closing)

    @contextlib.contextmanager
    def armed(self, keys: list[str], wait_s: float) -> Iterator[None]:
        """``keys`` are closed if still missing after ``wait_s``, until the block ends."""
        self.arm(keys, wait_s)
        try:
            yield
        finally:
            self.disarm()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._armed is None:
                        self._idle = True
                        self._cond.wait()
                        self._idle = False
                        continue
                    self._wakes_at = self._armed[0]
                    left = self._wakes_at - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                keys, self._armed, self._closing = self._armed[1], None, True
            try:
                with contextlib.suppress(Exception):  # the store is gone with the group
                    for key in keys:
                        self._store.compare_set(key, b"", _NO_ANSWER)
            finally:
                with self._cond:
                    self._closing = False
                    self._cond.notify_all()


class _KeySweeper:
    """Rank 0: deletes the relay's spent keys in a thread of its own, on its own
    connection to the store, after the relay has answered: one round trip per key,
    which on a small machine took ~0.8 ms of every 32-rank cell when done in line."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._keys: queue.SimpleQueue[list[str]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="rtnb-relay-sweeper", daemon=True).start()

    def delete(self, keys: list[str]) -> None:
        self._keys.put(keys)

    def _run(self) -> None:
        while True:
            for key in self._keys.get():
                try:
                    self._store.delete_key(key)
                except Exception:  # noqa: BLE001 - the store is gone with the group
                    return


def _node_address(master_addr: str) -> str:
    """The address Ray knows for this rank's node (loopback for a group on loopback)."""
    if master_addr.startswith("127.") or master_addr == "::1":
        return master_addr
    import ray

    return ray.util.get_node_ip_address()


def _interface_of(address: str) -> str | None:
    """The network interface that holds ``address`` on this machine."""
    if address.startswith("127.") or address == "::1":
        return "lo"
    return local_addresses().get(address)


def bind_collectives_to(interface: str | None) -> None:
    """gloo and NCCL's bootstrap on ``interface``, unless the user chose one. Left to
    themselves they take the address the host name resolves to: loopback on many
    machines (Debian maps its own name to 127.0.1.1), and then ranks on two machines
    never connect ("Gloo connectFullMesh failed ... remote=[127.0.0.1]")."""
    if interface is None:
        return
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(name, interface)
