"""The body of a validation task: what runs in its own Ray worker process (or a
thread of the kernel in local mode) on a committed checkpoint."""

from __future__ import annotations

from typing import Any

__all__ = ["validate_checkpoint"]


def validate_checkpoint(fn: bytes, checkpoint: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``fn(checkpoint, **kwargs)``, its metrics as plain numbers (a tensor's value),
    so they can be kept with the checkpoint as JSON."""
    from ray import cloudpickle

    from rtnb.core._reports import portable_metric

    result = cloudpickle.loads(fn)(checkpoint, **kwargs)
    if not isinstance(result, dict):
        raise TypeError(
            f"a validation function returns a dict of metrics, got {type(result).__name__}"
        )
    return {str(name): portable_metric(value) for name, value in result.items()}
