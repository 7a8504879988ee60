"""CI cannot go green without the tools the browser, S3 and TensorBoard tests need,
nor by skipping; and the suite's background lane gives a starved scenario one try
alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


def _require_tools(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / ".ci" / "require-tools")],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_a_missing_browser_fails_ci_and_only_warns_locally():
    in_ci = _require_tools(CI="true", RTNB_CHROMIUM="/nonexistent/chromium")
    assert in_ci.returncode == 1
    assert "missing: chromium (/nonexistent/chromium" in in_ci.stderr
    assert "CI=true" in in_ci.stderr
    local = _require_tools(CI="", RTNB_CHROMIUM="/nonexistent/chromium")
    assert local.returncode == 0 and "will skip" in local.stderr


def test_the_setup_script_stops_on_a_failed_install(tmp_path):
    """The real script, run against a .venv whose pip fails: it stops at that install
    with pip's own output and one line naming it, tries nothing after it and writes no
    stamp (the next run starts over)."""
    for name in (".ci/setup", "pyproject.toml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes((REPO / name).read_bytes())
    sources = list((REPO / "rtnb").glob("*/*.c"))
    assert sources, "the C sources the set-up hashes moved: update this test"
    for source in sources:
        copied = tmp_path / source.relative_to(REPO)
        copied.parent.mkdir(parents=True, exist_ok=True)
        copied.write_bytes(source.read_bytes())
    calls = tmp_path / "calls.log"
    fake = tmp_path / ".venv" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {calls}\n'
        'case "$*" in\n'
        '  *"pip install"*) echo "ERROR: No matching distribution found for torch==2.13.0"; exit 1;;\n'
        "  *) exit 1;;\n"
        "esac\n"
    )
    fake.chmod(0o755)
    done = subprocess.run(
        ["bash", str(tmp_path / ".ci" / "setup")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "No matching distribution found for torch==2.13.0" in done.stderr
    assert "setup failed: pip install torch==2.13.0" in done.stderr
    installs = [line for line in calls.read_text().splitlines() if "pip install" in line]
    assert len(installs) == 1 and "torch==2.13.0" in installs[0], installs
    assert not (tmp_path / ".venv" / ".rtnb-setup").exists()


PLANTED = """
import pytest

def test_planted():
    pytest.skip("a planted skip")

def test_planted_import():
    pytest.importorskip("no_such_module_rtnb")

@pytest.mark.gpu
def test_planted_gpu():
    pytest.skip("no GPU here")
"""


def test_a_skip_fails_in_ci_unless_the_test_is_a_gpu_one(tmp_path):
    """The project's hook, on a planted skip, an importorskip and a gpu test's skip."""
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_runtest_makereport  # noqa: F401\n"
        "def pytest_configure(config):\n"
        "    config.addinivalue_line('markers', 'gpu: needs a GPU')\n"
    )
    (tmp_path / "test_planted.py").write_text(PLANTED)

    def run(ci: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "CI": ci, "PYTHONPATH": str(REPO)}
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
        )

    in_ci = run("true")
    assert in_ci.returncode == 1, in_ci.stdout
    assert "2 failed, 1 skipped" in in_ci.stdout, in_ci.stdout
    assert (
        "test_planted.py::test_planted skipped (a planted skip): only tests marked gpu"
        in in_ci.stdout
    ), in_ci.stdout
    assert "no_such_module_rtnb" in in_ci.stdout
    local = run("")
    assert local.returncode == 0 and "3 skipped" in local.stdout, local.stdout


def test_a_background_scenario_that_failed_runs_again_beside_the_suite_then_alone():
    """The lane's later tries (tests/_background.py): a scenario that raised, or whose
    value its ``failed_because`` names a failure, runs again at once in the lane's
    second thread, at nearly the suite's priority; one that failed there too runs a
    last time in the asking test's thread; one that fails alone too fails its test."""
    import threading

    from tests import _background

    tries: dict[str, list[tuple[str, int]]] = {"raises": [], "rejected": [], "always": []}

    def attempt(key: str):
        def run(folder):
            tries[key].append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, 0)))
            if key == "always" or len(tries[key]) == 1:
                if key == "rejected":
                    return {"gave up": True}
                raise RuntimeError(f"{key}: Ray's own start gave up")
            return {"try": len(tries[key])}

        return run

    def failed_because(value: dict) -> str:
        return "its start gave up" if value.get("gave up") else ""

    _background.scenario("lane-raises")(attempt("raises"))
    _background.scenario("lane-rejected", failed_because=failed_because)(attempt("rejected"))
    _background.scenario("lane-always")(attempt("always"))
    lane = _background.Lane()
    try:
        lane.start(["lane-raises", "lane-rejected", "lane-always"])
        assert lane.result("lane-raises", timeout_s=60) == {"try": 2}
        assert lane.result("lane-rejected", timeout_s=60) == {"try": 2}
        with pytest.raises(RuntimeError, match="always: Ray's own start gave up"):
            lane.result("lane-always", timeout_s=60)
        here = threading.current_thread().name
        lane_try = ("rtnb-suite-background", _background.LANE_NICE)
        again_try = ("rtnb-suite-background-again", _background.AGAIN_NICE)
        assert tries["raises"] == [lane_try, again_try], "the second try is the lane's own"
        assert tries["rejected"] == [lane_try, again_try]
        assert tries["always"] == [lane_try, again_try, (here, os.getpriority(os.PRIO_PROCESS, 0))]
        again = lane.ran_again()
        assert again["lane-raises"] == ["RuntimeError: raises: Ray's own start gave up"]
        assert again["lane-rejected"] == ["its start gave up"]
        assert len(again["lane-always"]) == 2, "run alone once, not until it passes"
    finally:
        lane.close()
        for key in ("lane-raises", "lane-rejected", "lane-always"):
            _background._registered.pop(key, None)
