"""Unit tests of the engine pieces that need no Ray: config, state machine, rank runtime."""

from __future__ import annotations

import pathlib
import pickle
import sys
import tempfile
import threading
import time
import types

import pytest

from rtnb.core._config import SessionConfig, parse_ranks
from rtnb.core._messages import CellRequest, CellState, RankUpdate
from rtnb.core._reports import ReportBatch
from rtnb.core._values import PerRank, RemoteRepr, from_portable
from rtnb.driver.lifecycle._states import GroupState, StateMachine
from rtnb.errors import CellError, CellInterrupted, ConfigError
from rtnb.worker._runtime import RankContext, RankRuntime


# ---- config ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (None, [0, 1, 2, 3]),
        ("all", [0, 1, 2, 3]),
        ("0,2", [0, 2]),
        ("1-3", [1, 2, 3]),
        (" 3, 0 ", [0, 3]),
    ],
)
def test_parse_ranks_accepts_lists_and_ranges(spec, expected):
    assert parse_ranks(spec, 4) == expected


@pytest.mark.parametrize(
    ("spec", "needle"),
    [("5", "rank 5"), ("a", "list like"), ("3-1", "list like"), ("-1", "list like")],
)
def test_parse_ranks_rejects_bad_input_with_one_clear_line(spec, needle):
    with pytest.raises(ConfigError) as info:
        parse_ranks(spec, 4)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"workers": -1}, "--workers"),
        ({"workers": (3, 2)}, "--workers 3-2"),
        ({"workers": "4"}, "--workers"),
        ({"strategy": "DIAGONAL"}, "--strategy"),
        ({"backend": "mpi"}, "--backend"),
        ({"backend": "nccl"}, "--gpu"),
        ({"address": "http://x:1"}, "--address"),
        ({"address": "nohostport"}, "--address"),
        ({"name": "../evil"}, "--name"),
        ({"mode": "avg"}, "--mode"),
    ],
)
def test_config_rejects_bad_options(options, needle):
    with pytest.raises(ConfigError, match=needle):
        SessionConfig(**options)


def test_config_defaults_match_the_design():
    cfg = SessionConfig()
    assert (cfg.workers, cfg.backend, cfg.strategy, cfg.address) == (2, "gloo", "PACK", None)
    assert SessionConfig(gpu=True).backend == "nccl"
    assert SessionConfig(strategy="spread").strategy == "SPREAD"
    assert SessionConfig(address="ray://127.0.0.1:10001").address == "ray://127.0.0.1:10001"


# ---- state machine --------------------------------------------------------------------
def test_state_machine_notifies_subscribers_and_refuses_illegal_moves():
    machine = StateMachine()
    seen = []
    unsubscribe = machine.subscribe(lambda change: seen.append((change.old, change.new)))
    machine.to(GroupState.STARTING)
    machine.to(GroupState.READY)
    with pytest.raises(RuntimeError, match="illegal"):
        machine.to(GroupState.STARTING)
    unsubscribe()
    machine.to(GroupState.RUNNING)
    assert seen == [(GroupState.NEW, GroupState.STARTING), (GroupState.STARTING, GroupState.READY)]


# ---- errors ---------------------------------------------------------------------------
def test_errors_keep_their_fields_across_pickling():
    err = CellError.from_failures(
        {1: ("ValueError: bad", "Traceback...\nValueError: bad\n"), 0: ("ValueError: bad", "tb0")}
    )
    back = pickle.loads(pickle.dumps(err))
    assert back.ranks == [0, 1] and back.exc_type == "ValueError" and back.failures[0] == "tb0"
    assert "ranks 0, 1" in str(back)
    stop = pickle.loads(pickle.dumps(CellInterrupted("x", kept=False, step=7)))
    assert (stop.kept, stop.step) == (False, 7)


def test_perrank_values_fall_back_to_repr_when_unpicklable():
    assert from_portable((pickle.dumps([1, 2]), "[1, 2]")) == [1, 2]
    fallback = from_portable((None, "<lock>"))
    assert isinstance(fallback, RemoteRepr) and repr(fallback) == "<lock>"
    assert repr(PerRank({1: "b", 0: "a"})) == "[rank 0] 'a'\n[rank 1] 'b'"


