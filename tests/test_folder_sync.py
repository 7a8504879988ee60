"""The notebook's folder on ranks whose node cannot see it: what is copied, what is
left out and said, edits reaching the copy before the next cell, modules reloaded.

The first tests wire the kernel's side (``FolderSync``) to a rank's side
(``RankFolder``) in this process, on real files; the last one runs a real kernel
against a Ray node started in its own mount namespace, where the notebook's folder
is an empty tmpfs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from rtnb.core._folder import FolderChanges
from rtnb.core._messages import CellRequest
from rtnb.driver.ranks._folder_sync import FolderSync
from rtnb.worker._folder import RankFolder


@pytest.fixture
def notebook_folder(tmp_path, monkeypatch):
    """A project folder as users have one, this process working in it (restored after)."""
    folder = tmp_path / "project"
    (folder / "data").mkdir(parents=True)
    (folder / "model.py").write_text(
        "SCALE = 1\n\nclass Net:\n    def scale(self):\n        return SCALE\n"
    )
    (folder / "config.yaml").write_text("lr: 0.1\n")
    (folder / ".env").write_text("AWS_SECRET_ACCESS_KEY=do-not-ship\n")
    (folder / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    (folder / ".gitignore").write_text("outputs/\n*.log\n!keep.log\n")
    (folder / "outputs").mkdir()
    (folder / "outputs" / "big.bin").write_bytes(b"x" * 1000)
    (folder / "train.log").write_text("noise\n")
    (folder / "keep.log").write_text("wanted\n")
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    with open(folder / "data" / "huge.csv", "wb") as f:
        f.truncate(11 * 2**20)  # over the 10 MiB a file may have (sparse: no real disk)
    (folder / "data" / "small.csv").write_text("a,b\n1,2\n")
    (folder / "myenv" / "lib").mkdir(parents=True)  # a virtualenv by another name
    (folder / "myenv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (folder / "myenv" / "lib" / "torch.py").write_text("")
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return folder


def _wired(mode: str = "ship", excludes=(), includes=()) -> tuple[FolderSync, RankFolder]:
    rank = RankFolder()
    sync = FolderSync.open(
        mode,
        tuple(excludes),
        tuple(includes),
        ask=lambda roots, copy_all: [rank.open(roots, copy_all)],
        send=lambda changes: rank.apply(changes[0]),
    )
    assert sync is not None
    return sync, rank


def _copied(rank: RankFolder) -> set[str]:
    top = os.path.join(rank.private, "folder")
    return {os.path.relpath(os.path.join(d, f), top) for d, _, files in os.walk(top) for f in files}


def test_the_copy_honours_gitignore_defaults_and_secrets_and_says_what_it_left_out(
    notebook_folder,
):
    sync, rank = _wired()
    assert _copied(rank) == {
        "model.py",
        "config.yaml",
        ".gitignore",
        "keep.log",
        os.path.join("data", "small.csv"),
    }
    assert os.getcwd() == os.path.join(rank.private, "folder"), "the rank works in its copy"
    assert sys.path[0] == os.getcwd()
    notes = "\n".join(sync.notes)
    assert "left out .env, id_rsa, which may hold secrets: name them with --includes" in notes
    assert "data/huge.csv (11 MiB): over 10 MiB" in notes
    # (and this test process's own local package, tests/, which a kernel would not have)
    assert "files" in sync.shipped_summary() and "to rank 0, whose node cannot see it" in (
        sync.shipped_summary()
    )
    for secret in (".env", "id_rsa"):
        assert not any(secret in path for path in _copied(rank))


def test_named_files_are_shipped_and_excludes_leave_folders_out(notebook_folder):
    sync, rank = _wired(excludes=["data/"], includes=[".env"])
    copied = _copied(rank)
    assert ".env" in copied and "id_rsa" not in copied
    assert not any(path.startswith("data") for path in copied)
    assert "huge.csv" not in "\n".join(sync.notes), "an excluded folder is not 'left out'"


def test_an_edit_reaches_the_copy_with_the_next_cell_and_the_module_is_reloaded(
    notebook_folder,
):
    sync, rank = _wired()
    import importlib

    sys.modules.pop("model", None)
    model = importlib.import_module("model")
    rank.after_cell()
    try:
        assert model.__file__.startswith(rank.private)
        net = model.Net()
        quiet = sync.stamp(CellRequest(1, "pass"), [0])
        assert quiet.files is None, "nothing changed: the request carries nothing"
        assert rank.before_cell(quiet.files) == []

        time.sleep(0.01)  # a newer mtime even on a coarse clock
        (notebook_folder / "model.py").write_text(
            "SCALE = 2\n\nclass Net:\n    def scale(self):\n        return SCALE * 10\n"
        )
        (notebook_folder / "config.yaml").unlink()
        (notebook_folder / "extra.py").write_text("X = 1\n")
        request = sync.stamp(CellRequest(2, "pass"), [0])
        assert isinstance(request.files, FolderChanges)
        assert set(request.files.written) == {"folder/model.py", "folder/extra.py"}
        assert request.files.deleted == ("folder/config.yaml",)

        assert rank.before_cell(request.files) == ["rtnb: reloaded model (changed since imported)"]
        assert model.SCALE == 2
        assert net.scale() == 20, "an object made before the edit runs the new code"
        copied = _copied(rank)
        assert "extra.py" in copied and "config.yaml" not in copied
        again = sync.stamp(CellRequest(3, "pass"), [0])
        assert again.files is None, "what the rank holds is not sent twice"
    finally:
        sys.modules.pop("model", None)


def test_a_rank_that_sees_the_folder_copies_nothing_and_still_reloads(notebook_folder):
    rank = RankFolder()
    sync = FolderSync.open(
        "auto", (), (), ask=lambda roots, c: [rank.open(roots, c)], send=pytest.fail
    )
    assert sync is None and rank.private is None, "a local Ray copies nothing"
    assert os.getcwd() == str(notebook_folder)
    import importlib

    sys.modules.pop("model", None)
    model = importlib.import_module("model")
    rank.after_cell()  # as a rank does when the cell that imported it ends
    try:
        time.sleep(0.01)
        (notebook_folder / "model.py").write_text("SCALE = 3\n")
        assert rank.before_cell(None) == ["rtnb: reloaded model (changed since imported)"]
        assert model.SCALE == 3
        time.sleep(0.01)
        (notebook_folder / "model.py").write_text("SCALE = (\n")
        (line,) = rank.before_cell(None)
        assert line.startswith("rtnb: model changed but did not reload (SyntaxError")
        assert line.endswith("the cell runs with the old one") and model.SCALE == 3
        assert rank.before_cell(None) == [], "tried again only after the next edit"
    finally:
        sys.modules.pop("model", None)


def test_a_module_imported_after_another_was_dropped_is_still_watched(notebook_folder):
    """The ranks look at sys.modules again only when its size or newest entry moved
    (thousands of modules, twice a cell): a cell that drops one module and imports
    another leaves the size as it was, and the new one is watched all the same."""
    rank = RankFolder()
    FolderSync.open("auto", (), (), ask=lambda roots, c: [rank.open(roots, c)], send=pytest.fail)
    (notebook_folder / "other.py").write_text("Y = 1\n")
    import importlib

    for name in ("model", "other"):
        sys.modules.pop(name, None)
    importlib.import_module("model")
    rank.after_cell()
    try:
        assert rank.before_cell(None) == [], "nothing changed"
        size = len(sys.modules)
        del sys.modules["model"]
        other = importlib.import_module("other")
        assert len(sys.modules) == size, "the same count as before the swap"
        rank.after_cell()
        time.sleep(0.01)
        (notebook_folder / "other.py").write_text("Y = 2\n")
        assert rank.before_cell(None) == ["rtnb: reloaded other (changed since imported)"]
        assert other.Y == 2
    finally:
        for name in ("model", "other"):
            sys.modules.pop(name, None)


def test_a_local_package_imported_from_outside_site_packages_goes_with_the_folder(
    notebook_folder, tmp_path
):
    lib = tmp_path / "src" / "mylib"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("from .core import VALUE\n")
    (lib / "core.py").write_text("VALUE = 7\n")
    sys.path.insert(0, str(lib.parent))
    import importlib

    importlib.import_module("mylib")
    try:
        sync, rank = _wired()
        assert os.path.isfile(os.path.join(rank.private, "packages", "mylib", "core.py"))
        assert os.path.join(rank.private, "packages") in sys.path
        assert "and local packages" in sync.shipped_summary()
    finally:
        for name in ("mylib", "mylib.core"):
            sys.modules.pop(name, None)


def test_code_loaded_from_a_file_by_path_is_not_a_local_package(notebook_folder, tmp_path):
    """torch.compile and others load generated modules by path: a rank could not
    import them by name, so they are not shipped."""
    import importlib.util

    generated = tmp_path / "generated" / "c2xk4generated.py"
    generated.parent.mkdir()
    generated.write_text("X = 1\n")
    spec = importlib.util.spec_from_file_location("c2xk4generated", generated)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["c2xk4generated"] = module
    try:
        from rtnb.driver.ranks._folder_sync import kernel_roots

        assert not [r for r in kernel_roots() if "c2xk4generated" in r.key]
    finally:
        sys.modules.pop("c2xk4generated", None)


def test_bad_patterns_are_one_clear_line():
    import rtnb

    with pytest.raises(rtnb.ConfigError, match="--excludes takes patterns as in .gitignore"):
        rtnb.Session(excludes=[3])
    with pytest.raises(rtnb.ConfigError, match="--files 'sometimes' is not one of auto"):
        rtnb.Session(files="sometimes")


# ---- a real node that cannot see the notebook's folder ---------------------------------


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "true"], capture_output=True
    )
    return probe.returncode == 0


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare for a node's own mounts")
def test_a_node_that_cannot_see_the_notebooks_folder_gets_it_and_each_edit(
    ray_head, ray_cluster, tmp_path
):
    """A real kernel in a project folder; its ranks on a Ray node that has an empty
    folder at that path (a tmpfs in the node's own mount namespace). A cell imports
    model.py from the folder, the file is edited in the notebook's folder, the next
    cell runs the new code, and the checkpoint it writes loads in the notebook."""
    from tests._kernel import Kernel
    from tests.conftest import WorkerNode, wait_for_free_cpus

    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "model.py").write_text(
        "import torch\n\nFILL = 1.0\n\n\ndef make():\n"
        "    net = torch.nn.Linear(2, 1)\n"
        "    torch.nn.init.constant_(net.weight, FILL)\n"
        "    return net\n"
    )
    (folder / ".env").write_text("TOKEN=never-shipped\n")
    marker = f"rtnb_unshared_{time.monotonic_ns()}"
    # Declared CPUs only (the ranks ask for more than the head has): they land here.
    node = WorkerNode(ray_head, num_cpus=12, resources={marker: 1}, mask=str(folder))
    kernel = None
    try:
        node.wait_joined(marker)
        free_before = wait_for_free_cpus(16)
        kernel = Kernel(cwd=str(folder))
        start = kernel.execute(
            f"%load_ext rtnb\n%rtnb start --workers 2 --cpus-per-worker 5 "
            f"--storage {tmp_path / 'runs'}",
            timeout=240,
        )
        assert start.status == "ok", start.text + start.evalue
        assert "whose node cannot see it" in start.text, start.text
        assert "left out .env, which may hold secrets" in start.text, start.text

        first = kernel.execute(
            "%%rtrain\nimport os, model\n"
            f"(model.FILL, os.getcwd() != {str(folder)!r}, "
            f"os.listdir({str(folder)!r}), os.path.exists('.env'))",
            timeout=120,
        )
        assert first.status == "ok", first.text + first.evalue
        # On the node the real folder is empty; each rank runs in its copy, no secret in it.
        assert "(1.0, True, [], False)" in first.results[-1]["text/plain"], first.results

        time.sleep(0.01)
        (folder / "model.py").write_text(
            (folder / "model.py").read_text().replace("FILL = 1.0", "FILL = 3.0")
        )
        (folder / "helpers.py").write_text("TWO = 2\n")  # a file new since the start
        second = kernel.execute(
            "%%rtrain\nimport os, tempfile, torch, rtnb, helpers\n"
            "assert helpers.TWO == 2\n"
            "net = model.make()\n"
            "own = tempfile.mkdtemp()\n"
            "torch.save(net.state_dict(), os.path.join(own, 'model.pt'))\n"
            "first = rtnb.get_context().get_world_rank() == 0  # Ray Train's way: one saves\n"
            "saved = rtnb.Checkpoint.from_directory(own) if first else None\n"
            "rtnb.report({'fill': model.FILL}, checkpoint=saved)\n"
            "model.FILL",
            timeout=120,
        )
        assert second.status == "ok", second.text + second.evalue
        assert "rtnb: reloaded model (changed since imported)" in second.text, second.text
        assert "3.0" in second.results[-1]["text/plain"], second.results

        loaded = kernel.execute(
            "import model, os, rtnb, torch\n"
            "_ckpt = rtnb.get_all_reported_checkpoints()[-1].checkpoint\n"
            "with _ckpt.as_directory() as _d:\n"
            "    _net = model.make()\n"
            "    _net.load_state_dict(torch.load(os.path.join(_d, 'model.pt')))\n"
            "_net.weight.flatten().tolist()",
            timeout=120,
        )
        assert loaded.status == "ok", loaded.text + loaded.evalue + "\n".join(loaded.traceback)
        assert "[3.0, 3.0]" in loaded.results[-1]["text/plain"], loaded.results
        assert kernel.execute("%rtnb stop").status == "ok"
    finally:
        if kernel is not None:
            kernel.shutdown()
        node.kill()
    assert wait_for_free_cpus(free_before - 12) >= free_before - 12
