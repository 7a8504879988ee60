"""A Ray Data cell on the default path of a 2-core laptop, against Ray Train's
``TorchTrainer(datasets=...)`` on the same machine: who finishes, and when.

The pipeline (both sides): ``ray.data.range(ROWS, override_num_blocks=20)`` with a
row ``map``, split over 2 ranks by Ray Train's ``DataConfig``; each rank reads its
shard once with ``iter_rows()``.

rtnb: a real kernel as a user has it (no ``RAY_ADDRESS``; the warm Ray in a fresh
``RTNB_HOME`` at this machine's CPU count; a plain ``%rtnb start``), then the cell
``%%rtrain --datasets train=ds``. Ray Train, tuned alike: ``ray.init(num_cpus=3)``
(the one CPU rtnb keeps for Ray Data), Ray Train's settings from ``peers.py``, and
rtnb's lazy stand-in for jsonschema's IRI grammar on its processes' path (as rtnb's
Ray has it; see the README's *Cold start*).

Both clocks start at the same moment, in two rows:
  * **from nothing**: after the imports (``ray`` on both sides), before any Ray or
    group starts: rtnb's ``%rtnb start`` + the cell; the peer's ``ray.init`` +
    ``fit()``. Every row read on every rank ends it. This is the judged ratio.
  * **groups up**: rtnb's cell from its submission on a running group (the split
    and hand-over of the datasets included); the peer's training loop from its
    first line (its workers up, its split made before the loop) to its last row.
    TorchTrainer has no group that outlives a fit, so its side is the loop alone.

A third row, not in the ratio: Ray Train as on this laptop, ``ray.init()`` (2
CPUs) and ``ScalingConfig(num_workers=2)`` (1 CPU a worker, its default): Ray
Data's tasks never get a CPU; the fit is ended after ``--peer-timeout`` s and
reported as not finished.

Each side runs in a fresh process, alternating, ``--rounds`` times.

    .venv/bin/python benchmarks/data_start.py [--rounds 3] [--rows 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

READ = """
import time as _t, rtnb as _r
_first = None
_n = 0
_began = _t.time()
for _row in _r.get_dataset_shard("train").iter_rows():
    if _first is None:
        _first = _t.time()
    _n += 1
_res = (_n, _began, _first, _t.time())
"""

PEER = r"""
import json, os, sys, tempfile, time
import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

cpus, rows = int(sys.argv[1]), int(sys.argv[2])
print("ZERO", time.time(), flush=True)  # imported; no Ray started yet
ray.init(num_cpus=cpus, object_store_memory=300_000_000, include_dashboard=False,
         log_to_driver=False, logging_level="ERROR")
ds = ray.data.range(rows, override_num_blocks=20).map(lambda r: {"id": r["id"] * 2})

out = tempfile.mkdtemp()

def loop(config):
    began, first, n = time.time(), None, 0
    for _row in ray.train.get_dataset_shard("train").iter_rows():
        if first is None:
            first = time.time()
        n += 1
    # Ray Train keeps only a checkpoint's metrics in its Result: the timings go to files.
    rank = ray.train.get_context().get_world_rank()
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
        json.dump({"rows": n, "began": began, "first": first, "end": time.time()}, f)

trainer = TorchTrainer(loop, train_loop_config={"out": out}, datasets={"train": ds},
                       scaling_config=ScalingConfig(num_workers=2),
                       run_config=RunConfig(storage_path=tempfile.mkdtemp()))