# ---- rank runtime ---------------------------------------------------------------------
@pytest.fixture
def runtime():
    saved = sys.stdout, sys.stderr
    rt = RankRuntime(RankContext(world_rank=0, world_size=1))
    yield rt
    rt.close()
    sys.stdout, sys.stderr = saved


def _run(
    rt: RankRuntime, code: str, cell_id: int = 1, timeout: float = 10.0, label: str | None = None
) -> RankUpdate:
    """Run a cell to its end; one RankUpdate with every poll's output and reports."""
    rt.start_cell(CellRequest(cell_id, code, label=label))
    deadline = time.monotonic() + timeout
    output, reports = [], []
    while time.monotonic() < deadline:
        update = rt.wait(0.2, 0.0)
        output += update.output
        reports += update.reports.rows() if update.reports else []
        if update.state is not CellState.RUNNING:
            update.output, update.reports = output, ReportBatch.from_records(reports)
            return update
    raise AssertionError("cell did not finish")


def test_runtime_keeps_namespace_and_returns_last_expression(runtime):
    assert _run(runtime, "x = 40").state is CellState.DONE
    update = _run(runtime, "print('hi')\nx + 2", cell_id=2)
    assert from_portable(update.value) == 42
    assert "".join(text for _s, text in update.output) == "hi\n"


def test_runtime_traceback_shows_user_code_only(runtime):
    update = _run(runtime, "def f():\n    raise ValueError('boom')\nf()")
    summary, tb = update.error
    assert summary == "ValueError: boom"
    assert "Cell rtrain-cell-1, line 2, in f()" in tb
    assert "----> 2     raise ValueError('boom')" in tb and "Cell rtrain-cell-1, line 3\n" in tb
    assert tb.rstrip().endswith("ValueError: boom") and "_runtime.py" not in tb


def test_a_notebook_cells_traceback_names_it_as_jupyter_does(runtime):
    update = _run(runtime, "x = 1\nraise KeyError('k')", cell_id=3, label="[8]")
    shown = update.error[1]
    # As IPython shows its own cells' tracebacks: the lines up to the one that raised.
    assert "Cell In[8], line 2\n      1 x = 1\n----> 2 raise KeyError('k')\n" in shown, shown


def test_a_cell_run_again_is_named_by_its_new_number_in_tracebacks(runtime):
    # The rank reuses the first run's compiled code: its functions' frames too must
    # carry the new name, or tracebacks would show the old cell's lines.
    code = "def f():\n    raise ValueError('again')\nf()"
    first = _run(runtime, code, cell_id=4, label="[4]")
    again = _run(runtime, code, cell_id=5, label="[5]")
    assert "Cell In[4], line 2, in f()" in first.error[1], first.error[1]
    assert "In[4]" not in again.error[1], again.error[1]
    assert "Cell In[5], line 2, in f()" in again.error[1], again.error[1]
    assert "raise ValueError('again')" in again.error[1]


def test_report_pauses_on_stop_and_leaves_at_the_target_step(runtime):
    runtime.start_cell(
        CellRequest(
            1,
            "import time\nfrom rtnb.worker._runtime import current_runtime as c\nwhile True:\n    c().reports.report({'v': 1})\n    time.sleep(0.001)",
        )
    )
    time.sleep(0.1)
    runtime.request_stop()
    deadline = time.monotonic() + 5
    update = runtime.wait(2.0, 0.0)
    while update.paused_at is None and time.monotonic() < deadline:
        update = runtime.wait(2.0, 0.0)
    assert update.paused_at is not None, "a rank must pause at its next report()"
    paused = update.paused_at
    runtime.set_stop_target(paused + 3)
    while update.state is CellState.RUNNING:
        update = runtime.wait(2.0, 0.0)
    assert update.state is CellState.INTERRUPTED
    assert runtime.step == paused + 3


def test_interrupt_breaks_a_pure_python_loop(runtime):
    runtime.start_cell(CellRequest(1, "n = 0\nwhile True:\n    n += 1"))
    time.sleep(0.2)
    assert runtime.interrupt()
    update = runtime.wait(5.0, 0.0)
    assert update.state is CellState.INTERRUPTED
    assert runtime.namespace["n"] > 0


