"""The names a piece of Python code binds in the namespace it runs in.

A ``%%rtrain`` cell runs in a rank's namespace: what it binds at its top level (an
assignment, a ``for`` or ``with`` target, an import, a ``def`` or ``class``, also
inside a top-level ``if``/``try``/loop) stays there for later cells, and what it
binds inside a function or class body does not.

In [1]: names_bound("import torch\\nfor i in range(3):\\n    x = i\\ndef f():\\n    y = 1")
Out[1]: {'torch', 'i', 'x', 'f'}
"""

from __future__ import annotations

import ast

__all__ = ["names_bound"]

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def names_bound(code: str | ast.Module) -> set[str]:
    """The names ``code`` binds at module level; empty when it does not parse (a cell
    with IPython syntax binds nothing we can read)."""
    if isinstance(code, str):
        try:
            code = ast.parse(code)
        except SyntaxError:
            return set()
    names: set[str] = set()
    pending: list[ast.AST] = list(code.body)
    while pending:
        node = pending.pop()
        if isinstance(node, _SCOPES):
            if not isinstance(node, ast.Lambda):
                names.add(node.name)  # the def binds its name; its body is its own scope
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        if isinstance(node, _COMPREHENSIONS):
            # Only a walrus inside a comprehension binds outside it.
            pending.extend(n for n in ast.walk(node) if isinstance(n, ast.NamedExpr))
            continue
        pending.extend(ast.iter_child_nodes(node))
    return names
