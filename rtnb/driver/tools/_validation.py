"""Validation tasks: ``report(..., validation=fn)`` runs ``fn`` on the committed
checkpoint as its own Ray task (as Ray Train 2.60's validation does), never on a
rank, so training goes on meanwhile.

The task asks for no CPU unless ``ray_remote_kwargs`` say otherwise: on a laptop the
ranks hold every CPU, and a validation waiting for one would wait until the cell
ended, without a word. Its result (metrics, or why it failed or timed out) is kept
beside the checkpoint (``validations/<id>.json``) and joins the checkpoint's
metrics in the browser, the ``Result`` and ``get_all_reported_checkpoints``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from rtnb.core._messages import ValidationRequest
from rtnb.errors import one_line
from rtnb.storage._checkpoints import CheckpointInfo, CheckpointStore
from rtnb.worker._validate import validate_checkpoint

__all__ = ["Validations"]


class Validations:
    """Starts the validations the commits asked for; one waiting thread each."""

    def __init__(self, store: CheckpointStore, env: Callable[[], dict[str, str]]) -> None:
        self._store = store
        # The session's --env for the task too: what the ranks read storage with.
        self._env = env
        self._running: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()

    def start_due(self) -> None:
        due, self._store.validations_due = self._store.validations_due, []
        for info, request in due:
            thread = threading.Thread(
                target=self._run,
                args=(info, request, dict(self._env())),
                name="rtnb-validation",
                daemon=True,
            )
            with self._lock:
                self._running[info.id] = thread
            thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the validations running now; True when none is left."""
        with self._lock:
            running = list(self._running.values())
        for thread in running:
            thread.join(timeout)
        with self._lock:
            return not any(t.is_alive() for t in self._running.values())

    def _run(self, info: CheckpointInfo, request: ValidationRequest, env: dict) -> None:
        try:
            result = _outcome(self._store, info, request, env)
        finally:
            with self._lock:
                self._running.pop(info.id, None)
        try:
            self._store.record_validation(info.id, result)
        except OSError:
            pass  # storage refused: the checkpoint stays "validating", its files intact


def _outcome(
    store: CheckpointStore, info: CheckpointInfo, request: ValidationRequest, env: dict
) -> dict:
    try:
        checkpoint = store.get(info.id)
        metrics = _in_a_task(request, checkpoint, env)
    except TimeoutError:
        return {"status": "VALIDATION_TIMEOUT", "error": f"not done in {request.timeout_s} s"}
    except Exception as exc:  # noqa: BLE001 - the user's function may raise anything
        return {"status": "VALIDATION_FAILED", "error": one_line(exc)}
    return {"status": "VALIDATED", "metrics": metrics}


def _in_a_task(request: ValidationRequest, checkpoint: Any, env: dict) -> dict[str, Any]:
    import ray

    if not ray.is_initialized():  # local mode: no Ray, a thread of the kernel
        return _in_a_thread(request, checkpoint)
    from ray.exceptions import GetTimeoutError, RayTaskError

    options: dict[str, Any] = {"num_cpus": 0, "max_retries": 0}
    if env:
        options["runtime_env"] = {"env_vars": env}
    options.update(request.remote)
    ref = ray.remote(**options)(validate_checkpoint).remote(request.fn, checkpoint, request.kwargs)
    try:
        return ray.get(ref, timeout=request.timeout_s)
    except GetTimeoutError:
        ray.cancel(ref, force=True)
        raise TimeoutError from None
    except RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        raise (cause if isinstance(cause, BaseException) else exc) from None


def _in_a_thread(request: ValidationRequest, checkpoint: Any) -> dict[str, Any]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["metrics"] = validate_checkpoint(request.fn, checkpoint, request.kwargs)
        except BaseException as exc:  # noqa: BLE001 - raised in the waiting thread
            box["error"] = exc

    worker = threading.Thread(target=run, name="rtnb-validation-local", daemon=True)
    worker.start()
    worker.join(request.timeout_s)
    if worker.is_alive():
        raise TimeoutError
    if "error" in box:
        raise box["error"]
    return box["metrics"]
