"""Sweeps: Ray Tune decides, each trial trains on a group reused from the last trial.

Real local Ray, real Tune schedulers and search spaces, real checkpoints in storage."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

import rtnb
from rtnb.driver.tuning._sweep import on_sweep_start
from rtnb.storage._checkpoints import CheckpointStore
from rtnb.storage._result import list_runs, read_run_metrics
from tests.conftest import wait_for_free_cpus

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# A trial: minimise (w - 3)^2 with SGD at the trial's lr, a checkpoint every 5 steps,
# each rank's loss a little different (so "the mean over ranks" is checked, not rank 0).
TRIAL = """
import os, tempfile, time, torch, rtnb
ctx = rtnb.get_context()
w = torch.zeros(1, requires_grad=True)
start = 0
ckpt = rtnb.get_checkpoint()
if ckpt is not None:
    with ckpt.as_directory() as folder:
        state = torch.load(os.path.join(folder, "w.pt"))
    w.data[:] = state["w"]
    start = state["step"] + 1
opt = torch.optim.SGD([w], lr=lr)
for step in range(start, steps):
    loss = (w - 3.0).pow(2).sum() * (1 + 0.01 * ctx.world_rank)
    opt.zero_grad()
    loss.backward()
    opt.step()
    checkpoint = None
    if step % 5 == 4:
        folder = tempfile.mkdtemp()
        torch.save({"w": w.detach().clone(), "step": step}, os.path.join(folder, "w.pt"))
        checkpoint = rtnb.Checkpoint.from_directory(folder)
    rtnb.report({"loss": loss.item()}, checkpoint=checkpoint)
    time.sleep(pause)
float(w.item())
"""


def _means(storage: str, run: str) -> list[float]:
    """The run's loss per step, averaged over its ranks, from its metrics record."""
    per_step: dict[int, list[float]] = {}
    for row in read_run_metrics(storage, run):
        if "loss" in row and row["loss"] is not None:
            per_step.setdefault(int(row["step"]), []).append(float(row["loss"]))
    return [sum(v) / len(v) for _step, v in sorted(per_step.items()) if len(v) == 2]


def test_an_asha_sweep_reuses_groups_stops_trials_early_and_its_best_resumes_in_the_notebook(
    ray_cluster, tmp_path
):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    storage = str(tmp_path)
    with rtnb.Session(
        workers=2, cpus_per_worker=0.5, storage=storage, name="notebook", stop_grace_s=1.0
    ) as notebook:
        notebook.run("x = 41")
        sweep = rtnb.sweep(
            TRIAL,
            {"lr": tune.grid_search([0.3, 0.1, 0.001, 0.0003]), "steps": 20, "pause": 0.05},
            metric="loss",
            mode="min",
            scheduler=ASHAScheduler(max_t=20, grace_period=2, reduction_factor=2),
            max_concurrent_trials=2,
            workers=2,
            cpus_per_worker=0.5,
            storage=storage,
            name="lr-sweep",
            background=True,
        )
        # The notebook's own group keeps working beside the sweep.
        assert dict(notebook.run("x + 1")) == {0: 42, 1: 42}
        sweep.wait(240)
        trials = sweep.trials
        assert len(trials) == 4
        assert all(t.state.ended for t in trials)
        stopped = [t for t in trials if t.state is rtnb.TrialState.STOPPED]
        assert stopped, [(t.config["lr"], t.state, t.iterations) for t in trials]
        assert all(t.stopped_at is not None and t.stopped_at < 20 for t in stopped)
        fastest = next(t for t in trials if t.config["lr"] == 0.3)
        assert fastest.state is rtnb.TrialState.TERMINATED, "the best learner runs to its end"
        # Four trials on at most two groups: a trial after the first two paid no start.
        assert sweep.groups_started <= 2
        for t in trials:
            # What the scheduler saw is the ranks' mean per step, as recorded in the run.
            recorded = _means(storage, t.run_name)
            assert t.values == pytest.approx(recorded[: len(t.values)])
            assert t.iterations >= (t.stopped_at or 20)
        names = {r.name for r in list_runs(storage).runs}
        assert {t.run_name for t in trials} <= names, "each trial is a run in storage"
        assert (tmp_path / "lr-sweep" / "sweep.json").exists()
        best = sweep.best_trial()
        assert best.config["lr"] == 0.3
        assert sweep.best_config == best.config
        frame = sweep.dataframe()
        assert list(frame["config/lr"]) == [0.3, 0.1, 0.001, 0.0003]

        checkpoint, info = sweep.best_checkpoint, sweep.checkpoint_info(best)
        assert checkpoint is not None and checkpoint.id == info.id
        # One call: the best trial's config and checkpoint carry on in the notebook's group.
        value = sweep.resume_trial(notebook)
        resumed = notebook.run("(lr, rtnb.get_config()['lr'], rtnb.get_checkpoint().id, start, x)")
        for rank in (0, 1):
            lr, config_lr, cid, start, x = resumed[rank]
            assert lr == config_lr == 0.3
            assert cid == checkpoint.id and start == info.step + 1 > 0
            assert x == 41, "the notebook's own variables are kept"
        assert value[0] == pytest.approx(3.0, abs=1e-3)
    assert wait_for_free_cpus(4.0) >= 4.0, "every group of the sweep and the notebook is freed"


