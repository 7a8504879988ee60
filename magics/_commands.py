"""What each %rtnb subcommand does: one handler per subcommand, registered by name
in :data:`COMMANDS` (the dispatcher looks it up there; no method names are
spelled from the command)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import parse_argstring
from IPython.display import display
from rtnb.magics._parsers import (
    DEFAULTS,
    attach_args,
    checkpoints_args,
    datasets_args,
    debug_args,
    export_args,
    import_args,
    plot_args,
    profile_args,
    pull_args,
    push_args,
    restart_args,
    resume_args,
    rtrain_args,
    runs_args,
    scale_args,
    set_args,
    split_names,
    stacks_args,
    start_args,
    sweep_args,
    trigger_args,
    wait_args,
    warm_args,
)
from rtnb.magics._rtrain import CellRunner, show_profile, shown
from rtnb.magics._slot import NotebookSlot
from rtnb.widgets import (
    CheckpointBrowser,
    LiveMetrics,
    RunsDashboard,
    SweepProgress,
    SweepView,
    runs_bundle,
    show_static_figure,
    stop_asking,
)

from rtnb.core._changes import control_value
from rtnb.core._redact import redact_uri
from rtnb.driver import (
    RunAccess,
    Session,
    Sweep,
    attach,
    open_run,
    stop_warm_ray,
    sweep,
    warm_ray_status,
)
from rtnb.errors import ConfigError, SessionError
from rtnb.metrics._store import MetricsStore
from rtnb.storage import CheckpointInfo, list_runs

__all__ = ["COMMANDS", "Commands", "shown"]

Handler = Callable[..., Any]
COMMANDS: dict[str, Handler] = {}


def command(name: str) -> Callable[[Handler], Handler]:
    """Registers a :class:`Commands` method as the handler of ``%rtnb NAME``."""

    def register(handler: Handler) -> Handler:
        COMMANDS[name] = handler
        return handler

    return register


class Commands:
    """The %rtnb subcommands, acting on the kernel's one :class:`NotebookSlot`; a cell
    they run (resume, import) goes through the same :class:`CellRunner` as %%rtrain."""

    def __init__(self, slot: NotebookSlot, shell, runner: CellRunner) -> None:
        self.slot, self.shell, self.runner = slot, shell, runner

    @command("start")
    def start(self, rest: str):
        args = parse_argstring(start_args, rest)
        self.slot.let_go_of_a_lost_detached()
        if self.slot.session is not None and self.slot.session.started:
            raise UsageError(
                f"a worker group is already running (run {self.slot.session.run_name!r}); "
                "use `%rtnb restart` for a fresh one, or `%rtnb stop` first"
            )
        options = vars(args)  # every option but these is a SessionConfig field
        replay, detached = options.pop("replay"), options.pop("detached")
        idle_timeout_s = options.pop("idle_timeout_s")
        if idle_timeout_s is not None and not detached:
            raise UsageError("--idle-timeout is a detached group's: add --detached")
        if detached:
            options["idle_timeout_s"] = idle_timeout_s
        session = Session(replay=replay, detached=detached, **options)
        shown = display({"text/plain": "rtnb: starting…"}, raw=True, display_id=True)

        def progress(line: str) -> None:
            if shown is not None:
                shown.update({"text/plain": line}, raw=True)

        try:
            session = session.start(progress=progress)
        except BaseException:
            progress("rtnb: the start failed (the reason follows)")
            raise
        progress(f"rtnb: run {session.run_name!r} {session.last_start}")
        # (a detached group's start is told as one line by its host: no notes)
        for note in getattr(session.last_start, "notes", ()):
            print(f"rtnb: {note}")
        if session.detached:
            print(
                f"rtnb: run {session.run_name!r} is detached: it goes on if this kernel "
                f"dies; `%rtnb attach {session.run_name}` from any kernel, "
                "`%rtnb stop` frees it"
            )
        if session.last_replay is not None:
            print(f"rtnb: run {session.run_name!r} rebuilt from its journal: {session.last_replay}")
        self.slot.session = session
        display(session.status())
        self.slot.output.prepare()

    @command("attach")
    def attach(self, rest: str):
        args = parse_argstring(attach_args, rest)
        self.slot.let_go_of_a_lost_detached()
        if self.slot.session is not None and self.slot.session.started:
            raise UsageError(
                f"this kernel already has run {self.slot.session.run_name!r}: `%rtnb stop` it "
                "(or restart the kernel) before attaching another"
            )
        try:
            session = attach(args.run, take=args.take, address=args.address)
        except (ConfigError, SessionError) as exc:
            raise UsageError(str(exc)) from None
        self.slot.session = session
        self.slot.output.prepare()
        print(f"rtnb: run {session.run_name!r} attached to this kernel")
        display(session.status())
        cell = session.active_cell
        if cell is not None:
            self.slot.last_view = LiveMetrics(
                session.metrics, cell, stacks=session.stacks, set_controls=session.set_controls
            ).show()
            return None
        ended = session.cells[-1] if session.cells else None
        if ended is not None:
            print(f"rtnb: {ended.name} ended while detached")
            return shown(ended.wait(0))
        return None

    @command("status")
    def status(self, rest: str):
        self._no_args("status", rest)
        display(self.slot.require().status())

    @command("stop")
    def stop(self, rest: str):
        self._no_args("stop", rest)
        stop_asking()  # the theme question, if the page never answered it
        session = self.slot.require()
        if session.detached and not session.started:
            # Taken over by another kernel, or already freed: only this kernel lets go.
            session.release()
            self.slot.session = None
            print(f"rtnb: this kernel let go of run {session.run_name!r}; it is not held here")
            return
        session.stop()
        self.slot.session = None
        print(f"rtnb: worker group of run {session.run_name!r} stopped; its CPUs/GPUs are free")

    @command("restart")
    def restart(self, rest: str):
        args = parse_argstring(restart_args, rest)
        session = self.slot.require().restart(replay=args.replay)
        if args.replay and session.last_replay is not None:
            print(f"rtnb: state kept: {session.last_replay}")
        display(session.status())

    @command("scale")
    def scale(self, rest: str):
        args = parse_argstring(scale_args, rest)
        session = self.slot.require()
        try:
            session.scale(args.workers)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        if args.workers is None:
            print(session.last_growth or "rtnb: the elastic group stays: no room for more ranks")
        elif session.last_replay is not None:
            ranks = f"{session.world_size} rank{'s' if session.world_size != 1 else ''}"
            print(f"rtnb: now {ranks}, state kept: {session.last_replay}")
        display(session.status())

    @command("wait")
    def wait(self, rest: str):
        args = parse_argstring(wait_args, rest)
        with self.runner.names_of_the_notebook_hinted():
            return shown(self.slot.require().wait(args.timeout))

    @command("stacks")
    def stacks(self, rest: str):
        args = parse_argstring(stacks_args, rest)
        return self.slot.require().stacks(ranks=args.ranks)

    @command("debug")
    def debug(self, rest: str):
        args = parse_argstring(debug_args, rest)
        try:
            self.slot.require().debug(args.rank)
        except (ConfigError, SessionError) as exc:
            raise UsageError(str(exc)) from None

    @command("profile")
    def profile(self, rest: str):
        args = parse_argstring(profile_args, rest)
        session = self.slot.require()
        if args.show:
            if session.last_profile is None:
                raise UsageError("no profile yet: `%rtnb profile --steps 20` arms one")
            show_profile(session.last_profile)
            return
        try:
            first = session.profile(args.steps)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        if first is None:
            print(f"rtnb: the next cell's first {args.steps} steps are profiled on every rank")
        else:
            print(
                f"rtnb: steps {first}-{first + args.steps - 1} are profiled on every rank; "
                "`%rtnb profile --show` once they ran"
            )

    @command("set")
    def set(self, rest: str):
        args = parse_argstring(set_args, rest)
        values = {}
        for assignment in args.assignments:
            name, eq, text = assignment.partition("=")
            if not eq or not name.strip():
                raise UsageError(
                    f"%rtnb set takes NAME=VALUE pairs (e.g. lr=3e-4), got {assignment!r}"
                )
            values[name.strip()] = control_value(text)
        try:
            step = self.slot.require().set_controls(values)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        shown = ", ".join(f"{n} = {v!r}" for n, v in values.items())
        where = f"from step {step} on every rank" if step is not None else "from the next cell on"
        print(f"rtnb: {shown} {where}")

    @command("trigger")
    def trigger(self, rest: str):
        args = parse_argstring(trigger_args, rest)
        step = self._fire(lambda session: session.trigger(args.name))
        print(f"rtnb: trigger {args.name!r} fired at step {step} on every rank")

    @command("save-now")
    def save_now(self, rest: str):
        self._no_args("save-now", rest)
        step = self._fire(lambda session: session.save_now())
        print(f"rtnb: every rank saves at step {step} (committed once all have written it)")

    def _fire(self, fire):
        try:
            return fire(self.slot.require())
        except (ConfigError, SessionError) as exc:
            raise UsageError(str(exc)) from None

    @command("pull")
    def pull(self, rest: str):
        args = parse_argstring(pull_args, rest)
        return self.slot.require().pull(args.name, ranks=args.ranks)

    @command("push")
    def push(self, rest: str):
        args = parse_argstring(push_args, rest)
        namespace = self.shell.user_ns
        missing = [n for n in args.names if n not in namespace]
        if missing:
            raise UsageError(f"{missing[0]!r} is not defined in the notebook")
        self.slot.require().push({n: namespace[n] for n in args.names}, ranks=args.ranks)

    @command("datasets")
    def datasets(self, rest: str):
        args = parse_argstring(datasets_args, rest)
        session = self.slot.require()
        if not args.pairs:
            names = session.dataset_names
            print(
                f"rtnb: datasets on the ranks: {', '.join(names)}"
                if names
                else "rtnb: no datasets handed to the ranks yet (%rtnb datasets train=train_ds)"
            )
            return None
        session.set_datasets(self.runner.datasets_from(args.pairs), split_names(args))
        return None

    @command("checkpoints")
    def checkpoints(self, rest: str):
        args = parse_argstring(checkpoints_args, rest)
        session = self.slot.require()
        if args.list:
            return session.list_checkpoints(run=args.run)

        def lasting() -> None:  # nothing can click it: the table, as text
            rows = session.list_checkpoints(include_incomplete=True, run=args.run)
            print(CheckpointInfo.table(rows) if rows else "rtnb: no checkpoints yet")

        def live() -> None:
            self.slot.last_view = self._browser_for(
                session, session.config.storage_path, args.run or session.run_name
            )
            display(self.slot.last_view)

        self.slot.output.show(live, lasting)

    @command("resume")
    def resume(self, rest: str):
        args = parse_argstring(resume_args, rest)
        plan = self.slot.require().prepare_resume(args.checkpoint, run=args.run)
        if plan.code is None:
            print(
                f"rtnb: loaded {plan.checkpoint.id}; the next training cell starts from it "
                "(rtnb.get_checkpoint())"
            )
            return None
        print(f"rtnb: resuming the last training cell from {plan.checkpoint.id}")
        return self.runner.run(plan.code, parse_argstring(rtrain_args, ""))

    @command("load")
    def load(self, rest: str):
        args = parse_argstring(resume_args, rest)
        checkpoint = self.slot.require().load(args.checkpoint, run=args.run)
        print(f"rtnb: rtnb.get_checkpoint() now returns {checkpoint.id} on every rank")

    @command("warm")
    def warm(self, rest: str):
        args = parse_argstring(warm_args, rest)
        if args.action == "stop":
            stopped = stop_warm_ray(force=args.force)
            if not stopped:
                print("rtnb: no warm Ray is running")
            for status in stopped:
                print(f"rtnb: stopped the warm Ray at {status.address} (pid {status.pid})")
            return None
        running = warm_ray_status()
        if not running:
            print(
                "rtnb: no warm Ray is running (the next `%rtnb start` in a notebook "
                "starts one; RTNB_WARM_RAY=0 keeps kernels off it)"
            )
        for status in running:
            print(status.summary(this_pid=os.getpid()))
        return None

    @command("sweep")
    def sweep(self, rest: str, cell: str):
        args = parse_argstring(sweep_args, rest)
        namespace = self.shell.user_ns
        if args.space not in namespace:
            raise UsageError(
                f"{args.space!r} is not defined in the notebook: make the search space first, "
                "e.g. space = {'lr': tune.loguniform(1e-4, 1e-1)}"
            )
        session = self.slot.session
        storage = args.storage or (session.config.storage_path if session is not None else None)
        self.slot.last_sweep = sweep(
            cell,
            namespace[args.space],
            metric=args.metric,
            mode=args.mode,
            num_samples=args.num_samples,
            max_concurrent_trials=args.max_concurrent_trials,
            scheduler=self._tune_object(args.scheduler, "scheduler"),
            search_alg=self._tune_object(args.search_alg, "search-alg"),
            workers=args.workers,
            cpus_per_worker=args.cpus_per_worker,
            gpu=args.gpu,
            max_failures=args.max_failures,
            name=args.name,
            storage=storage,
            background=True,
        )
        # Kept before waiting: an interrupted or failed sweep's trials stay at hand.
        return self.slot.last_sweep if args.background else self.slot.last_sweep.wait()

    def _tune_object(self, text: str | None, flag: str):
        """--scheduler/--search-alg: a short name (the engine knows them), or a
        notebook variable."""
        names = ("asha", "median", "fifo") if flag == "scheduler" else ("optuna",)
        if text is None or text in names:
            return text
        if text not in self.shell.user_ns:
            raise UsageError(
                f"--{flag} {text!r}: neither {', '.join(names)} nor a variable of the notebook"
            )
        return self.shell.user_ns[text]

    def show_sweep(self, started: Sweep) -> None:
        """Every sweep of this kernel (``%%rtnb sweep`` or ``rtnb.sweep``) gets its view."""

        def live() -> None:
            self.slot.last_view = SweepView(
                started, resume=lambda index: _resume_trial_in_view(self.slot, started, index)
            ).show()

        self.slot.output.show(live, lambda: SweepProgress(started))

    @command("result")
    def result(self, rest: str):
        self._no_args("result", rest)
        return self.slot.require().result()

    @command("runs")
    def runs(self, rest: str):
        args = parse_argstring(runs_args, rest)
        session = self.slot.session
        storage = self._storage_of(args.storage)
        try:
            table = list_runs(storage)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None

        def load(name: str) -> MetricsStore:
            return self._metrics_of(name, args.storage)

        title = f"runs in {shown_storage(storage)}"
        if not table.runs:
            print(f"rtnb: no rtnb runs in {redact_uri(storage)}")
            return None
        if not self.slot.output.live:
            # A saved notebook and papermill keep the table as text and a figure.
            stores = {run.name: load(run.name) for run in table.runs}
            metric = args.metric or next(
                (m for s in stores.values() for m in s.metric_names()), None
            )
            display(runs_bundle(table.runs, stores, metric, title=title), raw=True)
            return None
        self.slot.last_view = RunsDashboard(
            lambda: list_runs(storage),
            load,
            open_checkpoints=lambda name: self._browser_for(session, storage, name),
            title=title,
        )
        if args.metric:
            if args.metric not in self.slot.last_view.metric.options:
                raise UsageError(
                    f"no run in {redact_uri(storage)} reported {args.metric!r}; reported: "
                    f"{', '.join(self.slot.last_view.metric.options) or 'nothing yet'}"
                )
            self.slot.last_view.metric.value = args.metric
        display(self.slot.last_view)
        return None

    @staticmethod
    def _browser_for(session, storage: str, name: str) -> CheckpointBrowser:
        """The checkpoint browser of run ``name``; Resume/Load act through this
        kernel's session when it uses the same storage."""
        run = open_run(storage, name, session)
        store = run.checkpoints()
        return CheckpointBrowser(
            lambda: store.list(include_incomplete=True),
            resume=(lambda cid: _resume_in_view(session, run, cid)) if run.can_act else None,
            load=(
                (lambda cid: f"rtnb.get_checkpoint() now returns {run.load(cid).id} on every rank")
                if run.can_act
                else None
            ),
            delete=store.delete,
            subscribe=store.subscribe,
            latest=run.latest_checkpoint_id if run.own else None,
            score=store.score,
            mode=store.mode,
            title=f"checkpoints of run {name!r}",
        )

    @command("plot")
    def plot(self, rest: str):
        args = parse_argstring(plot_args, rest)
        run = args.run or (self.slot.session.run_name if self.slot.session else None)
        if run is None:
            raise UsageError(
                "%rtnb plot needs a run name (`%rtnb runs` lists them), e.g. %rtnb plot mnist"
            )
        try:
            store = self._metrics_of(run, args.storage)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        missing = [m for m in args.metric or () if m not in store.metric_names()]
        if missing:
            raise UsageError(
                f"run {run!r} has no metric {missing[0]!r}; it reported: "
                f"{', '.join(store.metric_names()) or 'nothing yet'}"
            )
        if not show_static_figure(store, title=f"run {run}", metrics=args.metric):
            print(f"rtnb: run {run!r} has reported no metrics yet")
        return None

    @command("import")
    def import_script(self, rest: str):
        args = parse_argstring(import_args, rest)
        try:
            script = self.slot.require().prepare_import(args.file, args.args)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        for note in script.notes:
            print(f"rtnb: {note}")
        what = "its __main__" if script.loop == "__main__" else f"{script.loop}()"
        print(f"rtnb: running {what} of {script.path} on the ranks")
        return self.runner.run(script.code, parse_argstring(rtrain_args, ""))

    @command("export")
    def export(self, rest: str):
        args = parse_argstring(export_args, rest)
        run = args.run or (self.slot.session.run_name if self.slot.session else None)
        if run is None:
            raise UsageError(
                "%rtnb export needs a run: start a session and run cells, or name one "
                "with --run (`%rtnb runs` lists them)"
            )
        try:
            exported = open_run(self._storage_of(args.storage), run, self.slot.session).export(
                args.file, force=args.force
            )
        except (ConfigError, SessionError) as exc:
            raise UsageError(str(exc)) from None
        print(exported)

    def _storage_of(self, storage: str | None) -> str:
        """``--storage``, else this session's, else the default."""
        if storage is not None:
            return storage
        return (self.slot.session.config if self.slot.session else DEFAULTS).storage_path

    def _metrics_of(self, run: str, storage: str | None) -> MetricsStore:
        """A run's metrics: this session's own from the kernel (the newest), any
        other's from its record."""
        return open_run(self._storage_of(storage), run, self.slot.session).metrics()

    @staticmethod
    def _no_args(sub: str, rest: str) -> None:
        if rest:
            raise UsageError(f"%rtnb {sub} takes no arguments, got {rest!r}")


