"""Checkpoint save/restore through rtnb vs plain torch.save/torch.load, same disk, one run.

Each of 2 ranks holds a state of ``--mb`` MB (default 150, so ~300 MB in all).
Plain: every rank torch.save()s its state to the storage directory, then
torch.load()s it. rtnb: every rank reports it as a checkpoint (its shard uploaded
and hashed in parallel, the driver commits the manifest), then loads it back
through ``rtnb.get_checkpoint().load_state()`` (files verified against the
manifest first), and once more with ``full_verify=True`` (every byte re-hashed).

Both sides are durable alike: a save is timed from its cell's start until its files
are complete (rtnb: until the driver lists the checkpoint committed, its shards
written by the ranks' upload threads) and a following ``os.sync()`` on every rank
has returned; a load likewise ends with ``os.sync()``. The sides alternate.

    .venv/bin/python benchmarks/checkpoint_io.py [--mb 150]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from _common import embedded_ray, emit, in_order, quiet

    import rtnb

    embedded_ray()
    storage = tempfile.mkdtemp(prefix="rtnb-ckpt-bench-", dir="/tmp")
    session = rtnb.Session(workers=2, storage=storage, name="io").start()
    session.run(
        f"import torch, os, rtnb, torch.distributed as dist\n"
        f"state = {{'w': torch.randn({args.mb} * 1024 * 1024 // 4), 'rank': dist.get_rank()}}\n"
        f"plain_dir = os.path.join({storage!r}, 'plain')\nos.makedirs(plain_dir, exist_ok=True)\n"
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

    plain_save, plain_load, rtnb_save, rtnb_load, rtnb_full = [], [], [], [], []
    step = 0
    for _ in range(args.repeats):
        for side in in_order("rtnb", "plain"):
            if side == "plain":
                plain_save.append(
                    timed(
                        "p = os.path.join(plain_dir, f'rank{dist.get_rank()}.pt')\n"
                        "torch.save(state, p)"
                    )
                )
                plain_load.append(timed("back = torch.load(p, weights_only=True)"))
            else:
                step += 1
                rtnb_save.append(
                    timed(
                        f"rtnb.report({{'step': {step}}}, checkpoint=rtnb.Checkpoint.from_state(state))",
                        committed_step=step,
                    )
                )
                rtnb_load.append(timed("back = rtnb.get_checkpoint().load_state()"))
                rtnb_full.append(timed("back = rtnb.get_checkpoint().load_state(full_verify=True)"))
    checked = session.run(
        "bool(back['w'].equal(state['w'])) if back['rank'] == dist.get_rank() else 'shard of another rank'",
        output=quiet,
    )
    session.stop()
    ps, pl, rs, rl = (statistics.median(x) for x in (plain_save, plain_load, rtnb_save, rtnb_load))
    print(f"checkpoint_io: 2 ranks x {args.mb} MB, local disk, median of {args.repeats}")
    print(
        f"save     rtnb {rs:6.2f} s   plain torch.save {ps:6.2f} s   ratio {rs / ps:.2f}x (goal <= 1.2x)"
    )
    print(
        f"restore  rtnb {rl:6.2f} s   plain torch.load {pl:6.2f} s   ratio {rl / pl:.2f}x (goal <= 1.2x)"
    )
    rf = statistics.median(rtnb_full)
    print(f"restore, every byte re-hashed (full_verify=True) {rf:6.2f} s   ratio {rf / pl:.2f}x")
    print(f"round trip ratio {(rs + rl) / (ps + pl):.2f}x; restored state checked: {dict(checked)}")
    if not all(v is True for v in checked.values()):
        raise SystemExit(f"the restored state differs: {dict(checked)}")
    emit(save_ratio=rs / ps, restore_ratio=rl / pl)


if __name__ == "__main__":
    main()
