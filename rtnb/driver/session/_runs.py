"""The session's API over its run: checkpoints, resume, results, export and import
(a part of :class:`~rtnb.driver.session._session.Session`, which is made of it)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from rtnb.core._score import score_rule
from rtnb.core._text import mean_over_ranks
from rtnb.driver.cells import ResumePlan
from rtnb.driver.lifecycle import GroupState
from rtnb.driver.scripts import ExportedScript, TrainScript, export_run, read_train_script
from rtnb.errors import CheckpointError, ClusterError
from rtnb.storage._checkpoint import Checkpoint
from rtnb.storage._checkpoints import (
    CheckpointConsistencyMode,
    CheckpointStore,
    ReportedCheckpoint,
)
from rtnb.storage._result import Result

if TYPE_CHECKING:
    from rtnb.driver.cells import CellFlow, CheckpointCoordinator, ResumeFlow
    from rtnb.driver.control import Controller
    from rtnb.metrics._store import MetricsStore
    from rtnb.storage._rundir import RunDirectory

__all__ = ["RunAPI"]


class RunAPI:
    """The run's checkpoints and what is made of it; the session's group is started
    when a resume needs one and scaled when an imported script asks for a size."""

    run_name: str
    run_dir: RunDirectory
    checkpoints: CheckpointStore
    commits: CheckpointCoordinator
    metrics: MetricsStore
    _cells: CellFlow
    _controller: Controller
    _resume: ResumeFlow

    def checkpoint_store(self, run: str | None = None) -> CheckpointStore:
        """This run's checkpoints, or those of another run in the same storage."""
        return self._resume.store(run)

    def load(self, checkpoint_id: str = "latest", run: str | None = None) -> Checkpoint:
        """Make ``rtnb.get_checkpoint()`` return this checkpoint on every rank, without
        running anything (the browser's Load button)."""
        return self._resume.load(checkpoint_id, run)

    def latest_checkpoint_id(self) -> str | None:
        """The checkpoint a recovery would restart from: the latest of the line of
        training the ranks are on (see ``_commits``)."""
        return self.commits.latest_id()

    def list_checkpoints(self, include_incomplete: bool = False, run: str | None = None):
        return self._resume.store(run).list(include_incomplete)

    def get_all_reported_checkpoints(
        self, consistency_mode: Any = "VALIDATED", timeout_s: float | None = None
    ) -> list[ReportedCheckpoint]:
        """Every committed checkpoint of this run, oldest first, with its metrics (the
        validation's too) and status; ``VALIDATED`` first waits for the validations
        running now (``rtnb.get_all_reported_checkpoints()`` in the notebook)."""
        mode = CheckpointConsistencyMode.named(consistency_mode)
        if mode is CheckpointConsistencyMode.VALIDATED and not self._cells.validations.wait(
            timeout_s
        ):
            raise CheckpointError(f"validations still running after {timeout_s} s")
        return self.checkpoints.reported()

    def prepare_resume(
        self, checkpoint_id: str = "latest", *, run: str | None = None
    ) -> ResumePlan:
        """Resume's first half (``%rtnb resume`` runs the cell itself): start the
        group if it is not running, load the checkpoint, and say which training
        cell runs from it."""
        if self.state in (GroupState.NEW, GroupState.STOPPED, GroupState.FAILED):
            self.start()
        return self._resume.plan(checkpoint_id, run)

    def resume(
        self, checkpoint_id: str = "latest", *, run: str | None = None, background: bool = False
    ):
        """Load a checkpoint and run the last training cell again from it (the
        browser's Resume button), starting the group first if it is not running.

        Returns the cell's value (or its handle with ``background``), or None when no
        training cell ran yet: then the next one starts from the checkpoint.
        """
        plan = self.prepare_resume(checkpoint_id, run=run)
        if plan.code is None:
            return None
        if background:
            return self.run_background(plan.code, label=plan.label)
        return self.run(plan.code, label=plan.label)

    def result(self) -> Result:
        """The run so far as an :class:`rtnb.Result` (metrics, dataframe, path)."""
        self.metrics.flush()
        per_rank = {
            r: dict(rep.metrics, step=rep.step) for r, rep in sorted(self.metrics.last.items())
        }
        return Result.of_run(
            self.run_dir,
            metrics=mean_over_ranks(per_rank),
            metrics_per_rank=per_rank,
            checkpoint=self.commits.latest(),
            best_checkpoints=[
                (self.checkpoints.get(c.id), c.all_metrics) for c in self.checkpoints.list()
            ],
            error=self._cells.last_error,
            run_name=self.run_name,
            mlflow_run_id=self.mlflow_run_id,
            score_rule=score_rule(self.config.score, self.config.mode, self.metrics.metric_names()),
        )

    def export(self, path: str, *, force: bool = False) -> ExportedScript:
        """Write this run's training as a standalone Ray Train script (``%rtnb
        export``): the cells that built the ranks' state, in order, as
        ``train_loop_per_worker``, the pushed values as its config, the session's
        options as ``ScalingConfig``/``RunConfig``; it never imports rtnb and also
        runs under ``torchrun``. A file at ``path`` that is not an earlier export is
        kept unless ``force``.

        Example::

            In [9]: session.export("train.py")
        """
        return export_run(self.config.storage_path, self.run_name, path, force, self)

    def prepare_import(self, path: str, argv: list[str] | None = None) -> TrainScript:
        """``%rtnb import``'s first half: read a Ray Train script (never running it
        here) and scale the group to its ``ScalingConfig(num_workers=N)`` (the
        journal keeps the ranks' state); the returned script's ``code`` is the cell
        that runs its ``train_loop_per_worker`` with its ``train_loop_config``. A
        torchrun script (no trainer, a ``__main__`` block) is run whole, with
        ``argv`` as its command line, as ``torchrun`` would.

        Example::

            In [4]: script = session.prepare_import("train.py")
            In [5]: session.run(script.code)
        """
        script = read_train_script(path, argv)
        if script.gpu and not self.config.gpu:
            script.notes.append(
                "the script asks for GPUs (use_gpu=True); this group has none: start one with --gpu"
            )
        size = script.workers
        if size == 0:
            script.notes.insert(
                0,
                "the script runs in Ray Train's local mode (num_workers=0; under torchrun, "
                f"one process per torchrun rank): it runs on this group's {self.world_size} ranks",
            )
        elif size is not None and size != self.config.workers:
            try:
                # At the script's fixed size: an elastic group's MIN would pass a size
                # that scale() then cannot place.
                self._controller.check_fits(
                    dataclasses.replace(self.config, workers=size, min_workers=None)
                )
            except ClusterError as exc:
                # A laptop runs a cluster's script on the group it has, as it is.
                script.notes.insert(
                    0,
                    f"the script asks for {size} workers ({str(exc).split('. ')[0]}): "
                    f"it runs on this group's {self.world_size} ranks",
                )
            else:
                self.scale(size)
                script.notes.insert(0, f"scaled to the script's {size} ranks: {self.last_replay}")
        return script

    # ---- status ------------------------------------------------------------------------
