"""Stacks and resource samples read without a rank (core/_stacks, core/_resources)."""

from __future__ import annotations


def test_folded_stacks_put_the_one_rank_that_differs_first_and_name_its_cell_line():
    from rtnb.core._stacks import GroupStacks, RankStack, StackFrame

    loader = [
        StackFrame("<rtrain In[5]>", 9, "<module>", "for x, y in loader:"),
        StackFrame("/v/site-packages/torch/utils/data/dataloader.py", 630, "__next__"),
    ]
    reduce = [
        StackFrame("<rtrain In[5]>", 12, "<module>", "dist.all_reduce(t)"),
        StackFrame("/v/site-packages/torch/distributed/distributed_c10d.py", 2950, "all_reduce"),
    ]
    stacks = GroupStacks(
        {
            0: RankStack(0, True, list(loader)),
            1: RankStack(1, True, list(reduce)),
            2: RankStack(2, True, list(loader)),
            3: RankStack(3, True, list(loader)),
        }
    )
    assert stacks.odd_ranks == [1]
    assert stacks.headline() == (
        "rank 1: in all_reduce (torch/distributed/distributed_c10d.py:2950) at cell [5] line 12; "
        "ranks 0,2-3: in __next__ (torch/utils/data/dataloader.py:630) at cell [5] line 9"
    )
    # Every rank alike: nothing is odd; idle ranks say so.
    same = GroupStacks({r: RankStack(r, True, list(loader)) for r in range(3)})
    assert same.odd_ranks == [] and same.headline().startswith("ranks 0-2: in __next__")
    assert GroupStacks({0: RankStack(0, False)}).headline() == "rank 0: no cell running"


def test_py_spy_output_gives_the_cell_threads_stack_outermost_first():
    from rtnb.core._stacks import parse_py_spy

    dump = (
        "Process 4242: ray::RankActor\n"
        "Python v3.11.7 (/usr/bin/python3.11)\n\n"
        'Thread 4242 (idle): "MainThread"\n'
        "    main_loop (ray/_private/worker.py:900)\n"
        'Thread 4250 (active+gil): "rtnb-cell"\n'
        "    sleep (ctypes_helper.py:3)\n"
        "    <module> (<rtrain-cell-4>:3)\n"
        "    execute (rtnb/worker/_runtime.py:280)\n"
        "    _cell_loop (rtnb/worker/_runtime.py:260)\n"
    )
    stack = parse_py_spy(1, dump, pid=4242)
    assert str(stack.method) == "py-spy"
    assert [f.function for f in stack.frames] == ["<module>", "sleep"]
    assert stack.summary() == "in sleep (ctypes_helper.py:3) at cell 4 line 3"
    assert str(parse_py_spy(1, "Process 1: x\n").method) == "none"


def test_memory_that_climbs_every_second_is_flagged_and_memory_that_levels_off_is_not():
    from rtnb.core._resources import ResourceSample, memory_climbing

    mb = 2**20

    def samples(rss):
        return [ResourceSample(float(i), i, 100.0, int(v * mb)) for i, v in enumerate(rss)]

    assert memory_climbing(samples([500 + 10 * i for i in range(20)]))
    # Warm-up growth that then stays flat is a healthy loop.
    assert not memory_climbing(samples([500 + 40 * min(i, 5) for i in range(20)]))
    assert not memory_climbing(samples([500 + i for i in range(20)]))  # 19 MB: noise
    assert not memory_climbing(samples([500 + 10 * i for i in range(10)]))  # too few yet
