"""rtnb's lazy stand-in for ``rfc3987_syntax`` (not a part of rtnb's API).

``jsonschema`` imports ``rfc3987_syntax`` when it is installed (JupyterLab's own
dependencies bring it), and that import builds ~35 Earley parsers: 2.4-3 s of
CPU in every process that imports Ray, which Ray does in each of its agents and
workers. This folder is put first on ``PYTHONPATH`` of the processes rtnb starts,
so ``import rfc3987_syntax`` finds this module instead; the real one is imported
on the first call, i.e. only if an IRI is ever validated. Without the real package
this raises ImportError, exactly as the missing package would.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _find_real():
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    return importlib.machinery.PathFinder.find_spec(__name__, path)


_spec = _find_real()
if _spec is None:
    raise ImportError(f"No module named {__name__!r}", name=__name__)

_real = None


def _load():
    global _real
    if _real is None:
        module = importlib.util.module_from_spec(_spec)
        sys.modules[__name__] = module  # its submodules import through the real __path__
        try:
            _spec.loader.exec_module(module)
        except BaseException:
            sys.modules[__name__] = _this
            raise
        _real = module
    return _real


_this = sys.modules[__name__]


def is_valid_syntax(term, value):
    return _load().is_valid_syntax(term, value)


def __getattr__(name):
    return getattr(_load(), name)