def test_a_cell_run_by_the_relay_listener_in_its_own_thread_can_be_interrupted(runtime):
    code = "n = 0\nwhile True:\n    n += 1"

    def listener():  # what a listening rank does with a relayed cell
        request = CellRequest(1, code, token=7)
        if runtime.start_cell(request, in_caller=True):
            runtime.execute(request)

    thread = threading.Thread(target=listener)
    thread.start()
    while runtime.namespace.get("n", 0) == 0:
        time.sleep(0.01)
    assert not runtime.start_cell(CellRequest(1, code, token=7)), "a direct call: not again"
    assert runtime.interrupt()
    thread.join(5)
    assert not thread.is_alive(), "the interrupt reached the thread running the cell"
    assert runtime.wait(5.0, 0.0).state is CellState.INTERRUPTED


@pytest.mark.parametrize("first", ["c().reports.report({'v': 1})", "print('first line')"])
def test_the_relays_first_wait_gives_way_at_a_cells_first_report_or_line(runtime, first):
    # The relay answers for a rank only when its cell ended with nothing to deliver;
    # a cell that reports or prints is handed to the long-poll at once rather than
    # at its end, so the first points of a live plot are not held back.
    runtime.start_cell(
        CellRequest(
            1,
            "import time\nfrom rtnb.worker._runtime import current_runtime as c\n"
            f"{first}\nfor _ in range(500):\n    time.sleep(0.01)",
        )
    )
    assert runtime.final_update(60.0) is None
    assert runtime.state is CellState.RUNNING, "it gave way before the cell's 5 s ended"
    assert runtime.interrupt()
    while runtime.wait(5.0, 0.0).state is CellState.RUNNING:
        pass
    runtime.start_cell(CellRequest(2, "x = 1"))
    assert runtime.final_update(60.0).state is CellState.DONE, "a quiet cell is answered"


def test_output_from_other_threads_is_captured(runtime):
    update = _run(
        runtime,
        "import threading\nt = threading.Thread(target=lambda: print('from thread'))\nt.start(); t.join()",
    )
    assert "from thread" in "".join(text for _s, text in update.output)


def test_rank_api_outside_a_rank_says_where_to_call_it(monkeypatch):
    import rtnb
    from rtnb.worker import _reporting, _runtime

    monkeypatch.setattr(_runtime, "_CURRENT", None)
    monkeypatch.setattr(_reporting, "_CURRENT", None)
    with pytest.raises(rtnb.SessionError, match="%%rtrain"):
        rtnb.report({"x": 1})
    assert threading.current_thread() is threading.main_thread()


def test_node_local_storage_is_refused_for_ranks_on_several_nodes():
    from rtnb.driver.ranks._group import check_storage_locality

    check_storage_locality(1, "/data/runs", allowed=False)
    check_storage_locality(3, "s3://bucket/runs", allowed=False)
    check_storage_locality(3, "/shared/nfs/runs", allowed=True)
    with pytest.raises(ConfigError, match="2 nodes.*--allow-local-storage"):
        check_storage_locality(2, "/data/runs", allowed=False)


def test_rtnb_help_lists_every_subcommand_and_every_flag():
    from rtnb.magics._magics import SUBCOMMANDS, RtnbMagics, RtrainMagics

    text = RtnbMagics.rtnb.__doc__
    assert "In [1]: %load_ext rtnb" in text, "the example stays"
    for sub in SUBCOMMANDS:
        assert f"%rtnb {sub.name}" in text
        for flag in sub.flags():
            assert flag in text, (sub.name, flag)
    for flag in ("--max-failures", "--keep", "--score", "--mode", "--tensorboard", "--stop-grace"):
        assert flag in text
    for action in RtrainMagics.rtrain_cell.parser._actions:
        for option in action.option_strings:
            assert option in text or option in ("-h", "--help")
    assert "%rtnb scale WORKERS" in text and "%rtnb pull NAME" in text


def test_every_subcommand_has_one_registered_handler_and_every_handler_a_subcommand():
    """%rtnb finds a subcommand's handler in one registry; a row of the table without
    a handler (or a handler no row names) would print help for a command that fails."""
    from rtnb.magics._commands import COMMANDS
    from rtnb.magics._parsers import SUBCOMMAND_NAMES

    assert sorted(COMMANDS) == sorted(SUBCOMMAND_NAMES)
    assert COMMANDS["import"].__name__ == "import_script"


