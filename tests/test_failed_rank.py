"""A rank whose cell raises while the others still run: they are stopped, never left
waiting for it (in a collective, for ever). The seeds' Hugging Face loop met this:
one rank failed loading a model the other had, the other waited in DDP's start."""

from __future__ import annotations

import tempfile
import time

import pytest

import rtnb

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_the_other_ranks_stop_at_a_report_and_the_cell_shows_the_failure(lend):
    with rtnb.Session(
        workers=2,
        cpus_per_worker=0.5,
        group_factory=lend,
        stop_grace_s=2.0,
        storage=tempfile.mkdtemp(),
    ) as session:
        session.run("x = 41", output=lambda *a: None)
        seen: list[str] = []
        with pytest.raises(rtnb.CellError) as info:
            session.run(
                "import rtnb, time\n"
                "if rtnb.get_context().world_rank == 1:\n"
                "    raise ValueError('no such file: model.pt')\n"
                "for step in range(100000):\n"
                "    rtnb.report({'loss': 1.0})\n"
                "    time.sleep(0.01)",
                output=lambda rank, stream, text: seen.append(text),
            )
        assert "rank 1" in str(info.value) and "no such file: model.pt" in str(info.value)
        assert "rank(s) 0 stopped after the failure below" in "".join(seen)
        assert session.run("x") == {0: 41, 1: 41}, "the group and its variables are kept"


def test_a_rank_left_in_a_collective_is_freed_within_the_stop_grace(lend):
    with rtnb.Session(
        workers=2,
        cpus_per_worker=0.5,
        group_factory=lend,
        stop_grace_s=1.0,
        storage=tempfile.mkdtemp(),
    ) as session:
        started = time.monotonic()
        with pytest.raises(rtnb.RtnbError) as info:
            session.run(
                "import rtnb, torch.distributed as dist\n"
                "if rtnb.get_context().world_rank == 1:\n"
                "    raise ValueError('boom')\n"
                "dist.barrier()",
                output=lambda *a: None,
            )
        # Without the stop it waited until a --timeout, or for ever; the bound is far
        # above the grace + escalation (about 5 s) so a loaded machine cannot fail it.
        assert time.monotonic() - started < 60
        # The rank's own error, its traceback kept, and what the stop cost the group.
        error = info.value
        assert isinstance(error, rtnb.CellError) and error.ranks == [1], repr(error)
        assert "ValueError: boom" in str(error) and "raise ValueError('boom')" in error.failures[1]
        assert "rank 1 failed (ValueError: boom)" in error.aftermath
        assert "rebuilt with fresh ranks" in error.aftermath
        assert session.run("1 + 1") == {0: 2, 1: 2}, "the group was rebuilt and works"
