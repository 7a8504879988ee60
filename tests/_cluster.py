"""The simulated cluster of ``tests/test_machines.py`` and ``benchmarks/cluster.py``: a
head that runs no ranks, three worker machines (two whose own names resolve to
loopback, one to its own address), an object store machine (moto's S3 server) and
two notebook machines that are not Ray nodes, all on one bridge
(``tests/_machines.py``). The cluster runs Ray's token authentication, every machine
of it holding the same token.
"""

from __future__ import annotations

import secrets
import urllib.request

from tests._machines import Machine, Network, wait_until

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}
BUCKET = "rtnb-machines"
_RAY_STARTED = "Ray runtime started"


class Cluster:
    """The machines, and how to start Ray on them."""

    def __init__(self) -> None:
        self.net = Network()
        try:
            self._boot()
        except BaseException:
            self.net.close()
            raise

    def _boot(self) -> None:
        self.token = secrets.token_hex(32)
        self.head = self.net.machine("head")
        self.workers = [
            self.net.machine("w1", name_resolves_to_loopback=True),
            self.net.machine("w2"),
            self.net.machine("w3", name_resolves_to_loopback=True),
        ]
        self.store = self.net.machine("store")
        self.nb = self.net.machine("nb")
        self.nb2 = self.net.machine("nb2")
        for machine in self.net.machines:
            if machine is not self.store:
                (machine.home / ".ray").mkdir()
                (machine.home / ".ray" / "auth_token").write_text(self.token)
        self.gcs = f"{self.head.name}:6379"
        self.moto = self.store.popen(
            ["moto_server", "-H", self.store.address, "-p", "5000"],
            log=self.store.disk / "moto.log",
        )
        self._start_node(
            self.head,
            [
                "--head",
                "--port=6379",
                "--num-cpus=0",
                "--dashboard-host=0.0.0.0",
                "--ray-client-server-port=10001",
            ],
        )
        for worker in self.workers:
            self.join(worker)
        wait_until("moto's server", lambda: answers(f"http://{self.store.address}:5000"), 60)
        import boto3

        self.s3 = boto3.client(
            "s3",
            endpoint_url=f"http://{self.store.address}:5000",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        self.s3.create_bucket(Bucket=BUCKET)
        self.storage = (
            f"s3://{BUCKET}/runs?endpoint_override={self.store.name}:5000&scheme=http"
            "&region=us-east-1"
        )

    def env(self, machine: Machine, **extra: str) -> dict[str, str]:
        return machine.env(**CREDENTIALS, **extra)

    def _start_node(self, machine: Machine, args: list[str], tries: int = 3) -> None:
        log = machine.disk / "ray.log"
        log.write_text("")
        proc = machine.popen(
            [
                "ray",
                "start",
                "--block",
                "--object-store-memory=100000000",
                "--disable-usage-stats",
                *args,
            ],
            env=self.env(machine, RAY_AUTH_MODE="token"),
            log=log,
        )
        wait_until(
            f"Ray on {machine.name}",
            lambda: _RAY_STARTED in log.read_text() or proc.poll() is not None,
            180,
        )
        if proc.poll() is not None:
            # On a busy machine Ray's own start gives up (its raylet registers after
            # Ray's fixed 30 s); a user would run `ray start` again, and so do we.
            (machine.disk / f"ray-failed-{tries}.log").write_text(log.read_text())
            if tries <= 1:
                raise RuntimeError(
                    f"Ray did not start on {machine.name}:\n{log.read_text()[-3000:]}"
                )
            self._start_node(machine, args, tries - 1)

    def join(self, worker: Machine) -> None:
        # By address: gRPC's own resolver in Ray's C++ may not read /etc/hosts (rtnb
        # resolves a name the user gives with the system's resolver first).
        self._start_node(worker, [f"--address={self.head.address}:6379", "--num-cpus=1"])

    def reboot(self, worker: Machine) -> None:
        """A worker machine powered on again, its Ray joined anew."""
        worker.reboot()
        self.join(worker)

    def raylets(self, machine: Machine) -> int:
        """Raylets running on ``machine`` (its own PID namespace shows only its own)."""
        out = machine.sh("ps -eo args").stdout.splitlines()
        return sum(1 for line in out if line.split(" ", 1)[0].endswith("/raylet"))

    def close(self) -> None:
        self.net.close()


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False
