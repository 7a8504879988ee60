"""The bad-input corpus: each mistake a user can make is answered by one line that
says what was wrong and what to do; no traceback from rtnb's internals, nothing left
holding CPUs, nothing committed lost.

Four tables, one per way in: magics in a real kernel, the `rtnb` command line,
`Session(...)` arguments and cell contents on a real group.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import nbformat
import pytest

import rtnb
from tests._kernel import new_notebook, one_line_error

RTNB = [sys.executable, "-m", "rtnb.batch.cli"]
# Where a GPU is, `--gpu` starts a group rather than failing (GPU tests cover it).
_HAS_GPU = __import__("torch").cuda.is_available()

# ---- %rtnb / %%rtrain / %rtrain in a kernel ----------------------------------------------
BEFORE_START = [
    ("%rtnb", "needs a subcommand"),
    ("%rtnb launch", "no subcommand 'launch'"),
    ("%rtnb strat", "did you mean"),
    ("%rtnb start --bogus 1", "unrecognized arguments: --bogus"),
    ("%rtnb start --workers 3-2", "MIN is more than MAX"),
    ("%rtnb start --workers 0-2", "an elastic group has at least 1 rank"),
    ("%rtnb start --workers two", "--workers 'two' is not a number of ranks"),
    ("%rtnb start --workers 0 --gpu", "torch sees none here"),
    ("%rtnb start --strategy DIAGONAL", "--strategy 'DIAGONAL' is not one of"),
    ("%rtnb start --backend mpi", "--backend 'mpi' is not one of"),
    ("%rtnb start --backend nccl", "needs GPUs"),
    *([] if _HAS_GPU else [("%rtnb start --gpu", "--gpu needs one GPU per worker (2)")]),
    ("%rtnb start --address nohost", "is not 'auto', HOST:PORT"),
    ("%rtnb start --address 127.0.0.1:1", "cannot reach a Ray cluster at 127.0.0.1:1"),
    ("%rtnb start --name ../x", "must start with a letter or digit"),
    ("%rtnb start --max-failures -1", "--max-failures must be ≥ 0"),
    ("%rtnb start --keep 0", "--keep must be ≥ 1"),
    ("%rtnb start --mode up", "--mode must be 'min' or 'max'"),
    ("%rtnb start --stop-grace 0", "--stop-grace must be > 0"),
    ("%rtnb start --cpus-per-worker -1", "--cpus-per-worker must be ≥ 0"),
    ("%rtnb start --workers 200", "need 200 CPUs"),
    ("%rtnb start --listen nowhere", "--listen 'nowhere' is not an IP address"),
    ("%rtnb start --replay", "--replay rebuilds a run from its journal"),
    ("%rtnb start --storage /proc/nowhere", "is not writable"),
    ("%rtnb start --storage nosuch://bucket/x", "is not a path or URI rtnb can use"),
    (
        "%rtnb start --mlflow http://mlflow:s3cret@127.0.0.1:9",
        "MLflow at http://***@127.0.0.1:9 cannot be used (nothing answers there)",
    ),
    ("%%rtrain\nx = 1", "run `%rtnb start` first"),
    ("%rtrain x = 1", "run `%rtnb start` first"),
    ("%rtnb status", "run `%rtnb start` first"),
    ("%rtnb wait", "run `%rtnb start` first"),
    ("%rtnb pull x", "run `%rtnb start` first"),
    ("%rtnb export train.py", "%rtnb export needs a run"),
    ("%rtnb import train.py", "run `%rtnb start` first"),
]
AFTER_START = [
    ("%rtnb start", "already running"),
    ("%rtrain --ranks 9 x = 1", "the group has ranks 0-1"),
    ("%rtrain --ranks x 1", "is not a list like 0,1"),
    ("%rtrain --timeout -1 1", "--timeout must be > 0"),
    ("%rtrain --steps 0 1", "--steps must be ≥ 1"),
    ("%rtrain", "%rtrain needs a statement"),
    ("%%rtrain\nx = (", "SyntaxError and was not sent to the ranks"),
    ("%rtnb pull 1x", "is not a Python variable name"),
    ("%rtnb pull never_defined", "'never_defined' is not defined on ranks 0, 1"),
    ("%rtnb push not_in_notebook", "'not_in_notebook' is not defined in the notebook"),
    ("import threading\nlock = threading.Lock()\n%rtnb push lock", "not picklable"),
    ("%rtnb load ../../etc", "is not a checkpoint id"),
    ("%rtnb load step-999", "no committed checkpoint 'step-000000999'"),
    ("%rtnb resume latest", "no committed checkpoint yet"),
    ("%rtnb checkpoints ../../d", "--run '../../d' must start with a letter"),
    ("%rtnb datasets train=never_made", "'never_made' is not defined in the notebook"),
    ("rows = [1, 2]\n%rtnb datasets train=rows", "dataset 'train' is a list, not a Ray Dataset"),
    ("%%rtrain --datasets train-ds\n1", "--datasets takes NAME=VAR pairs"),
    ("%%rtrain --split train\n1", "--split goes with datasets"),
    (
        "import ray\nnums = ray.data.range(4)\n%rtnb datasets train=nums --split val",
        "names 'val', which was not passed",
    ),
    ("%rtnb scale 3-1", "MIN is more than MAX"),
    ("%rtnb scale", "only an elastic group grows by itself"),
    ("%rtnb export train.txt", "name it FILE.py"),
    ("%rtnb export train.py", "has no cell that ran to its end"),
    ("%rtnb import no_such_script.py", "cannot read"),
    ("%rtnb scale 500", "need 500 CPUs"),
    ("%rtnb wait", "no background cell was started"),
    ("%rtnb status now", "takes no arguments"),
    ("%rtnb restart --hard", "unrecognized arguments: --hard"),
]


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _mistakes(kernel, table) -> list[tuple[str, str]]:
    """The entries of ``table`` not answered by their one expected line."""
    failures = []
    for code, expected in table:
        try:
            shown = one_line_error(kernel.execute(code))
        except AssertionError as exc:
            failures.append((code, str(exc)))
            continue
        # a SyntaxError shows the offending line and its caret under the one line
        one = len(_lines(shown)) == 1 or "SyntaxError" in shown
        if expected not in shown or not one:
            failures.append((code, shown))
    return failures


@pytest.mark.ray
@pytest.mark.slow
def test_magic_mistakes_get_one_clear_line(kernel):
    failures = _mistakes(kernel, BEFORE_START)
    run = kernel.execute("%rtnb start --stop-grace 1")
    assert run.status == "ok", "\n".join(f"{c!r}: {s[:300]}" for c, s in failures)
    failures += _mistakes(kernel, AFTER_START)
    assert not failures, "\n\n".join(f"{c!r}:\n{s}" for c, s in failures)
    # A notebook variable (a papermill parameter) used in a cell: the failure says how
    # to send it; a name the notebook does not have either gets no such line.
    assert kernel.execute("steps = 25").status == "ok"
    shown = "\n".join(kernel.execute("%%rtrain\nfor i in range(steps): pass").traceback)
    assert "NameError: name 'steps' is not defined" in shown, shown
    assert "`steps` is a variable of this notebook, not of the ranks: send it with " in shown
    assert "`%rtnb push steps` before this cell" in shown, shown
    # ... and the line's fix works.
    assert kernel.execute("%rtnb push steps").status == "ok"
    assert kernel.execute("%%rtrain\nfor i in range(steps): pass").status == "ok"
    shown = "\n".join(kernel.execute("%%rtrain\nnowhere_defined + 1").traceback)
    assert "NameError" in shown and "%rtnb push" not in shown, shown
    # The other way round: a plain cell reading a name only the ranks have is told
    # how to bring it over; a name nobody defined gets no such note.
    assert kernel.execute("%rtrain on_ranks_only = 7").status == "ok"
    shown = "\n".join(kernel.execute("print(on_ranks_only)").traceback)
    assert "NameError" in shown, shown
    assert "`on_ranks_only = %rtnb pull on_ranks_only` brings each rank's value" in shown, shown
    shown = "\n".join(kernel.execute("print(nowhere_at_all)").traceback)
    assert "NameError" in shown and "%rtnb pull" not in shown, shown
    # nothing above broke the group, and the refused scale kept the ranks' state
    assert kernel.execute("%rtrain kept = 5").status == "ok"
    assert "[5, 5]" in kernel.execute("%rtnb pull kept").results[-1]["text/plain"]
    # A start naming another cluster after a stop goes there, not to the Ray this
    # kernel joined before (as after the failed `--gpu` start above).
    assert kernel.execute("%rtnb stop").status == "ok"
    shown = one_line_error(kernel.execute("%rtnb start --address 127.0.0.1:1"))
    assert "cannot reach a Ray cluster at 127.0.0.1:1" in shown, shown


# ---- the command line ----------------------------------------------------------------------
def _notebooks(tmp_path) -> dict[str, str]:
    plain = tmp_path / "plain.ipynb"
    nbformat.write(new_notebook(["x = 1"]), plain)
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "broken.ipynb").write_text("{not json")
    (tmp_path / "empty.ipynb").write_text("")
    (tmp_path / "nocells.ipynb").write_text(json.dumps({"metadata": {}}))
    dies = new_notebook(["x = 1"])
    dies.metadata["kernelspec"] = {
        "name": "rtnb-dies",
        "display_name": "dies",
        "language": "python",
    }
    nbformat.write(dies, tmp_path / "dies.ipynb")
    return {p.stem: str(p) for p in tmp_path.iterdir()}


CLI = [
    ([], "the following arguments are required: command"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["run"], "the following arguments are required: notebook"),
    (["run", "nope.ipynb"], "does not exist"),
    (["run", "{notes}"], "is not a .ipynb notebook"),
    (["run", "{broken}"], "not valid JSON"),
    (["run", "{empty}"], "not valid JSON"),
    (["run", "{nocells}"], "it has no list of cells"),
    (["run", "{plain}", "-p", "x", "1"], "has no cell tagged 'parameters'"),
    (["run", "{plain}", "-p", "1x", "1"], "is not a Python identifier"),
    (["run", "{plain}", "-p", "db_password", "x"], "looks like a secret"),
    (["run", "{plain}", "--timeout", "-5"], "--timeout must be a positive number"),
    (["run", "{plain}", "--timeout", "abc"], "invalid float value: 'abc'"),
    (["run", "{plain}", "--kernel", "julia-9"], "kernel 'julia-9', which is not installed"),
    (
        ["run", "{plain}", "--storage-file", "/nonexistent/f"],
        "--storage-file '/nonexistent/f' cannot be read",
    ),
    (["checkpoints", "../x"], "RUN '../x' must start with a letter"),
    (["checkpoints", "nope", "--storage", "{tmp}"], "no run 'nope'"),
    (["runs", "nosuch://x"], "is not a path or URI rtnb can use"),
    (["submit", "{plain}", "--address", "ftp://x"], "is not a Ray dashboard URL"),
    (["submit", "{plain}", "--address", "http://127.0.0.1:1"], "no Ray dashboard answers"),
    (["submit", "nope.ipynb", "--address", "http://127.0.0.1:1"], "does not exist"),
    (
        ["submit", "{plain}", "--address", "http://127.0.0.1:1", "-p", "api_token", "x"],
        "looks like a secret",
    ),
    (["logs"], "the following arguments are required: job"),
]


@pytest.mark.slow
def test_command_line_mistakes_get_one_clear_line(tmp_path):
    names = {**_notebooks(tmp_path), "tmp": str(tmp_path)}

    def answer(case):
        argv = [a.format(**names) for a in case[0]]
        proc = subprocess.run(
            RTNB + argv, capture_output=True, text=True, cwd=tmp_path, timeout=120
        )
        return argv, case[1], proc

    failures = []
    # Two at a time: each is a Python start waiting on imports (one core apiece).
    with ThreadPoolExecutor(max_workers=2) as pool:
        for argv, expected, proc in pool.map(answer, CLI):
            lines = _lines(proc.stderr)
            if proc.returncode != 2 or expected not in proc.stderr or len(lines) != 1:
                failures.append((argv, proc.returncode, proc.stderr))
    assert not failures, "\n\n".join(f"{a} → exit {c}:\n{e}" for a, c, e in failures)


@pytest.mark.ray
@pytest.mark.slow
def test_a_kernel_that_dies_on_start_is_one_line(ray_cluster, tmp_path):
    spec = tmp_path / "kernels" / "rtnb-dies"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-c", "import sys; sys.exit(3)", "{connection_file}"],
                "display_name": "dies",
                "language": "python",
            }
        )
    )
    names = _notebooks(tmp_path)
    env = {**__import__("os").environ, "JUPYTER_PATH": str(tmp_path)}
    proc = subprocess.run(
        [*RTNB, "run", names["dies"]],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=180,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "the kernel died" in proc.stderr.lower() or "kernel died" in proc.stderr.lower(), (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr


# ---- Session(...) arguments ------------------------------------------------------------------
SESSION = [
    (dict(workers=-1), rtnb.ConfigError, "--workers must be a whole number"),
    (dict(workers=2.5), rtnb.ConfigError, "--workers must be a whole number"),
    (dict(workers=(3, 2)), rtnb.ConfigError, "MIN is more than MAX"),
    (dict(workers=(0, 2)), rtnb.ConfigError, "an elastic group has at least 1 rank"),
    (dict(bogus=1), rtnb.ConfigError, "unknown Session option"),
    (dict(cpus_per_worker=-1), rtnb.ConfigError, "--cpus-per-worker must be ≥ 0"),
    (dict(strategy="ROUND"), rtnb.ConfigError, "--strategy 'ROUND'"),
    (dict(address="ray://"), rtnb.ConfigError, "is not 'auto', HOST:PORT"),
    (dict(address="10.0.0.1:port"), rtnb.ConfigError, "is not 'auto', HOST:PORT"),
    (dict(storage="nosuch://bucket/x"), rtnb.ConfigError, "is not a path or URI rtnb can use"),
    (dict(name="a/b"), rtnb.ConfigError, "must start with a letter or digit"),
    (dict(name="x" * 200), rtnb.ConfigError, "must start with a letter or digit"),
    # a `$` anchor would accept the newline at the end
    (dict(name="run\n"), rtnb.ConfigError, "contains a control character"),
    (dict(name="run\x1b[2J"), rtnb.ConfigError, "contains a control character"),
    (dict(name="run\u2028"), rtnb.ConfigError, "must start with a letter or digit"),
    (dict(env={"A": 1}), rtnb.ConfigError, "env values must be strings"),
    (dict(env=["A"]), rtnb.ConfigError, "env must be a dict"),
    (
        dict(listen="0.0.0.0", address="auto"),
        rtnb.ConfigError,
        "--listen sets where an embedded Ray",
    ),
    (dict(replay=True), rtnb.ConfigError, "--replay rebuilds a run"),
]


@pytest.mark.parametrize("kwargs, error, expected", SESSION, ids=[str(s[0]) for s in SESSION])
def test_session_argument_mistakes_get_one_line(kwargs, error, expected, tmp_path):
    kwargs = {"storage": str(tmp_path), **kwargs}
    with pytest.raises(error) as info:
        rtnb.Session(**kwargs)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_credentials_in_a_storage_query_are_never_echoed(tmp_path):
    secrets = {
        "X-Amz-Signature": "sig-9f2c",
        "X-Amz-Credential": "cred-AKIA77",
        "token": "tok-5521",
        "secret_key": "sk-0193",
        "session_token": "st-4471",
        "sig": "azure-8d1e",
    }
    query = "&".join(f"{k}={v}" for k, v in secrets.items())
    with pytest.raises(rtnb.ConfigError) as info:
        rtnb.Session(storage=f"s3://bucket/runs?endpoint_override=127.0.0.1:1&{query}")
    said = str(info.value)
    assert "is not a path or URI rtnb can use" in said and "\n" not in said
    for value in secrets.values():
        assert value not in said, said
    from rtnb.core._redact import redact_text

    presigned = f"failed to GET https://b.s3.amazonaws.com/k?{query}&X-Amz-Expires=60"
    shown = redact_text(presigned)
    assert all(value not in shown for value in secrets.values()), shown
    assert "X-Amz-Expires=60" in shown, "what is not a secret stays readable"


def test_an_embedded_session_too_big_for_this_machine_fails_before_ray_starts(tmp_path):
    # A fresh process with no cluster to join: what `%rtnb start` does on a laptop.
    import os

    probe = (
        "import sys, time, rtnb\n"
        "session = rtnb.Session(workers=64, storage=sys.argv[1])\n"
        "started = time.monotonic()\n"
        "try:\n    session.start()\nexcept rtnb.ClusterError as exc:\n    print('ERROR', exc)\n"
        "print('SECONDS', time.monotonic() - started)\n"
        "ray = sys.modules.get('ray')\n"
        "print('RAY', bool(ray and ray.is_initialized()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    out = proc.stdout
    assert f"need 64 CPUs, but this machine has {os.cpu_count()}" in out, out + proc.stderr
    assert float(out.split("SECONDS ")[1].split()[0]) < 2, "checked before Ray starts"
    assert "RAY False" in out, "no embedded Ray left running"


# ---- cell contents on a real group -------------------------------------------------------
@pytest.mark.ray
@pytest.mark.slow
def test_cell_content_mistakes_are_one_line_and_the_group_comes_back(group):
    value = group.run("import threading\nthreading.Lock()")
    assert "lock" in repr(value[0]), "an unpicklable value comes back as its repr"
    value = group.run("b'x' * 80_000_000")
    assert "too large to send back" in repr(value[0]) and len(repr(value[0])) < 500
    with pytest.raises(rtnb.ConfigError, match="takes code \\(str\\) or a function"):
        group.run(42)
    with pytest.raises(rtnb.CellError, match="SystemExit: 3") as info:
        group.run("import sys\nsys.exit(3)")
    assert "\n" not in str(info.value)
    group.run("kept = 'still here'")
    assert group.pull("kept") == ["still here"] * 2, "sys.exit leaves the rank alive"
    for deadly in (
        "import os, torch.distributed as dist\nif dist.get_rank() == 1:\n    os._exit(1)\nimport time; time.sleep(5)",
        "import ctypes, torch.distributed as dist\nif dist.get_rank() == 0:\n    ctypes.string_at(0)\nimport time; time.sleep(5)",
    ):
        with pytest.raises(rtnb.WorkerGroupError, match="died during cell") as info:
            group.run(deadly, output=lambda *a: None)
        assert "\n" not in str(info.value)
        assert group.run("1") == {0: 1, 1: 1}, "the group was rebuilt and works"
    with pytest.raises(rtnb.SessionError, match="still running after 0.3 s") as info:
        group.run_background("import time\ntime.sleep(3)").wait(0.3)
    assert isinstance(info.value, TimeoutError)
    group.wait(30)