def test_interrupting_a_sweep_stops_every_trial_at_a_step_and_frees_every_cpu(
    ray_cluster, tmp_path
):
    from ray import tune

    storage = str(tmp_path)
    started = threading.Event()
    trials_seen: list = []

    def interrupt_once_reports_flow(event) -> None:
        if str(event.kind) != "result" or started.is_set():
            return
        # Both trials past a checkpoint (every 5 steps), mid-training.
        if sum(t.iterations >= 8 for t in trials_seen[0].trials) == 2:
            started.set()
            # Ctrl-C in the thread that waits, as the kernel's interrupt does.
            os.kill(os.getpid(), signal.SIGINT)

    unwatch = on_sweep_start(
        lambda s: (trials_seen.append(s), s.subscribe(interrupt_once_reports_flow))
    )
    try:
        with pytest.raises(rtnb.CellInterrupted, match="interrupted"):
            # Trials long enough (60 s) that the first cannot end before the second's
            # group has started on a busy machine: the interrupt, at both trials' 8th
            # step, ends them well before that. (At 8 s, a slow second start let the
            # third trial begin and the interrupt never came: "DID NOT RAISE".)
            rtnb.sweep(
                TRIAL,
                {"lr": tune.uniform(0.01, 0.1), "steps": 3000, "pause": 0.02},
                metric="loss",
                mode="min",
                num_samples=3,
                max_concurrent_trials=2,
                workers=2,
                cpus_per_worker=0.5,
                storage=storage,
                name="stopped",
            )
    finally:
        unwatch()
    sweep = trials_seen[0]
    assert sweep.interrupted and sweep.done()
    trials = sweep.trials
    assert len(trials) == 2, "no trial starts once the sweep is interrupted"
    assert all(t.state is rtnb.TrialState.STOPPED for t in trials)
    for t in trials:
        committed = CheckpointStore.of_run(storage, t.run_name).list(include_incomplete=True)
        assert committed and all(c.status == "committed" for c in committed), (
            "what was committed is kept, nothing half-written is listed"
        )
    assert wait_for_free_cpus(4.0) >= 4.0, "no group is left holding CPUs"


