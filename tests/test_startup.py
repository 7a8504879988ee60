"""What rtnb keeps out of start-up: jsonschema's IRI grammar, built only if used."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rtnb.core._startup import LAZY_IMPORTS_PATH, with_lazy_imports

PROBE = r"""
import json, sys, time
started = time.perf_counter()
import ray  # imports jsonschema, which imports rfc3987_syntax when installed
import_s = time.perf_counter() - started
stand_in = sys.modules["rfc3987_syntax"].__file__
from jsonschema import FormatChecker
checker = FormatChecker()
ok = [checker.conforms("http://example.com/ä", "iri"), checker.conforms("http://exa mple", "iri")]
print(json.dumps({"stand_in": stand_in, "real": sys.modules["rfc3987_syntax"].__file__,
                  "ok": ok, "import_s": import_s}))
"""


def test_ray_processes_import_the_iri_grammar_only_when_an_iri_is_validated():
    pytest.importorskip("rfc3987_syntax")  # the package whose import costs seconds
    env = {**os.environ, "PYTHONPATH": with_lazy_imports(os.environ.get("PYTHONPATH"))}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["stand_in"].startswith(LAZY_IMPORTS_PATH), "import ray found the stand-in"
    assert not seen["real"].startswith(LAZY_IMPORTS_PATH), "first use loaded the real module"
    assert seen["ok"] == [True, False], "IRI validation behaves as without rtnb"


def test_the_users_pythonpath_is_kept_after_the_stand_ins():
    joined = with_lazy_imports(os.pathsep.join(["/a", LAZY_IMPORTS_PATH, "/b"]))
    assert joined.split(os.pathsep) == [LAZY_IMPORTS_PATH, "/a", "/b"]
    assert with_lazy_imports(None) == LAZY_IMPORTS_PATH
