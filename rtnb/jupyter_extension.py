"""A Jupyter server extension that warms Ray before any notebook asks for it.

Without it, the first kernel of a session waits for the warm Ray's own start (GCS,
raylet, spare ranks importing torch: ~5 s of a 2-core machine) in its
``%rtnb start``. With it, the server starts the warm Ray when the server starts,
and again when it starts a Python kernel of its own environment while no warm Ray
runs (the warm Ray ends ``RTNB_WARM_RAY_IDLE_S`` after the last kernel left), so
that start overlaps the kernel's own and the user's typing.

Enabled by the ``jupyter_server_config.d/rtnb.json`` file the package installs;
``RTNB_WARM_RAY=0`` in the server's environment turns it off (as it keeps kernels
off the warm Ray), or ``jupyter server extension disable rtnb``. The server never
imports Ray: the warm Ray is a process of its own (:mod:`rtnb.driver.cluster._warm_host`)
that outlives the server until its idle time-out, like one a kernel started.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

__all__ = ["warm_in_background"]

KERNEL_ACTIONS = "https://events.jupyter.org/jupyter_server/kernel_actions/v1"

_warming = threading.Lock()


def warm_in_background(log: Any, why: str) -> threading.Thread | None:
    """Make sure the warm Ray runs, from a thread (the server's loop never waits);
    None when a warm-up is already under way."""
    if not _warming.acquire(blocking=False):
        return None

    def run() -> None:
        from rtnb.driver.cluster._warm_client import ensure_running

        started = time.perf_counter()
        try:
            state, launched = ensure_running()
        except Exception as exc:  # noqa: BLE001 - kernels start their own then
            from rtnb.errors import one_line

            log.warning("rtnb: could not warm Ray (%s): %s", why, one_line(exc))
            return
        finally:
            _warming.release()
        if launched:
            log.info(
                "rtnb: warm Ray started at %s (%s) in %.1f s",
                state["address"],
                why,
                time.perf_counter() - started,
            )

    thread = threading.Thread(target=run, name="rtnb-warm-ray", daemon=True)
    thread.start()
    return thread


def _runs_this_python(argv0: str) -> bool:
    """Whether a kernel spec's interpreter is this environment's (only such a kernel
    can join a warm Ray this server starts). jupyter_client runs a spec's bare
    ``python``/``python3`` as the server's own interpreter."""
    bare = {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info[:2])}
    if argv0 in bare:
        return True
    try:
        return os.path.dirname(os.path.abspath(argv0)) == os.path.dirname(
            os.path.abspath(sys.executable)
        )
    except (TypeError, ValueError):
        return False


def _load_jupyter_server_extension(serverapp: Any) -> None:
    from rtnb.driver.cluster._warm_client import switched_off

    log = serverapp.log
    if switched_off():
        log.info("rtnb: RTNB_WARM_RAY=0: the server does not warm Ray")
        return
    warm_in_background(log, "Jupyter server started")

    async def on_kernel_action(logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        if data.get("action") != "start" or data.get("status") != "success":
            return
        try:
            spec = serverapp.kernel_spec_manager.get_kernel_spec(data.get("kernel_name", ""))
        except Exception:  # noqa: BLE001 - a spec it cannot read is not ours to warm for
            return
        if spec.language == "python" and spec.argv and _runs_this_python(spec.argv[0]):
            warm_in_background(log, f"kernel {data.get('kernel_id', '?')} started")

    serverapp.event_logger.add_listener(schema_id=KERNEL_ACTIONS, listener=on_kernel_action)
