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


def _context(root, into) -> list[str]:
    """The build context .dockerignore lets in, copied into ``into`` (the rules this
    file uses: ``*`` first, then ``!NAME`` to let an entry in, ``**/NAME`` to keep
    one out at any depth)."""
    rules = [
        line.strip()
        for line in (root / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert rules[0] == "*", "everything is left out unless let in"
    admitted = [r[1:].rstrip("/") for r in rules if r.startswith("!")]
    dropped = [r[3:] for r in rules if r.startswith("**/")]
    for name in admitted:
        source = root / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=shutil.ignore_patterns(*dropped))
        else:
            shutil.copy2(source, into / name)
    return admitted


@pytest.mark.slow
def test_the_images_first_stage_builds_rtnbs_wheel_from_the_context_dockerignore_admits(
    tmp_path,
):
    """The image builds its wheel from the source in its context: that context (what
    .dockerignore lets in) builds a wheel with the example notebooks, the server
    extension's file and report()'s C path, and holds no .venv or run folder."""
    import sys
    import zipfile

    steps = _instructions((DEPLOY / "Dockerfile").read_text())
    stages = [rest for word, rest in steps if word == "FROM"]
    assert len(stages) == 2 and stages[0].endswith(" AS wheel"), stages
    assert stages[0].split()[0] == stages[1].split()[0], "the wheel is built on the image's Python"
    runs = [rest for word, rest in steps if word == "RUN"]
    assert any("pip wheel" in r and "-w /wheels ." in r for r in runs)
    assert ("COPY", "--from=wheel --chown=ray /wheels/ /tmp/wheels/") in steps

    context = tmp_path / "context"
    context.mkdir()
    admitted = _context(REPO, context)
    assert not {".venv", ".venv-compat", "rtnb_runs", "tests", ".git"} & set(admitted)
    assert not list(context.rglob("__pycache__"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "wheels"), "."],
        cwd=context, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "wheels").glob("rtnb-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "rtnb/notebooks/quickstart.ipynb" in names
    assert any(n.startswith("rtnb/worker/_fastreport.") and n.endswith(".so") for n in names)
    assert any(n.endswith("jupyter_server_config.d/rtnb.json") for n in names)
