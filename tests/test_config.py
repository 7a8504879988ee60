"""What a session's options accept and refuse, and their defaults (core/_config, the start magic's options)."""

from __future__ import annotations

import pytest

from rtnb.core._config import SessionConfig, parse_ranks
from rtnb.errors import ConfigError


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (None, [0, 1, 2, 3]),
        ("all", [0, 1, 2, 3]),
        ("0,2", [0, 2]),
        ("1-3", [1, 2, 3]),
        (" 3, 0 ", [0, 3]),
    ],
)
def test_parse_ranks_accepts_lists_and_ranges(spec, expected):
    assert parse_ranks(spec, 4) == expected


@pytest.mark.parametrize(
    ("spec", "needle"),
    [("5", "rank 5"), ("a", "list like"), ("3-1", "list like"), ("-1", "list like")],
)
def test_parse_ranks_rejects_bad_input_with_one_clear_line(spec, needle):
    with pytest.raises(ConfigError) as info:
        parse_ranks(spec, 4)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"workers": -1}, "--workers"),
        ({"workers": (3, 2)}, "--workers 3-2"),
        ({"workers": "4"}, "--workers"),
        ({"strategy": "DIAGONAL"}, "--strategy"),
        ({"backend": "mpi"}, "--backend"),
        ({"backend": "nccl"}, "--gpu"),
        ({"address": "http://x:1"}, "--address"),
        ({"address": "nohostport"}, "--address"),
        ({"name": "../evil"}, "--name"),
        ({"mode": "avg"}, "--mode"),
    ],
)
def test_config_rejects_bad_options(options, needle):
    with pytest.raises(ConfigError, match=needle):
        SessionConfig(**options)


def test_config_defaults_match_the_design():
    cfg = SessionConfig()
    assert (cfg.workers, cfg.backend, cfg.strategy, cfg.address) == (2, "gloo", "PACK", None)
    assert SessionConfig(gpu=True).backend == "nccl"
    assert SessionConfig(strategy="spread").strategy == "SPREAD"
    assert SessionConfig(address="ray://127.0.0.1:10001").address == "ray://127.0.0.1:10001"


def test_start_options_are_the_session_configs_fields_with_its_defaults():
    """`%rtnb start`'s flags, their destinations and defaults come from SessionConfig:
    an option added to one and not the other, or a default that differs, fails here;
    and --gpu alone gets nccl (a validated default backend once made it gloo)."""
    import dataclasses

    from IPython.core.magic_arguments import parse_argstring
    from rtnb.magics._parsers import start_args as _start_args

    from rtnb.core._config import declared_defaults

    parser = _start_args.parser
    # The session's own arguments, not its config: how it starts, not what it is.
    own = ("help", "replay", "detached", "idle_timeout_s")
    options = {a.dest: a.default for a in parser._actions if a.dest not in own}
    fields = {f.name for f in dataclasses.fields(SessionConfig)}
    assert set(options) <= fields, set(options) - fields
    declared = declared_defaults()
    assert {name: declared[name] for name in options} == options

    def config(line: str) -> SessionConfig:
        parsed = vars(parse_argstring(_start_args, line))
        for name in own[1:]:
            parsed.pop(name)
        return SessionConfig(**parsed)

    assert config("").backend == "gloo"
    assert config("--gpu").backend == "nccl"
    assert config("--gpu --backend gloo").backend == "gloo"
    assert config("") == SessionConfig()


def test_workers_are_a_size_a_min_max_range_or_local_mode():
    from rtnb.core._config import SessionConfig, parse_workers

    assert parse_workers("4") == 4 and parse_workers("0") == 0
    assert parse_workers("2-4") == (2, 4) and parse_workers(" 3-3 ") == (3, 3)
    for bad, needle in [
        ("3-2", "MIN is more than MAX"),
        ("0-2", "at least 1"),
        ("x", "not a number"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            parse_workers(bad)
    elastic = SessionConfig(workers=(2, 4))
    assert (elastic.workers, elastic.min_workers, elastic.workers_text) == (4, 2, "2-4")
    assert SessionConfig(workers=(3, 3)).elastic is False, "N-N is N"
    local = SessionConfig(workers=0)
    assert local.local and local.world_size == 1 and not local.elastic
