"""CI cannot go green without the tools the browser, S3 and TensorBoard tests need."""

from __future__ import annotations

import os
import subprocess

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
