"""Checkpoint save/restore through rtnb vs plain torch.save/torch.load, same disk, one run.

Each of 2 ranks holds a state of ``--mb`` MB (a comma list runs each size in turn:
``60,600``). Plain: every rank torch.save()s its state into a new checkpoint folder
of the storage directory (a kept checkpoint is a new file each time, as Ray Train's
are), then torch.load()s it. rtnb: every rank reports it as a checkpoint (its shard
hashed as torch.save writes it and linked into the run, the driver commits the
manifest), then loads it back through ``rtnb.get_checkpoint().load_state()`` (files
verified against the manifest first), and once more with ``full_verify=True`` (every
byte re-hashed).

Both sides are durable alike: a save is timed from its cell's start until its files
are complete (rtnb: until the driver lists the checkpoint committed) and a following
``os.sync()`` on every rank has returned; a load likewise ends with ``os.sync()``.
The sides alternate. Printed besides, unjudged: plain torch.save overwriting one
file each time (a checkpoint that replaces the last), which ext4 here takes faster
than a new file of the same size (its truncated blocks' pages are reused).

    .venv/bin/python benchmarks/checkpoint_io.py [--mb 60,600] [--repeats 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", default="150", help="MB of state a rank; a comma list")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from _common import embedded_ray, emit, in_order, quiet

    import rtnb

    embedded_ray()
    storage = tempfile.mkdtemp(prefix="rtnb-ckpt-bench-")
    session = rtnb.Session(workers=2, storage=storage, name="io").start()
    session.run(
        f"import torch, os, rtnb, torch.distributed as dist\n"
        f"plain_dir = os.path.join({storage!r}, 'plain')\n"
        "pass",
        output=quiet,
    )

    def timed(code: str, *, committed_step: int | None = None) -> float:
        """The cell, then (rtnb) until the driver lists the checkpoint committed, then
        os.sync() on every rank: the same durability for both sides."""
        t0 = time.perf_counter()
        session.run(code, output=quiet)
        while committed_step is not None:
            latest = session.checkpoints.latest()
            if latest is not None and latest.step == committed_step:
                break
            time.sleep(0.005)
        session.run("os.sync()", output=quiet)
        return time.perf_counter() - t0

    figures = {}
    step = 0
    for mb in (int(v) for v in args.mb.split(",")):
        session.run(
            f"state = {{'w': torch.randn({mb} * 1024 * 1024 // 4), 'rank': dist.get_rank()}}",
            output=quiet,
        )
        plain_save, plain_over, plain_load, rtnb_save, rtnb_load, rtnb_full = ([] for _ in range(6))
        for _ in range(args.repeats):
            for side in in_order("rtnb", "plain"):
                step += 1
                if side == "plain":
                    plain_save.append(
                        timed(
                            f"folder = os.path.join(plain_dir, 'checkpoint_{step:06d}')\n"
                            "os.makedirs(folder, exist_ok=True)\n"
                            "p = os.path.join(folder, f'rank{dist.get_rank()}.pt')\n"
                            "torch.save(state, p)"
                        )
                    )
                    plain_load.append(timed("back = torch.load(p, weights_only=True)"))
                    plain_over.append(
                        timed(
                            "torch.save(state, os.path.join(plain_dir, f'over{dist.get_rank()}.pt'))"
                        )
                    )
                else:
                    rtnb_save.append(
                        timed(
                            f"rtnb.report({{'step': {step}}}, checkpoint=rtnb.Checkpoint.from_state(state))",
                            committed_step=step,
                        )
                    )
                    rtnb_load.append(timed("back = rtnb.get_checkpoint().load_state()"))
                    rtnb_full.append(
                        timed("back = rtnb.get_checkpoint().load_state(full_verify=True)")
                    )
        checked = session.run(
            "bool(back['w'].equal(state['w'])) if back['rank'] == dist.get_rank() else 'shard of another rank'",
            output=quiet,
        )
        if not all(v is True for v in checked.values()):
            raise SystemExit(f"the restored state differs: {dict(checked)}")
        ps, po, pl, rs, rl, rf = (
            statistics.median(x)
            for x in (plain_save, plain_over, plain_load, rtnb_save, rtnb_load, rtnb_full)
        )
        print(f"checkpoint_io: 2 ranks x {mb} MB, local disk, median of {args.repeats}")
        print(
            f"  save     rtnb {rs:6.2f} s   plain torch.save to a new file {ps:6.2f} s   "
            f"ratio {rs / ps:.2f}x (goal <= 1.2x)"
        )
        print(
            f"           (plain torch.save overwriting one file {po:6.2f} s: "
            f"rtnb {rs / po:.2f}x of it, unjudged)"
        )
        print(
            f"  restore  rtnb {rl:6.2f} s   plain torch.load {pl:6.2f} s   "
            f"ratio {rl / pl:.2f}x (goal <= 1.2x)"
        )
        print(
            f"  restore, every byte re-hashed (full_verify=True) {rf:6.2f} s   ratio {rf / pl:.2f}x"
        )
        figures.update(
            {
                f"save_ratio_{mb}": rs / ps,
                f"restore_ratio_{mb}": rl / pl,
                f"save_over_ratio_{mb}": rs / po,
            }
        )
        session.run("del state, back", output=quiet)
    session.stop()
    shutil.rmtree(storage, ignore_errors=True)  # GBs at 600 MB a rank
    emit(**figures)


if __name__ == "__main__":
    main()