def test_the_relay_closes_a_missing_answer_at_the_shorter_of_two_waits():
    """Rank 0 gives way (a short wait) right after a cell that waited long: the
    listener's missing answer is closed at the short deadline, not the long one, and
    once disarmed nothing is closed any more (a real TCPStore, in this process)."""
    from datetime import timedelta

    import torch.distributed as dist

    from rtnb.worker._actor import _AnswerCloser

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60))
    closer = _AnswerCloser(
        dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
    )
    closer.arm(["kept"], 120.0)
    closer.disarm()
    closer.arm(["long"], 120.0)
    while closer._idle:  # woken by that arm; it holds the lock until it sleeps again
        time.sleep(0.001)
    with closer._cond:
        pass  # now it sleeps until the long deadline
    closer.arm(["short"], 0.05)  # replaces it, and must not wait for it
    client.wait(["short"], timedelta(seconds=30))  # the old code waited 120 s here
    assert client.get("short") == b"-"
    closer.disarm()
    assert not client.check(["kept", "long"]), "a disarmed wait closes nothing"


def test_start_options_are_the_session_configs_fields_with_its_defaults():
    """`%rtnb start`'s flags, their destinations and defaults come from SessionConfig:
    an option added to one and not the other, or a default that differs, fails here;
    and --gpu alone gets nccl (a validated default backend once made it gloo)."""
    import dataclasses

    from IPython.core.magic_arguments import parse_argstring
    from rtnb.magics._parsers import start_args as _start_args

    from rtnb.core._config import declared_defaults

    parser = _start_args.parser
    # The session's own arguments, not its config: how it starts, not what it is.
    own = ("help", "replay", "detached", "idle_timeout_s")
    options = {a.dest: a.default for a in parser._actions if a.dest not in own}
    fields = {f.name for f in dataclasses.fields(SessionConfig)}
    assert set(options) <= fields, set(options) - fields
    declared = declared_defaults()
    assert {name: declared[name] for name in options} == options

    def config(line: str) -> SessionConfig:
        parsed = vars(parse_argstring(_start_args, line))
        for name in own[1:]:
            parsed.pop(name)
        return SessionConfig(**parsed)

    assert config("").backend == "gloo"
    assert config("--gpu").backend == "nccl"
    assert config("--gpu --backend gloo").backend == "gloo"
    assert config("") == SessionConfig()


