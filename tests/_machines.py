"""Machines on one host, for tests of what crosses a network: each machine is its own
network namespace (an address on one bridge), its own mount namespace (its own disk,
``/tmp`` and ``HOME``; the other machines' disks and the host's ``~/.ray`` absent),
its own host name and ``/etc/hosts`` (UTS), and its own PID namespace (its processes
see only each other, as Ray's discovery of a local raylet by ``ps`` does on a real
machine; killing the machine's first process ends every process on it).

Standard library only: benchmarks and scripts import it too. Needs root and
iproute2's ``ip``; :func:`why_not` says why machines cannot be made here.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Where each machine's own disk is mounted, inside that machine.
DISK = "/machine"


def why_not() -> str | None:
    """Why machines cannot be made on this host (None: they can)."""
    if os.geteuid() != 0:
        return "machines as namespaces need root"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"machines as namespaces need `{tool}`"
    probe = subprocess.run(
        ["unshare", "-m", "-u", "-p", "-n", "--fork", "--mount-proc", "true"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"unshare cannot make namespaces here: {probe.stderr.strip()[:200]}"
    for what, path in (("this Python", sys.prefix), ("this checkout", Path(__file__).parent)):
        if Path(path).resolve().is_relative_to("/tmp"):
            # Each machine mounts a /tmp of its own: `ray` would not be found there.
            return (
                f"machines see a /tmp of their own, so {what} ({path}) is out of their "
                "sight: run from a checkout outside /tmp"
            )
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Network:
    """One bridge on the host, ``10.<n>.0.0/24``; the host itself is ``.1`` on it (so a
    test reaches a machine's kernel), the machines ``.10`` and up."""

    def __init__(self, tag: str | None = None) -> None:
        self.tag = tag or f"{os.getpid() % 10000}"
        self.bridge = f"rtbr{self.tag}"[:15]
        n = 100 + os.getpid() % 100
        self.prefix = f"10.{n}.0"
        self.host_address = f"{self.prefix}.1"
        self.root = Path(tempfile.mkdtemp(prefix="rtnb-machines-"))
        self.machines: list[Machine] = []
        _ip("link", "del", self.bridge, check=False)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def machine(self, name: str, name_resolves_to_loopback: bool = False) -> Machine:
        address = f"{self.prefix}.{10 + len(self.machines)}"
        machine = Machine(self, name, address, name_resolves_to_loopback)
        self.machines.append(machine)
        for each in self.machines:
            each.write_hosts()
        machine.boot()
        return machine

    def close(self) -> None:
        for machine in self.machines:
            machine.close()
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.root, ignore_errors=True)