def test_failed_trials_are_retried_per_failure_config_and_a_lost_rank_is_recovered(
    ray_cluster, tmp_path
):
    from ray import tune

    marks = tmp_path / "marks"
    marks.mkdir()

    def train(config):
        import os
        import time

        import rtnb

        rank = rtnb.get_context().get_world_rank()
        mark = os.path.join(config["marks"], f"{config['kind']}-{rank}")
        first = not os.path.exists(mark)
        open(mark, "a").close()
        # One rank raises, as one usually does: the others are stopped when it fails,
        # maybe before they reached their mark, so a mark of theirs says nothing.
        if config["kind"] == "flaky" and first:
            if rank == 0:
                raise RuntimeError("flaky the first time")
            # Still training when rank 0 fails: the stop asked for that failure ends
            # with this attempt and must not reach the retry's ranks.
            for _ in range(600):
                rtnb.report({"loss": 2.0})
                time.sleep(0.05)
        if config["kind"] == "broken":
            raise ValueError("broken every time")
        if config["kind"] == "dies" and first and rank == 1:
            os._exit(1)  # the rank's process is gone: the session rebuilds the group
        for step in range(5):
            rtnb.report({"loss": 1.0 / (step + 1)})
            if config["kind"] == "flaky":
                time.sleep(0.8)  # the retry outlasts a stop's grace (3 s)
        return rtnb.get_config()["kind"]

    sweep = rtnb.sweep(
        train,
        {"kind": tune.grid_search(["ok", "flaky", "broken", "dies"]), "marks": str(marks)},
        metric="loss",
        mode="min",
        failure_config=tune.FailureConfig(max_failures=1),
        max_concurrent_trials=2,
        workers=2,
        cpus_per_worker=0.5,
        storage=str(tmp_path / "runs"),
        name="failing",
    )
    by_kind = {t.config["kind"]: t for t in sweep.trials}
    assert by_kind["ok"].state is rtnb.TrialState.TERMINATED and by_kind["ok"].failures == 0
    assert by_kind["flaky"].state is rtnb.TrialState.TERMINATED, by_kind["flaky"].note
    assert by_kind["flaky"].failures == 1
    assert by_kind["broken"].state is rtnb.TrialState.ERROR
    assert "ValueError: broken every time" in by_kind["broken"].note
    assert by_kind["broken"].failures == 1
    assert by_kind["dies"].state is rtnb.TrialState.TERMINATED, by_kind["dies"].note
    assert by_kind["dies"].failures == 1, "a lost rank is one failure of the trial, retried"
    # The attempt rank 1 died in counts too (rank 0 reported it alone), then the rerun.
    losses = [1.0, 0.5, 1 / 3, 0.25, 0.2]
    assert by_kind["dies"].values[-5:] == pytest.approx(losses)
    assert by_kind["dies"].values[:-5] in ([], pytest.approx(losses))
    assert wait_for_free_cpus(4.0) >= 4.0


def test_bad_sweeps_are_refused_in_one_line_before_any_trial_starts(ray_cluster, tmp_path):
    import optuna
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, HyperBandScheduler

    storage = str(tmp_path)
    space = {"lr": tune.loguniform(1e-4, 1e-1)}
    code = "rtnb.report({'loss': lr})"
    cases = [
        (
            dict(train=code, param_space=[0.1, 0.01], metric="loss", mode="min"),
            "param_space must be a dict",
        ),
        (dict(train=code, param_space=space, mode="min"), "name the metric"),
        (dict(train=code, param_space=space, metric="loss", mode="down"), "mode is 'min' or 'max'"),
        (dict(train=code, param_space=space, metric="acc", mode="max"), "never reports 'acc'"),
        (dict(train="for x in", param_space=space, metric="loss", mode="min"), "SyntaxError"),
        (
            dict(
                train=code,
                param_space=space,
                metric="loss",
                mode="min",
                scheduler=HyperBandScheduler(),
            ),
            "pauses trials",
        ),
        (
            dict(train=code, param_space=space, metric="loss", mode="min", scheduler="hyperband"),
            "use 'asha', 'median', 'fifo'",
        ),
        (
            dict(train=code, param_space=space, metric="loss", mode="min", max_concurrent_trials=3),
            "need 6 CPUs, but the cluster has 4",
        ),
        (
            dict(train=code, param_space=space, metric="loss", mode="min", num_samples=0),
            "num_samples must be",
        ),
        (
            dict(
                train=code,
                param_space=space,
                metric="loss",
                mode="min",
                scheduler=ASHAScheduler(metric="loss", mode="max"),
            ),
            "AsyncHyperBandScheduler was made with mode='max'",
        ),
        (
            dict(
                train=code,
                param_space={"lr": optuna.distributions.FloatDistribution(1e-4, 0.1, log=True)},
                metric="loss",
                mode="min",
            ),
            "a sweep takes Ray Tune's search spaces",
        ),
    ]
    for kwargs, words in cases:
        with pytest.raises(rtnb.RtnbError) as caught:
            rtnb.sweep(**kwargs, storage=storage, workers=2, name="bad")
        assert words in str(caught.value), (kwargs, str(caught.value))
        assert "\n" not in str(caught.value).split("SyntaxError")[0]
    assert not list(Path(storage).iterdir()), "nothing was written: no trial started"
    assert wait_for_free_cpus(4.0) >= 4.0


