"""A sweep's small pieces of data: configs as rank variables and flat columns, JSON
for sweep.json, the mean of the ranks' results, and which sessions are trials."""

from __future__ import annotations

import keyword
from collections.abc import Mapping
from typing import Any

from rtnb.core._context import CONFIG_NAME

__all__ = [
    "mark_trial_session",
    "config_values",
    "constants_of",
    "flat_config",
    "jsonable",
    "mean_of_ranks",
    "notebook_sessions",
    "short_text",
]


def constants_of(space: Mapping[str, Any]) -> dict[str, Any]:
    """``space`` without its search dimensions (a searcher's suggestion fills them)."""
    from ray.tune.search.sample import Domain

    out: dict[str, Any] = {}
    for key, value in space.items():
        if isinstance(value, Mapping) and "grid_search" not in value:
            out[key] = constants_of(value)
        elif not isinstance(value, Domain) and not (
            isinstance(value, Mapping) and "grid_search" in value
        ):
            out[key] = value
    return out


def short_text(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(flat_config(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_values(config: Mapping[str, Any]) -> dict[str, Any]:
    """The rank variables a trial's config becomes: each key that can be a variable
    (``lambda`` cannot: ``rtnb.get_config()["lambda"]``), and the whole config for
    ``rtnb.get_config()``."""
    values = {
        k: v
        for k, v in config.items()
        if isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k)
    }
    values[CONFIG_NAME] = dict(config)
    return values


def jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def mean_of_ranks(per_rank: dict[int, dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over the ranks that reported it."""
    sums: dict[str, list[float]] = {}
    for numbers in per_rank.values():
        for name, value in numbers.items():
            sums.setdefault(name, []).append(value)
    return {name: sum(values) / len(values) for name, values in sums.items()}


# ---- small helpers --------------------------------------------------------------------------
def mark_trial_session(session) -> None:
    """``session`` runs a sweep's trial, not the notebook's own group."""
    session.is_trial = True


def notebook_sessions() -> list:
    """The sessions of this process that have a group, sweeps' trials left out."""
    from rtnb.driver.session import started_sessions

    return [s for s in started_sessions() if not s.is_trial]
