"""The deployment files (deploy/) are well formed, as far as this machine can tell
without a container engine, Kubernetes or Slurm: what they would run is checked
against what rtnb and Ray accept."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

import rtnb
from rtnb.core._config import SessionConfig
from tests.conftest import REPO

DEPLOY = REPO / "deploy"
# Dockerfile instructions (the reference's list); anything else is a syntax error.
INSTRUCTIONS = {
    "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK",
    "LABEL", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
}  # fmt: skip


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", text)
    found = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        found.append((word, rest.strip()))
    return found


def test_the_image_installs_a_pinned_torch_before_rtnb_and_runs_the_notebook():
    steps = _instructions((DEPLOY / "Dockerfile").read_text())
    unknown = [word for word, _ in steps if word not in INSTRUCTIONS]
    assert not unknown, f"not Dockerfile instructions: {unknown}"
    assert steps[0][0] == "FROM" and "rayproject/ray:" in steps[0][1]
    runs = [rest for word, rest in steps if word == "RUN"]
    torch_at = next(i for i, r in enumerate(runs) if '"torch==${TORCH_VERSION}"' in r)
    rtnb_at = next(i for i, r in enumerate(runs) if "rtnb-*.whl" in r)
    assert torch_at < rtnb_at, "torch pinned first: rtnb's range must not pull another build"
    assert "rtnb --version" in runs[rtnb_at]
    ray_tag = re.search(r"rayproject/ray:(\d+\.\d+\.\d+)", steps[0][1]).group(1)
    import ray

    assert ray_tag == ray.__version__, "the image's Ray is the one the suite runs"
    cmd = next(rest for word, rest in steps if word == "CMD")
    assert cmd.startswith('["jupyter", "lab"'), cmd


def test_the_kuberay_manifest_gives_the_notebook_an_address_rtnb_accepts():
    import yaml

    documents = list(yaml.safe_load_all((DEPLOY / "kuberay.yaml").read_text()))
    cluster = next(d for d in documents if d["kind"] == "RayCluster")
    pod = next(d for d in documents if d["kind"] == "Pod")
    name = cluster["metadata"]["name"]
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    address = env["RAY_ADDRESS"]
    assert address.startswith(f"{name}-head-svc:"), "KubeRay's head service for this cluster"
    assert SessionConfig(address=address).address == address
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0", "no ranks on the head"
    images = {
        c["image"]
        for spec in [head, *cluster["spec"]["workerGroupSpecs"], {"template": pod}]
        for c in spec["template"]["spec"]["containers"]
    }
    assert images == {f"rtnb:{rtnb.__version__}"}, "one image everywhere: the same versions"
    # Token auth: every container reads the same Secret (the image sets the mode).
    containers = [
        c
        for spec in [head, *cluster["spec"]["workerGroupSpecs"], {"template": pod}]
        for c in spec["template"]["spec"]["containers"]
    ]
    tokens = [
        e["valueFrom"]["secretKeyRef"]
        for c in containers
        for e in c.get("env", ())
        if e["name"] == "RAY_AUTH_TOKEN"
    ]
    assert len(tokens) == len(containers), "every container holds the cluster's token"
    assert all(t == {"name": "rtnb-ray-token", "key": "token"} for t in tokens), tokens
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "ENV RAY_AUTH_MODE=token" in dockerfile


def test_the_slurm_script_is_valid_shell_and_prints_an_address_rtnb_accepts():
    bash = shutil.which("bash")
    if bash is None:
        pytest.fail("bash is needed to check the Slurm script")
    script = DEPLOY / "slurm.sbatch"
    checked = subprocess.run([bash, "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    text = script.read_text()
    assert "ray start --head" in text and 'ray start --address="${head_ip}:${port}"' in text
    assert "export RAY_AUTH_MODE=token" in text and "--dashboard-host" in text
    assert SessionConfig(address="10.1.2.3:6379").address == "10.1.2.3:6379"
