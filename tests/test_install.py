"""A normal (not editable) install of rtnb runs its demo: the example notebooks ship
inside the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import rtnb
from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_rtnb_demo_from_a_wheel_installed_into_a_fresh_venv(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(REPO),
            "-w",
            str(wheels),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("rtnb-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    # rtnb's dependencies (torch, ray, ...) come from this environment, but not its
    # editable rtnb: a plain directory on sys.path, whose .pth files are not read.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "-q",
            # As into a user's environment that holds torch and Ray already: every
            # declared requirement must be met by what is there, nothing fetched.
            "--no-index",
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    version = subprocess.run(
        [str(venv / "bin" / "rtnb"), "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert version.startswith(f"rtnb {rtnb.__version__} (Python ") and "Ray 2." in version, version
    (dist_info,) = site.glob("rtnb-*.dist-info")
    assert (dist_info / "licenses" / "LICENSE").read_text().lstrip().startswith("Apache License")
    # The Jupyter server extension is enabled by the wheel's data file (it warms Ray).
    assert json.loads((venv / "etc/jupyter/jupyter_server_config.d/rtnb.json").read_text()) == {
        "ServerApp": {"jpserver_extensions": {"rtnb": True}}
    }
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import rtnb; print(rtnb.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout.strip()
    assert where.startswith(str(site)), f"not the installed wheel: {where}"
    stand_in = Path(where).parent / "core" / "_lazy_imports" / "rfc3987_syntax" / "__init__.py"
    assert stand_in.exists(), "the wheel ships the lazy-import stand-in"
    assert list((Path(where).parent / "worker").glob("_fastreport.*.so")), (
        "the wheel carries report()'s C path, built where a C compiler is (as here)"
    )
    # The README's main job as a user with this wheel gets it: no cluster named, so
    # the demo embeds a local Ray of its own (CI runs it here, not a second time).
    work = tmp_path / "elsewhere"
    work.mkdir()
    proc = subprocess.run(
        [str(venv / "bin" / "rtnb"), "demo"],
        capture_output=True,
        text=True,
        cwd=work,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "quickstart.ipynb ran to completion" in proc.stdout
    output = work / "rtnb_runs" / "demo" / "quickstart.output.ipynb"
    assert ", Ray embedded" in output.read_text(), "the demo joined a cluster, not a Ray of its own"
    # The newcomer's first plot: the training cell's figure, every rank's curve to the
    # last of the notebook's steps (a live view in JupyterLab; kept as it ended here).
    figures = [
        output_data["application/vnd.plotly.v1+json"]
        for cell in json.loads(output.read_text())["cells"]
        for output_data in (o.get("data", {}) for o in cell.get("outputs", []))
        if "application/vnd.plotly.v1+json" in output_data
    ]
    assert len(figures) == 1, "the training cell leaves one figure"
    curves = {(t["name"], len(t["x"])) for t in figures[0]["data"] if t.get("xaxis") == "x"}
    assert curves == {("rank 0", 300), ("rank 1", 300), ("mean", 300)}, curves
    # A pip user's way to the example notebooks: out of the package, into a folder.
    copied = subprocess.run(
        [str(venv / "bin" / "rtnb"), "demo", "--copy"],
        capture_output=True,
        text=True,
        cwd=work,
        timeout=60,
    )
    assert copied.returncode == 0, copied.stderr
    examples = work / "rtnb-examples"
    assert (examples / "quickstart.ipynb").read_bytes() == (
        REPO / "notebooks" / "quickstart.ipynb"
    ).read_bytes()
    assert "open rtnb-examples/quickstart.ipynb in JupyterLab" in copied.stdout
    again = subprocess.run(
        [str(venv / "bin" / "rtnb"), "demo", "--copy"],
        capture_output=True,
        text=True,
        cwd=work,
        timeout=60,
    )
    assert again.returncode == 2 and again.stderr.count("\n") == 1, again.stderr
    assert "already exists" in again.stderr and "Traceback" not in again.stderr
    # The wheel's name as the README shows it: built for this Python and platform.
    assert wheel.name.startswith(f"rtnb-{rtnb.__version__}-cp3"), wheel.name
    assert "rtnb-0.1.0-cp311-cp311-linux_x86_64.whl" in (REPO / "README.md").read_text()