def test_workers_are_a_size_a_min_max_range_or_local_mode():
    from rtnb.core._config import SessionConfig, parse_workers

    assert parse_workers("4") == 4 and parse_workers("0") == 0
    assert parse_workers("2-4") == (2, 4) and parse_workers(" 3-3 ") == (3, 3)
    for bad, needle in [
        ("3-2", "MIN is more than MAX"),
        ("0-2", "at least 1"),
        ("x", "not a number"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            parse_workers(bad)
    elastic = SessionConfig(workers=(2, 4))
    assert (elastic.workers, elastic.min_workers, elastic.workers_text) == (4, 2, "2-4")
    assert SessionConfig(workers=(3, 3)).elastic is False, "N-N is N"
    local = SessionConfig(workers=0)
    assert local.local and local.world_size == 1 and not local.elastic


def test_cells_are_written_in_ray_trains_names_with_their_comments_and_layout():
    from rtnb.driver.scripts._export import to_ray_train

    known: tuple[set[str], dict[str, str]] = ({"rtnb"}, {})
    first, helpers = to_ray_train(
        "import torch, rtnb as r  # the API\nfrom rtnb import report as rep", known
    )
    assert first == (
        "import torch; import ray.train, ray.train.torch  # the API\n"
        "from ray.train import report as rep"
    ), first
    later, helpers = to_ray_train(
        "ckpt = r.get_checkpoint()\n"
        "if ckpt:\n"
        "    state = ckpt.load_state()   # résumé\n"
        "model = r.prepare_model(net)\n"
        "sharded = r.prepare_model(big, parallel_strategy='fsdp')\n"
        "rep({'loss': 1.0}, checkpoint=r.Checkpoint.from_state({'w': 1}))\n",
        known,
    )
    # get_checkpoint: Ray Train's, else the one named by the script's --resume-from;
    # FSDP stays FSDP2 (Ray Train's "fsdp" is FSDP1's wrapper).
    assert later == (
        "ckpt = get_checkpoint()\n"
        "if ckpt:\n"
        "    state = load_state(ckpt)   # résumé\n"
        "model = ray.train.torch.prepare_model(net)\n"
        "sharded = prepare_model_fsdp(big, parallel_strategy='fsdp')\n"
        "rep({'loss': 1.0}, checkpoint=checkpoint_from_state({'w': 1}))\n"
    ), later
    assert helpers == {
        "load_state",
        "checkpoint_from_state",
        "get_checkpoint",
        "prepare_model_fsdp",
    }


# ---- sweeps ------------------------------------------------------------------------------
def test_a_sweeps_trials_come_from_tunes_variants_num_samples_times_over_the_grid():
    from ray import tune

    from rtnb.driver.tuning._tune import Suggestions, check_space

    # As given to a TorchTrainer under a Tuner: the train_loop_config is the space.
    space = check_space(
        {"train_loop_config": {"lr": tune.grid_search([0.1, 0.01]), "bs": tune.choice([8, 16])}}
    )
    suggestions = Suggestions(space, num_samples=3, searcher=None)
    assert suggestions.total == 6
    configs = []
    while (made := suggestions.next("t")) is not None:
        configs.append(made[0])
    assert suggestions.finished and len(configs) == 6
    assert sorted(c["lr"] for c in configs) == [0.01] * 3 + [0.1] * 3
    assert all(c["bs"] in (8, 16) for c in configs)


def test_a_sweeps_metric_check_reads_the_training_codes_reports():
    from rtnb.driver.tuning._tune import check_reports

    check_reports("rtnb.report({'loss': l, 'acc': a})", "acc")
    check_reports("metrics = {'acc': a}\nrtnb.report(metrics)", "acc")  # built at run time
    check_reports("trainer.train()", "eval_loss")  # reports some other way: the trials tell
    with pytest.raises(ConfigError, match="never reports 'acc'.*name loss"):
        check_reports("ray.train.report(metrics={'loss': l})", "acc")


def test_a_sweeps_table_sorts_by_score_with_the_best_marked():
    from rtnb.widgets._sweep import sort_trials, sweep_table

    from rtnb.driver.tuning._sweep import SweepTrial, TrialState

    trials = [
        SweepTrial(0, "a", {"lr": 0.1}, "s-t000", TrialState.TERMINATED, [0, 1], [3.0, 2.0]),
        SweepTrial(1, "b", {"lr": 0.3}, "s-t001", TrialState.STOPPED, [0], [5.0], stopped_at=1),
        SweepTrial(2, "c", {"lr": 0.2}, "s-t002", TrialState.RUNNING, [0, 1, 2], [4.0, 1.0, 1.5]),
    ]

    class Sweep:
        metric, mode = "loss", "min"

        def __init__(self) -> None:
            self.trials = trials

        def best_trial(self):
            return min(self.trials, key=lambda t: t.values[-1])

    assert [t.index for t in sort_trials(trials, "last", "min")] == [2, 0, 1]
    assert [t.index for t in sort_trials(trials, "best", "max")] == [1, 2, 0]
    assert [t.index for t in sort_trials(trials, "iterations", "min")] == [2, 0, 1]
    head, *rows = sweep_table(Sweep(), key="last")
    assert "last loss" in head and rows[0].startswith("*2")
    assert "lr=0.3" in rows[2] and "stopped" in rows[2]


def test_an_exported_trial_reads_its_config_from_the_loops_argument():
    from rtnb.driver.scripts._export import to_ray_train

    code, _helpers = to_ray_train(
        "import rtnb\nlr = rtnb.get_config()['lr']\nrtnb.report({'lr': lr})"
    )
    assert "rtnb" not in code.replace("__rtnb_config__", "")
    assert "lr = dict(loop_config.get('__rtnb_config__', loop_config))['lr']" in code
    assert "ray.train.report({'lr': lr})" in code


def test_folded_stacks_put_the_one_rank_that_differs_first_and_name_its_cell_line():
    from rtnb.core._stacks import GroupStacks, RankStack, StackFrame

    loader = [
        StackFrame("<rtrain In[5]>", 9, "<module>", "for x, y in loader:"),
        StackFrame("/v/site-packages/torch/utils/data/dataloader.py", 630, "__next__"),
    ]
    reduce = [
        StackFrame("<rtrain In[5]>", 12, "<module>", "dist.all_reduce(t)"),
        StackFrame("/v/site-packages/torch/distributed/distributed_c10d.py", 2950, "all_reduce"),
    ]
    stacks = GroupStacks(
        {
            0: RankStack(0, True, list(loader)),
            1: RankStack(1, True, list(reduce)),
            2: RankStack(2, True, list(loader)),
            3: RankStack(3, True, list(loader)),
        }
    )
    assert stacks.odd_ranks == [1]
    assert stacks.headline() == (
        "rank 1: in all_reduce (torch/distributed/distributed_c10d.py:2950) at cell [5] line 12; "
        "ranks 0,2-3: in __next__ (torch/utils/data/dataloader.py:630) at cell [5] line 9"
    )
    # Every rank alike: nothing is odd; idle ranks say so.
    same = GroupStacks({r: RankStack(r, True, list(loader)) for r in range(3)})
    assert same.odd_ranks == [] and same.headline().startswith("ranks 0-2: in __next__")
    assert GroupStacks({0: RankStack(0, False)}).headline() == "rank 0: no cell running"


def test_py_spy_output_gives_the_cell_threads_stack_outermost_first():
    from rtnb.core._stacks import parse_py_spy

    dump = (
        "Process 4242: ray::RankActor\n"
        "Python v3.11.7 (/usr/bin/python3.11)\n\n"
        'Thread 4242 (idle): "MainThread"\n'
        "    main_loop (ray/_private/worker.py:900)\n"
        'Thread 4250 (active+gil): "rtnb-cell"\n'
        "    sleep (ctypes_helper.py:3)\n"
        "    <module> (<rtrain-cell-4>:3)\n"
        "    execute (rtnb/worker/_runtime.py:280)\n"
        "    _cell_loop (rtnb/worker/_runtime.py:260)\n"
    )
    stack = parse_py_spy(1, dump, pid=4242)
    assert str(stack.method) == "py-spy"
    assert [f.function for f in stack.frames] == ["<module>", "sleep"]
    assert stack.summary() == "in sleep (ctypes_helper.py:3) at cell 4 line 3"
    assert str(parse_py_spy(1, "Process 1: x\n").method) == "none"


def test_memory_that_climbs_every_second_is_flagged_and_memory_that_levels_off_is_not():
    from rtnb.core._resources import ResourceSample, memory_climbing

    mb = 2**20

    def samples(rss):
        return [ResourceSample(float(i), i, 100.0, int(v * mb)) for i, v in enumerate(rss)]

    assert memory_climbing(samples([500 + 10 * i for i in range(20)]))
    # Warm-up growth that then stays flat is a healthy loop.
    assert not memory_climbing(samples([500 + 40 * min(i, 5) for i in range(20)]))
    assert not memory_climbing(samples([500 + i for i in range(20)]))  # 19 MB: noise
    assert not memory_climbing(samples([500 + 10 * i for i in range(10)]))  # too few yet


def test_a_cell_run_again_from_a_checkpoint_fires_only_the_triggers_after_it(runtime):
    """A recovery re-runs a cell with its triggers: those at steps before the
    checkpoint it goes on from fired the first time; the later ones fire at their step."""

    class Resumed:
        id = "step-000000060"
        resume = (60, 0)

    code = (
        "import rtnb\n"
        "fired = []\n"
        "rtnb.on_trigger('early', lambda: fired.append(('early', step)))\n"
        "rtnb.on_trigger('late', lambda: fired.append(('late', step)))\n"
        "rtnb.get_checkpoint()\n"
        "for step in range(61, 81):\n"
        "    rtnb.report({'i': step})\n"
    )
    runtime.set_step(150)  # where the group's last step was when the rank died
    runtime.start_cell(
        CellRequest(1, code, checkpoint=Resumed(), triggers=((50, "early"), (70, "late")))
    )
    deadline = time.monotonic() + 10
    while runtime.wait(0.2, 0.0).state is CellState.RUNNING:
        assert time.monotonic() < deadline
    assert runtime.namespace["fired"] == [("late", 70)]


def test_a_detached_session_refuses_what_it_cannot_be_in_one_line():
    """Checked before anything starts: no Ray is joined for a refused option."""
    import rtnb

    with pytest.raises(rtnb.ConfigError, match="local mode"):
        rtnb.Session(detached=True, workers=0)
    with pytest.raises(rtnb.ConfigError, match="--idle-timeout must be positive"):
        rtnb.Session(detached=True, idle_timeout_s=0)
    with pytest.raises(rtnb.ConfigError, match="name it with --name"):
        rtnb.Session(detached=True, replay=True)
    pending = rtnb.Session(detached=True, name="later")
    assert pending.detached and not pending.started and pending.run_name == "later"
    with pytest.raises(rtnb.SessionError, match="not started yet"):
        pending.status()


def test_ranks_linking_the_same_file_name_into_a_checkpoint_never_leave_it_missing(tmp_path):
    # Two ranks whose checkpoints hold the same file name link it into one folder at
    # once, each then hashing what it placed: the name must never be missing.
    from rtnb.storage._checkpoint import _link

    dst = tmp_path / "checkpoint" / "model.pt"
    sources = []
    for rank in (0, 1):
        src = tmp_path / f"rank{rank}.pt"
        src.write_bytes(b"weights")
        sources.append(str(src))
    _link(sources[0], str(dst))
    problems: list[str] = []
    linking = threading.Event()
    linking.set()

    def link_again(src: str) -> None:
        for _ in range(3000):
            if not _link(src, str(dst)):
                problems.append("a link fell back to a copy")

    def look() -> None:
        while linking.is_set():
            if not dst.exists():
                problems.append("missing")

    watcher = threading.Thread(target=look)
    watcher.start()
    linkers = [threading.Thread(target=link_again, args=(s,)) for s in sources]
    for thread in linkers:
        thread.start()
    for thread in linkers:
        thread.join()
    linking.clear()
    watcher.join()
    assert not problems, f"{len(problems)} times: {sorted(set(problems))}"
    assert sorted(p.name for p in dst.parent.iterdir()) == ["model.pt"], "no spare names left"


# ---- a rank's debugger channel --------------------------------------------------------
def test_an_answered_debugger_prompt_is_never_asked_again_before_pdb_reads_it():
    """The driver polls right after sending a line; pdb's thread may not have woken
    to read it yet (a busy machine). That poll must not show the answered prompt
    again: the notebook would open a second input box nobody answers, and hang."""
    from rtnb.worker._debug import DebugChannel

    cond = threading.Condition()
    channel = DebugChannel(1, cond, stopping=lambda: False)
    channel.open("cell [3] line 2")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(channel.readline()), daemon=True)
    reader.start()
    assert channel.poll(30.0).prompt == "(Pdb rank 1) "
    with cond:  # pdb's thread cannot take the line while this holds the lock
        channel.give("c")
        state = channel.poll(0.0)
    assert state.prompt is None and state.active
    reader.join(30.0)
    assert lines == ["c\n"]


# ---- the notebook's session, in this kernel or detached --------------------------------
def test_a_detached_session_and_a_session_answer_the_same_calls_with_the_same_signatures():
    """The magics call one protocol; a detached group implements each call itself
    (no forwarding by name), with the parameters the kernel's session takes, and a
    cell's keywords are the one CellOptions type."""
    import inspect
    import typing

    from rtnb.driver.detached import DetachedSession
    from rtnb.driver.lifecycle import CellOptions, NotebookSession
    from rtnb.driver.session import Session

    assert "__getattr__" not in vars(DetachedSession)
    cell_calls = {"run", "begin_cell", "run_background"}
    calls = [
        name
        for name, value in vars(NotebookSession).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    ]
    assert len(calls) > 25
    for name in calls:
        ours, theirs = (
            inspect.getattr_static(Session, name),
            inspect.getattr_static(DetachedSession, name),
        )
        if isinstance(ours, property):
            assert isinstance(theirs, property), name
            continue
        if name in cell_calls:
            continue

        def shape(function):
            return [
                (p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()
            ]

        assert shape(ours) == shape(theirs), name
    options = set(typing.get_type_hints(CellOptions))
    for name in cell_calls:
        keywords = {
            p.name
            for p in inspect.signature(getattr(Session, name)).parameters.values()
            if p.kind is p.KEYWORD_ONLY
        }
        assert keywords == options - ({"config"} if name == "begin_cell" else set()), name
        detached = inspect.signature(getattr(DetachedSession, name)).parameters["options"]
        assert detached.kind is detached.VAR_KEYWORD, name


def test_a_detached_session_before_its_start_checks_its_options_and_says_it_is_not_started():
    import rtnb
    from rtnb.errors import ConfigError, SessionError

    with pytest.raises(ConfigError, match="local mode"):
        rtnb.Session(detached=True, workers=0)
    session = rtnb.Session(detached=True, workers=2, name="later")
    assert session.detached and not session.started and session.run_name == "later"
    with pytest.raises(SessionError, match="not started yet: call start"):
        session.status()
    with pytest.raises(SessionError, match="debug is not available on a detached group"):
        session.debug(1)


def test_from_state_hashes_while_it_writes_and_the_run_keeps_that_hash(tmp_path):
    """The digest from_state takes as torch.save writes is the file's own (so the
    upload, which links the file into the run, need not read it back), and the
    committed entry verifies in full."""
    import os

    import torch

    from rtnb.storage._checkpoint import MANIFEST, Checkpoint, _hash, upload_directory

    state = {"w": torch.randn(300_000), "step": 7}
    checkpoint = Checkpoint.from_state(state)
    ((name, written),) = checkpoint._written.items()
    assert written == _hash(checkpoint.filesystem, os.path.join(checkpoint.path, name))
    entries = upload_directory(checkpoint, checkpoint.filesystem, str(tmp_path / "ckpt"))
    assert [(e["path"], e["size"]) for e in entries] == [(name, written[1])]
    assert (
        entries[0][next(k for k in entries[0] if k not in ("path", "size", "stamp"))] == written[0]
    )
    assert not os.path.exists(checkpoint.path), "the temp folder goes once uploaded"
    assert MANIFEST not in os.listdir(tmp_path / "ckpt")
    assert torch.load(tmp_path / "ckpt" / name)["step"] == 7


@pytest.mark.parametrize("ray_lost", [None, "the warm Ray is gone: the ranks went with it"])
def test_a_wait_on_a_cell_whose_group_went_away_ends_in_one_line_saying_why(ray_lost):
    """A cell thread held in a call to a dying Ray never ends by itself: its waiter
    ends anyway, with the Ray's line as the cell's own ClusterError when the Ray
    went (at once: a second), else that the group is gone (after the stop grace)."""
    from rtnb.driver.cells._outcome import Completion
    from rtnb.errors import ClusterError, SessionError

    group = types.SimpleNamespace(state=GroupState.RUNNING, stop_grace_s=2.0, ray_lost=None)

    def ray_goes() -> None:
        group.state, group.ray_lost = GroupState.FAILED, ray_lost

    end = Completion()
    threading.Timer(0.3, ray_goes).start()
    started = time.monotonic()
    expected = ClusterError if ray_lost else SessionError
    with pytest.raises(expected) as raised:
        end.wait(60, "cell [4]", group)
    waited = time.monotonic() - started
    if ray_lost:
        assert str(raised.value) == f"cell [4] ended: {ray_lost}" and waited < 2.5
    else:
        assert "cell [4] lost its worker group (the group is failed)" in str(raised.value)
        assert waited >= 3.3


def test_the_warm_rays_folder_leaves_a_tmpdir_too_long_for_rays_sockets(tmp_path, monkeypatch):
    """Ray's sockets go ~64 bytes under the warm Ray's folder and a socket path holds
    107: a TMPDIR that fits keeps the folder; a longer one (a job's scratch folder)
    gives way to /tmp instead of a warm Ray that cannot start."""
    import shutil

    from rtnb.driver.cluster._warm_host import private_ray_dir

    short = pathlib.Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))
    long_ = tmp_path / ("scratch-of-a-batch-job-" * 2)
    long_.mkdir()
    try:
        for tmpdir, kept in ((short, True), (long_, False)):
            monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
            made = private_ray_dir()
            shutil.rmtree(made)
            assert (made.parent == tmpdir) is kept, (tmpdir, made)
            socket = made / "session_2026-11-29_14-10-45_051662_4194304/sockets/plasma_store"
            assert len(str(socket)) <= 107, socket
    finally:
        shutil.rmtree(short)


def test_the_warm_rays_fingerprint_changes_with_the_ranks_code():
    """A kernel joins a warm Ray only if its spare ranks run the same rtnb: an edit to
    the rank runtime (not only the driver's code) makes a new one."""
    import os

    from rtnb.driver.cluster._warm_client import _fingerprint
    from rtnb.worker import _runtime

    before = _fingerprint()
    source = pathlib.Path(_runtime.__file__)
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, time.time_ns() + 10**9 * 3600))  # now newest
    try:
        assert _fingerprint() != before
    finally:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert _fingerprint() == before
