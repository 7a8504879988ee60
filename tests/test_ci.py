"""CI cannot go green without the tools the browser, S3 and TensorBoard tests need."""

from __future__ import annotations

import os
import subprocess
import sys

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


def test_the_setup_script_stops_on_a_failed_install():
    text = (REPO / ".ci" / "setup").read_text()
    assert "|| true" not in text.split("pip_install()")[0], "no swallowed failure before the helper"
    assert 'echo "setup failed: pip install $*" >&2' in text and "exit 1" in text


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
