"""What keeping the notebook's folder in step on the ranks adds to a cell.

A 50-file project folder (modules, configs, a small CSV); two groups of 2 ranks on one
embedded Ray: one copies the folder to its ranks (``files="ship"``, what a rank on a
node that cannot see the folder gets), the other does not (``files="off"``), the
peer: the same cell without sync. Blocks of cells alternate between them, so the
machine's drift hits both alike:

- unchanged: a cell that reads a module of the folder, nothing edited;
- one file changed: the same, with that module rewritten before each cell (outside
  the timed call), so each cell carries it, writes it on both ranks and reloads it.

Figures: the medians' differences (ms added to a cell), and the kernel's own walk of
the folder before each cell.

    .venv/bin/python benchmarks/file_sync.py [--cells N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

_CELL = "import mod00\nmod00.VALUE"


def _project(folder: Path) -> None:
    for i in range(40):
        body = "".join(f"def f{j}(x):\n    return x + {j}\n\n" for j in range(40))
        (folder / f"mod{i:02d}.py").write_text(f"VALUE = {i}\n\n{body}")
    for i in range(8):
        (folder / f"config{i}.yaml").write_text("".join(f"key{j}: {j}\n" for j in range(50)))
    (folder / "data.csv").write_text("".join(f"{j},{j * 2}\n" for j in range(2000)))
    (folder / "README.md").write_text("# a project\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", type=int, default=60, help="timed cells per side and case")
    args = parser.parse_args()
    from _common import embedded_ray, emit, peer_first, quiet

    import rtnb
    from rtnb.driver.ranks._folder_sync import FolderSync, kernel_roots

    folder = Path(tempfile.mkdtemp(prefix="rtnb-bench-files-"))
    _project(folder)
    assert sum(1 for _ in folder.iterdir()) == 50
    os.chdir(folder)
    embedded_ray()
    runs = tempfile.mkdtemp(prefix="rtnb-bench-runs-")
    common = dict(workers=2, cpus_per_worker=0.5, storage=runs)
    synced = rtnb.Session(files="ship", name="synced", **common).start()
    plain = rtnb.Session(files="off", name="plain", **common).start()
    for session in (synced, plain):
        for _ in range(10):
            session.run(_CELL, output=quiet)

    counter = [0]

    def edit() -> None:
        counter[0] += 1
        text = (folder / "mod00.py").read_text().splitlines(True)
        (folder / "mod00.py").write_text(f"VALUE = {counter[0]}\n" + "".join(text[1:]))

    def timed(session, before=None) -> float:
        if before is not None:
            before()
        t0 = time.perf_counter()
        value = session.run(_CELL, output=quiet)
        took = time.perf_counter() - t0
        if before is not None and session is synced:
            assert set(dict(value).values()) == {counter[0]}, "the edit reached the ranks"
        return took

    edit()
    timed(synced, edit)  # the first reload imports IPython's autoreload on the ranks
    cases = {"unchanged": None, "changed": edit}
    samples: dict[str, dict[str, list[float]]] = {c: {"synced": [], "plain": []} for c in cases}
    block = 10
    sides = [("plain", plain), ("synced", synced)]
    if not peer_first():  # run.py alternates which side goes first each round
        sides.reverse()
    while len(samples["changed"]["synced"]) < args.cells:
        for case, before in cases.items():
            for name, session in sides:
                for _ in range(block):
                    samples[case][name].append(timed(session, before))

    sync = FolderSync(kernel_roots(), {0: ("folder",)}, (), ())
    sync.changes_for([0])
    walks = []
    for _ in range(200):
        t0 = time.perf_counter()
        sync.changes_for([0])
        walks.append(time.perf_counter() - t0)
    synced.stop()
    plain.stop()

    def median_ms(values: list[float]) -> float:
        return statistics.median(values) * 1000

    figures = {
        "unchanged_ms": median_ms(samples["unchanged"]["synced"])
        - median_ms(samples["unchanged"]["plain"]),
        "changed_ms": median_ms(samples["changed"]["synced"])
        - median_ms(samples["changed"]["plain"]),
        "plain_cell_ms": median_ms(samples["unchanged"]["plain"]),
        "walk_ms": median_ms(walks),
    }
    for case in cases:
        print(
            f"{case:9s} cell: synced {median_ms(samples[case]['synced']):.2f} ms, "
            f"without sync {median_ms(samples[case]['plain']):.2f} ms (medians of "
            f"{len(samples[case]['plain'])})"
        )
    print(f"the kernel's walk of 50 files before a cell: {figures['walk_ms']:.2f} ms")
    emit(**figures)


if __name__ == "__main__":
    main()