def test_the_live_view_draws_every_trials_reports_in_a_real_kernel(ray_cluster, tmp_path):
    from tests._kernel import Kernel

    env = {**os.environ, "RTNB_LIVE": "1"}
    kernel = Kernel(cwd=str(tmp_path), env=env)
    try:
        setup = kernel.execute(
            "%load_ext rtnb\n"
            "from ray import tune\n"
            f"TRIAL = {TRIAL!r}\n"
            "space = {'lr': tune.grid_search([0.3, 0.01]), 'steps': 12, 'pause': 0.02}\n"
        )
        assert setup.status == "ok", setup.text + setup.evalue
        run = kernel.execute(
            "%%rtnb sweep space --metric loss --mode min --cpus-per-worker 0.5 "
            f"--storage {tmp_path} --name live\n" + TRIAL,
            timeout=180,
        )
        assert run.status == "ok", run.text + run.evalue + "".join(run.traceback)
        check = kernel.execute(
            "view = get_ipython().magics_manager.registry['RtnbMagics'].last_view\n"
            "sweep = _\n"
            "drawn = [list(t.y) for t in view.figure.data[:-1]]\n"
            "assert drawn == [t.values for t in sweep.trials], (drawn, sweep.trials)\n"
            "assert all(len(v) == 12 for v in drawn)\n"
            "stars = [r['id'] for r in view.table.rows if ['★ best', 'best'] in r['badges']]\n"
            "assert stars == [str(sweep.best_trial().index)], stars\n"
            "print(view.redraws, type(view).__name__)\n"
        )
        assert check.status == "ok", check.text + check.evalue + "".join(check.traceback)
        # The view gave way to output that lasts: a static figure and the table.
        kinds = {k for data in run.updates for k in data}
        assert "application/vnd.plotly.v1+json" in kinds and "image/svg+xml" in kinds
        tables = [d["text/plain"] for d in run.updates if "last loss" in d.get("text/plain", "")]
        assert tables and "lr=0.3" in tables[-1]
        # Kernel -> Interrupt during a long sweep: one line, every trial stopped at a
        # step, the handle kept, every CPU free.
        long = kernel.execute(
            "slow = {'lr': tune.grid_search([0.1, 0.2, 0.3]), 'steps': 10000, 'pause': 0.02}\n"
            "get_ipython().run_cell_magic('rtnb', 'sweep slow --metric loss --mode min "
            f"--cpus-per-worker 0.5 --max-concurrent-trials 2 --storage {tmp_path} --name cut', "
            "TRIAL)",
            timeout=120,
            interrupt_after=15,
        )
        assert long.ename == "CellInterrupted" and "sweep cut interrupted" in long.evalue, (
            long.ename,
            long.evalue,
            long.text[-2000:],
        )
        after = kernel.execute(
            "cut = get_ipython().magics_manager.registry['RtnbMagics'].last_sweep\n"
            "print(sorted(str(t.state) for t in cut.trials), cut.done())\n"
        )
        assert "['stopped', 'stopped'] True" in after.stdout, after.text
    finally:
        kernel.shutdown()
    assert wait_for_free_cpus(4.0) >= 4.0, "the interrupted sweep left no group behind"
    for t in ("live-t000", "live-t001"):
        assert _means(str(tmp_path), t)[:12], "each trial's reports are in its run"


