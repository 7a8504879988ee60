"""A package's face that loads lazily: each public name is imported from the module
that defines it on first use (PEP 562), so importing one module of a package never
loads the rest (a rank that calls ``rtnb.report`` holds no driver code; the server
extension that imports ``rtnb.driver.cluster._warm_client`` does not load the session and Tune)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_face"]


def lazy_face(package: dict[str, Any], exports: dict[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of a package whose globals are ``package``: a name of
    ``exports`` (name -> defining module) is imported once and kept in the globals;
    any other name is an AttributeError, so ``from pkg import submodule`` still
    imports the submodule."""
    owner = package["__name__"]

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module hook's own name
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {owner!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        package[name] = value  # later lookups skip this hook
        return value

    return __getattr__