def shown_storage(storage: str) -> str:
    """A storage path as a title shows it: under the working directory, relative to
    it (``./rtnb_runs``, not the machine's whole path); a URI without its secrets."""
    if "://" in storage:
        return redact_uri(storage)
    relative = os.path.relpath(storage, os.getcwd())
    return storage if relative.startswith("..") else f"./{relative}"


def _resume_in_view(session: Session, run: RunAccess, checkpoint_id: str):
    """The browser's Resume: the last training cell runs again in the background, its
    live view shown under the browser (the kernel stays free meanwhile)."""
    handle = run.resume(checkpoint_id)
    if handle is None:
        return "loaded; the next training cell starts from it"
    # A button click reaches the kernel only through a live widget frontend.
    view = LiveMetrics(session.metrics, handle)
    return (
        f"{handle.name} is running in the background from it (`%rtnb wait` for its value)",
        view,
    )


def _resume_trial_in_view(slot: NotebookSlot, started: Sweep, index: int | None):
    """The sweep view's Resume: the trial's config and checkpoint go to the notebook's
    group, and the sweep's code runs on from there in the background."""
    session = slot.session
    if session is None or not session.started:
        return (
            f"start the notebook's group first (`%rtnb start --storage {redact_uri(started.storage)}`), "
            "then Resume"
        )
    handle = started.resume_trial(session, index, background=True)
    trial = started.best_trial() if index is None else started.trials[index]
    view = LiveMetrics(session.metrics, handle)
    return (
        f"trial {trial.index} ({trial.config}) carries on in the notebook's group, in the "
        "background (`%rtnb wait` for its value)",
        view,
    )