def test_a_group_lent_to_the_next_trial_starts_it_with_a_fresh_namespace(ray_cluster, tmp_path):
    from ray import tune

    runs: list = []
    unwatch = on_sweep_start(runs.append)
    try:
        rtnb.sweep(
            "seen = sorted(k for k in globals() if not k.startswith('__'))\n"
            "import rtnb\n"
            "left_by_the_last_trial = lr\n"
            "rtnb.report({'n': float(lr)})\n"
            "(seen, rtnb.get_context().get_trial_name())",
            {"lr": tune.grid_search([1, 2, 3])},
            metric="n",
            mode="max",
            max_concurrent_trials=1,
            workers=2,
            cpus_per_worker=0.5,
            storage=str(tmp_path),
            name="fresh",
        )
    finally:
        unwatch()
    sweep = runs[0]
    assert sweep.groups_started == 1, "three trials, one group"
    for t in sweep.trials:
        assert t.state is rtnb.TrialState.TERMINATED
        for rank in (0, 1):
            seen, trial_name = t.value[rank]
            assert seen == ["lr"], "only the trial's own config, nothing of the last trial"
            assert trial_name == t.run_name
    assert sweep.best_trial().config == {"lr": 3}


def test_an_optuna_search_suggests_each_trial_from_the_results_so_far(ray_cluster, tmp_path):
    from ray import tune

    def train(config):
        # A Tune function trainable's body, as written for Tune: its names are rtnb's here.
        from ray import tune

        for _step in range(3):
            tune.report({"score": -((config["x"] - 2.0) ** 2)})

    sweep = rtnb.sweep(
        train,
        {"x": tune.uniform(-5.0, 5.0), "fixed": "kept"},
        metric="score",
        mode="max",
        search_alg="optuna",
        num_samples=4,
        max_concurrent_trials=1,
        workers=2,
        cpus_per_worker=0.5,
        storage=str(tmp_path),
        name="optuna",
    )
    trials = sweep.trials
    assert len(trials) == 4 and len({t.config["x"] for t in trials}) == 4
    assert all(t.config["fixed"] == "kept" for t in trials), "constants reach every trial"
    assert all(t.values == [pytest.approx(-((t.config["x"] - 2.0) ** 2))] * 3 for t in trials)
    assert sweep.groups_started == 1
    best = max(trials, key=lambda t: t.values[-1])
    assert sweep.best_trial().index == best.index


def test_a_metric_only_rank_0_reports_and_a_trial_that_reports_nothing(ray_cluster, tmp_path):
    """As Ray Train code often does: every rank calls report(), rank 0 alone with the
    metric. And a hyperparameter named like a keyword, and the median stopping rule
    with a trial that ends without a result (it must not break the rule's books)."""
    from ray import tune

    code = (
        "import rtnb\n"
        "lam = rtnb.get_config()['lambda']\n"
        "rank = rtnb.get_context().get_world_rank()\n"
        "for s in range(6 if lam else 0):\n"
        "    rtnb.report({'loss': lam * (6 - s)} if rank == 0 else {})\n"
    )
    sweep = rtnb.sweep(
        code,
        {"lambda": tune.grid_search([1.0, 0.1, 0.0])},
        metric="loss",
        mode="min",
        scheduler="median",
        max_concurrent_trials=1,
        workers=2,
        cpus_per_worker=0.5,
        storage=str(tmp_path),
        name="rank0",
    )
    first, second, silent = sweep.trials
    assert first.values == pytest.approx([1.0 * (6 - s) for s in range(6)])
    assert second.values == pytest.approx([0.1 * (6 - s) for s in range(6)])
    assert silent.state is rtnb.TrialState.TERMINATED and silent.values == []
    assert sweep.best_config == {"lambda": 0.1} and sweep.error is None
