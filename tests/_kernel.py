"""A real Jupyter kernel driven through jupyter_client, for tests that need one."""

from __future__ import annotations

import contextlib
import queue
import subprocess
import threading
import time
from dataclasses import dataclass, field

import nbformat
from jupyter_client.manager import KernelManager

from tests._margins import waited


def new_notebook(cells: list[str]):
    """A notebook of code cells whose kernelspec runs in this Python (no kernel dialog)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    return nb


@dataclass
class Execution:
    status: str = ""
    stdout: str = ""
    stderr: str = ""
    ename: str = ""
    evalue: str = ""
    traceback: list[str] = field(default_factory=list)
    results: list[dict] = field(default_factory=list)
    updates: list[dict] = field(default_factory=list)  # update_display_data, in order
    stream_times: list[float] = field(default_factory=list)
    # (the prompt, what stdout showed when it was asked) for each input request
    prompts: list[tuple[str, str]] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def text(self) -> str:
        return self.stdout + self.stderr


class Kernel:
    def __init__(self, cwd: str | None = None, env: dict[str, str] | None = None) -> None:
        self.km = KernelManager(kernel_name="python3")
        kwargs = {"cwd": cwd}
        if env is not None:
            kwargs["env"] = env
        self.km.start_kernel(**kwargs)
        self.kc = self.km.client()
        self.kc.start_channels()
        began = time.monotonic()
        self.kc.wait_for_ready(timeout=60)
        waited("a kernel's start", time.monotonic() - began, 60)

    def execute(
        self,
        code: str,
        timeout: float = 120.0,
        interrupt_after: float | None = None,
        stdin: list[str] | None = None,
    ) -> Execution:
        """Run ``code``; ``stdin``: the answers typed, in order, to its input requests
        (each request's prompt is kept with the output shown before it)."""
        result = Execution()
        start = time.monotonic()
        answers = list(stdin or [])
        msg_id = self.kc.execute(code, allow_stdin=stdin is not None)
        timer = None
        if interrupt_after is not None:
            timer = threading.Timer(interrupt_after, self.km.interrupt_kernel)
            timer.start()
        request = None  # an input request waiting for the output sent before it
        try:
            while True:
                remaining = timeout - (time.monotonic() - start)
                if remaining <= 0:
                    waited(f"a kernel cell ({code.splitlines()[0][:50]})", timeout, timeout)
                    raise TimeoutError(
                        f"kernel did not finish within {timeout} s:\n{code}\n"
                        f"what it printed by then:\n{result.text[-3000:]}"
                    )
                if stdin is not None and request is None:
                    with contextlib.suppress(queue.Empty):
                        request = self.kc.get_stdin_msg(timeout=0)
                try:
                    msg = self.kc.get_iopub_msg(
                        timeout=min(remaining, 0.2) if stdin is not None else remaining
                    )
                except queue.Empty:
                    if request is not None:  # the output before it has all come
                        result.prompts.append((request["content"]["prompt"], result.stdout))
                        self.kc.input(answers.pop(0) if answers else "")
                        request = None
                    continue
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                if self._record(result, msg, start):
                    break
        finally:
            if timer is not None:
                timer.cancel()
        result.status = self._reply_to(msg_id)["content"]["status"]
        result.elapsed_s = time.monotonic() - start
        waited(
            f"a kernel cell ({code.splitlines()[0][:50] if code else ''})",
            result.elapsed_s,
            timeout,
        )
        return result

    @staticmethod
    def _record(result: Execution, msg: dict, start: float) -> bool:
        """Keep ``msg`` in ``result``; True once the kernel is idle again."""
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            setattr(result, content["name"], getattr(result, content["name"]) + content["text"])
            result.stream_times.append(time.monotonic() - start)
        elif kind == "error":
            result.ename, result.evalue, result.traceback = (
                content["ename"],
                content["evalue"],
                content["traceback"],
            )
        elif kind in ("execute_result", "display_data"):
            result.results.append(content["data"])
        elif kind == "update_display_data":
            result.updates.append(content["data"])
        elif kind == "status" and content["execution_state"] == "idle":
            return True
        return False

    def _reply_to(self, msg_id: str) -> dict:
        # wait_for_ready() asks kernel_info once a second until one answer comes; a kernel
        # slow to start (CI under load) answers all of them, and the extra replies wait on
        # the shell channel, so the next reply read there need not be this request's.
        while True:
            reply = self.kc.get_shell_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply

    def shutdown(self) -> None:
        """Ask the kernel to exit. Its exit (about a second, mostly idle: IPython's
        reset, the Ray driver's end) is waited for in the background; the session
        cluster's end waits for every one (:func:`wait_for_exits`), killing one still
        there after 10 s."""
        self.kc.stop_channels()
        self.km.request_shutdown()
        process = self.km.provisioner.process

        def reap() -> None:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

        exit_watch = threading.Thread(target=reap, name="kernel-exit", daemon=True)
        exit_watch.start()
        _exiting.append((self.km, exit_watch))


_exiting: list[tuple[KernelManager, threading.Thread]] = []


def wait_for_exits() -> None:
    """Every kernel shut down without waiting has exited (killed if it would not)
    and its connection files are gone."""
    while _exiting:
        km, exit_watch = _exiting.pop()
        exit_watch.join()
        km.cleanup_resources()


@contextlib.contextmanager
def kernel_with_rtnb(cwd: str, env: dict[str, str] | None = None):
    """A kernel in ``cwd`` with rtnb loaded; after it, its group stopped and the
    kernel shut down."""
    kernel = Kernel(cwd=cwd, env=env)
    try:
        run = kernel.execute("%load_ext rtnb")
        assert run.status == "ok", run.text + str(run.traceback)
        yield kernel
        kernel.execute("%rtnb stop", timeout=60)
    finally:
        kernel.shutdown()


def one_line_error(run: Execution) -> str:
    """The error a user sees; asserts it is one line of rtnb's, not a traceback
    through rtnb's code (a UsageError prints to stderr; rtnb's errors render as a
    one-entry traceback)."""
    assert run.status == "error", run.text
    shown = ("\n".join(run.traceback) + run.stderr).strip()
    assert shown, "no error shown"
    assert "Traceback" not in shown, shown
    assert "site-packages" not in shown and "/rtnb/" not in shown, shown
    return shown