print("FIT", time.time(), flush=True)
trainer.fit()
fit_end = time.time()
ranks = [json.load(open(os.path.join(out, name))) for name in sorted(os.listdir(out))]
print("RESULT " + json.dumps({
    "fit_end": fit_end, "rows": sum(r["rows"] for r in ranks),
    "began": min(r["began"] for r in ranks), "first": min(r["first"] for r in ranks),
    "end": max(r["end"] for r in ranks),
}), flush=True)
"""


def rtnb_round(rows: int) -> dict:
    from cold_start import _execute, _texts
    from jupyter_client.manager import KernelManager

    home = tempfile.mkdtemp(prefix="rtnb-home-")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RTNB_WARM_RAY")}
    env.update(RTNB_HOME=home, RTNB_WARM_RAY_IDLE_S="2")
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(cwd=tempfile.mkdtemp(prefix="rtnb-data-"), env=env)
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=120)
        _execute(client, "%load_ext rtnb\nimport ray, ray.data")
        zero = time.time()  # imported, as the peer's clock starts; no Ray started yet
        _execute(client, "%rtnb start")
        _execute(
            client,
            f"ds = ray.data.range({rows}, override_num_blocks=20)"
            ".map(lambda r: {'id': r['id'] * 2})",
        )
        submitted = time.time()
        cell_s, messages = _execute(client, "%%rtrain --datasets train=ds\n" + READ)
        ended = time.time()
        _, pulled = _execute(
            client, "import json\n_v = %rtnb pull _res\nprint(json.dumps(list(_v)))"
        )
        shown = _texts(messages)
        lines = [x for x in _texts(pulled).splitlines() if x.startswith("[[")]
        if not lines:
            raise SystemExit(f"rtnb's cell failed:\n{shown}\n{_texts(pulled)}")
        per_rank = json.loads(lines[-1])
        _execute(client, "%rtnb stop")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)
    assert sum(r[0] for r in per_rank) == rows, (per_rank, shown)
    return {
        "first_row_s": min(r[2] for r in per_rank) - submitted,
        "groups_up_s": cell_s,
        "from_nothing_s": ended - zero,
    }


def peer_round(cpus: int, rows: int, timeout_s: float) -> dict:
    from peers import ray_train_env

    from rtnb.core._startup import with_lazy_imports

    # Tuned alike: Ray's processes skip jsonschema's IRI grammar build, as rtnb's do.
    env = {
        **os.environ,
        **ray_train_env(),
        "RAY_DEDUP_LOGS": "0",
        "PYTHONPATH": with_lazy_imports(os.environ.get("PYTHONPATH")),
    }
    env.pop("RAY_ADDRESS", None)
    started = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-c", PEER, str(cpus), str(rows)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        return {"finished": False, "waited_s": time.time() - started}
    fit = next((float(x.split()[1]) for x in out.splitlines() if x.startswith("FIT ")), None)
    zero = next((float(x.split()[1]) for x in out.splitlines() if x.startswith("ZERO ")), None)
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    if fit is None or zero is None or line is None:
        raise SystemExit(f"the TorchTrainer run failed:\n{out[-2000:]}\n{err[-3000:]}")
    m = json.loads(line[len("RESULT ") :])
    assert m["rows"] == rows, m
    return {
        "finished": True,
        "first_row_s": m["first"] - fit,
        "groups_up_s": m["end"] - m["began"],
        "from_nothing_s": m["fit_end"] - zero,
    }


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--peer-timeout", type=float, default=90.0)
    parser.add_argument("--quick", action="store_true", help="no laptop-default TorchTrainer row")
    args = parser.parse_args()
    from _common import emit, in_order

    cpus = os.cpu_count() or 1
    rtnb_runs, tuned_runs = [], []
    for _ in range(args.rounds):
        for side in in_order("rtnb", "peer"):
            if side == "rtnb":
                rtnb_runs.append(rtnb_round(args.rows))
            else:
                tuned_runs.append(peer_round(cpus + 1, args.rows, args.peer_timeout * 3))
    failed = [r for r in tuned_runs if not r["finished"]]
    tuned_runs = [r for r in tuned_runs if r["finished"]]
    if not tuned_runs:
        # A peer that did not finish is a failed round, never a time of its.
        why = f"the tuned TorchTrainer did not finish within {args.peer_timeout * 3:.0f} s"
        print(why)
        emit(
            peer_failed={"total_ratio": why, "groups_up_ratio": why},
            rtnb_cell_s=statistics.median(r["groups_up_s"] for r in rtnb_runs),
        )
        return
    if failed:
        print(f"the tuned TorchTrainer did not finish in {len(failed)} of {args.rounds} rounds")
    laptop = None if args.quick else peer_round(cpus, args.rows, args.peer_timeout)
    print(
        f"Ray Data cell start, {args.rows} rows on 2 ranks, {cpus}-CPU machine, "
        f"{args.rounds} rounds (min / median / max, seconds)"
    )
    print(f"{'':44} {'from nothing':>20} {'groups up':>20} {'first row (cell/fit)':>20}")
    for name, runs in (
        ("rtnb, default path (%%rtrain --datasets)", rtnb_runs),
        (f"TorchTrainer, ray.init(num_cpus={cpus + 1}) (tuned)", tuned_runs),
    ):
        print(
            f"{name:44} {_spread([r['from_nothing_s'] for r in runs]):>20} "
            f"{_spread([r['groups_up_s'] for r in runs]):>20} "
            f"{_spread([r['first_row_s'] for r in runs]):>20}"
        )
    print(
        "  from nothing: imports done, no Ray yet -> every row read (rtnb: %rtnb start + the "
        "cell; TorchTrainer: ray.init + fit)\n"
        "  groups up: rtnb's cell on its running group (split included) / TorchTrainer's "
        "loop from its first line (workers up, split made)"
    )
    if laptop is not None:
        verdict = (
            f"did not finish: no row read after {laptop['waited_s']:.0f} s (ended)"
            if not laptop["finished"]
            else f"finished in {laptop['total_s']:.2f} s"
        )
        print(f"{f'TorchTrainer, ray.init() ({cpus} CPUs, laptop)':44} {verdict}")

    def median(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    ratio = median(tuned_runs, "from_nothing_s") / median(rtnb_runs, "from_nothing_s")
    up = median(tuned_runs, "groups_up_s") / median(rtnb_runs, "groups_up_s")
    print(f"ratio from nothing (TorchTrainer tuned / rtnb): {ratio:.2f}x")
    print(f"ratio groups up (TorchTrainer's loop / rtnb's cell): {up:.2f}x")
    emit(
        total_ratio=ratio,
        groups_up_ratio=up,
        rtnb_cell_s=median(rtnb_runs, "groups_up_s"),
    )


if __name__ == "__main__":
    main()