class Machine:
    def __init__(self, net: Network, name: str, address: str, loopback_name: bool) -> None:
        self.net, self.name, self.address = net, name, address
        self.loopback_name = loopback_name
        self.netns = f"rtm-{net.tag}-{name}"[:30]
        self.host_link = f"v{net.tag}{name}"[:15]
        self.disk = net.root / name  # seen as DISK on the machine itself
        (self.disk / "home").mkdir(parents=True)
        (self.disk / "work").mkdir()
        self.init: subprocess.Popen | None = None
        self.pid1: int | None = None  # the machine's first process, as the host sees it

    @property
    def home(self) -> Path:
        """The machine's ``HOME``, as the host sees it."""
        return self.disk / "home"

    @property
    def work(self) -> Path:
        """A folder of the machine's own disk (``DISK/work`` on it), as the host sees it."""
        return self.disk / "work"

    def write_hosts(self) -> None:
        lines = ["127.0.0.1 localhost"]
        for each in self.net.machines:
            own = each is self
            if own and self.loopback_name:
                lines.append(f"127.0.1.1 {each.name}")  # Debian's default for its own name
            else:
                lines.append(f"{each.address} {each.name}")
        (self.disk / "hosts").write_text("\n".join(lines) + "\n")
        # No name server on this network: one that answers "nothing here" at once,
        # as a network's own DNS would for a name only /etc/hosts knows (resolvers
        # that ask DNS for an IPv6 address too would otherwise wait out their timeout).
        (self.disk / "resolv.conf").write_text(
            "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"
        )

    def boot(self) -> None:
        _ip("netns", "del", self.netns, check=False)
        _ip("link", "del", self.host_link, check=False)
        _ip("netns", "add", self.netns)
        inner = "eth0"
        _ip(
            "link",
            "add",
            self.host_link,
            "type",
            "veth",
            "peer",
            "name",
            inner,
            "netns",
            self.netns,
        )
        _ip("link", "set", self.host_link, "master", self.net.bridge, "up")
        for args in (
            ("addr", "add", f"{self.address}/24", "dev", inner),
            ("link", "set", inner, "up"),
            ("link", "set", "lo", "up"),
            ("route", "add", "default", "via", self.net.host_address),
        ):
            _ip("-n", self.netns, *args)
        hidden = [str(self.net.root), "/tmp"]
        if Path("/root/.ray").is_dir():
            hidden.append("/root/.ray")
        setup = " && ".join(
            [
                f"mkdir -p {DISK}",
                f"mount --bind {shlex.quote(str(self.disk))} {DISK}",
                f"mount --bind {DISK}/hosts /etc/hosts",
                f"mount --bind {DISK}/resolv.conf /etc/resolv.conf",
                *(f"mount -t tmpfs tmpfs {shlex.quote(h)}" for h in hidden),
                f"hostname {shlex.quote(self.name)}",
                "echo up",
                "exec sleep infinity",
            ]
        )
        self.init = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.netns,
                "unshare",
                "-m",
                "-u",
                "-p",
                "--fork",
                "--mount-proc",
                "--propagation",
                "private",
                "sh",
                "-c",
                setup,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        line = self.init.stdout.readline() if self.init.stdout else ""
        if line.strip() != "up":
            raise RuntimeError(
                f"machine {self.name} did not boot: {self.init.stderr.read() if self.init.stderr else ''}"
            )
        children = Path(f"/proc/{self.init.pid}/task/{self.init.pid}/children").read_text().split()
        self.pid1 = int(children[0])

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a process started on this machine: its own HOME, the
        host's Python and tools, nothing of the host's Ray settings."""
        keep = ("PATH", "LANG", "LC_ALL", "TERM", "CI", "PYTHONDONTWRITEBYTECODE")
        env = {k: v for k, v in os.environ.items() if k in keep}
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
        env["HOME"] = f"{DISK}/home"
        env["RAY_DEDUP_LOGS"] = "0"
        env.update(extra)
        return env

    def command(self, argv: list[str], cwd: str | None = None) -> list[str]:
        """``argv`` run on this machine (its namespaces, ``cwd`` on its own disk)."""
        assert self.pid1 is not None, f"machine {self.name} is not up"
        if cwd is not None:  # nsenter's --wd is looked up before the machine's mounts
            argv = ["sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", cwd, *argv]
        return ["nsenter", "-t", str(self.pid1), "-a", "--", *argv]

    def popen(
        self,
        argv: list[str],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        log: Path | None = None,
    ) -> subprocess.Popen:
        out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            return subprocess.Popen(
                self.command(argv, cwd),
                env=env or self.env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            if log is not None:
                out.close()

    def run(
        self,
        argv: list[str],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(argv, cwd),
            env=env or self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def sh(self, script: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
        return self.run(["sh", "-c", script], env=self.env(**env), timeout=timeout)

    def link(self, up: bool) -> None:
        """The machine's cable: pulled (``up=False``: its processes live on, nothing
        reaches them) or put back."""
        _ip("link", "set", self.host_link, "up" if up else "down")

    def kill(self) -> None:
        """Every process on the machine ends at once (a power cut); its disk stays."""
        if self.pid1 is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid1, signal.SIGKILL)
        if self.init is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.init.wait(timeout=10)
        self.pid1 = None

    def reboot(self) -> None:
        """Power back on, the same address and disk (after :meth:`kill`)."""
        self.kill()
        _ip("netns", "del", self.netns, check=False)
        _ip("link", "del", self.host_link, check=False)
        self.boot()

    def close(self) -> None:
        self.kill()
        _ip("netns", "del", self.netns, check=False)
        _ip("link", "del", self.host_link, check=False)


def wait_until(what: str, check, timeout_s: float, every_s: float = 0.2):
    """Poll ``check`` until it returns something true; that value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
