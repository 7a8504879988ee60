"""A Ray Train script, back into the notebook (``%rtnb import FILE.py``).

:func:`read_train_script` reads a script that builds a ``TorchTrainer`` (as Ray
Train's examples and an rtnb export do) and makes the cell that runs its training
loop on the live group: the script's imports, functions, classes and constants,
then ``train_loop_per_worker(config)`` with the script's ``train_loop_config``.
What only makes sense in a driver (``ray.init``, building and fitting the trainer,
the ``__main__`` block, the function that does it) is left out and said so. The
script's ``ScalingConfig(num_workers=N)`` is the group size the cell asks for.
Nothing of the script runs in the kernel: it is only parsed.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field

from rtnb.errors import ConfigError

__all__ = ["TrainScript", "read_train_script"]

_TRAINERS = ("TorchTrainer", "DataParallelTrainer", "TransformersTrainer")
_DRIVER_ONLY_CALLS = ("init", "fit", "shutdown")


@dataclass
class TrainScript:
    """The cell that runs a script's training loop, and what it asks of the group."""

    path: str
    code: str
    loop: str  # the training function's name
    workers: int | None  # the script's ScalingConfig(num_workers=...), when a literal
    gpu: bool | None = None
    notes: list[str] = field(default_factory=list)


def read_train_script(path: str) -> TrainScript:
    """Parse ``path`` (see the module docstring); one ConfigError line when it is
    not a script with a training loop."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {path!r}: {exc.strerror or exc}") from None
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        raise ConfigError(
            f"{path!r} is not valid Python (line {exc.lineno}: {exc.msg}): nothing was run"
        ) from None
    notes: list[str] = []
    trainer, scope = _find_trainer(tree)
    functions = {
        n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    loop_name = None
    config_src = None
    workers: int | None = None
    gpu: bool | None = None
    if trainer is not None:
        loop = trainer.args[0] if trainer.args else _keyword(trainer, "train_loop_per_worker")
        if isinstance(loop, ast.Name):
            loop_name = loop.id
        config = _resolve(_keyword(trainer, "train_loop_config"), scope)
        if config is not None:
            config_src = ast.get_source_segment(source, config)
        scaling = _resolve(_keyword(trainer, "scaling_config"), scope)
        if isinstance(scaling, ast.Call):
            workers, gpu = _scaling(scaling, scope, notes)
        if _keyword(trainer, "datasets") is not None:
            notes.append(
                "the script's datasets are built in its driver code: hand them to the ranks "
                "with %rtnb datasets NAME=DATASET first"
            )
    if loop_name is None:
        loop_name = next(
            (n for n in ("train_loop_per_worker", "train_func", "train_loop") if n in functions),
            None,
        )
    if loop_name is None or loop_name not in functions:
        raise ConfigError(
            f"{path!r} has no training loop: no TorchTrainer(train_loop_per_worker, ...) "
            "naming a function of the script, and no function called train_loop_per_worker "
            "or train_func"
        )
    kept, left = _cell_statements(tree, trainer, loop_name)
    notes += [f"left out (driver code): {what}" for what in left]
    body = "\n\n".join(ast.get_source_segment(source, node) or "" for node in kept)
    takes_config = bool(functions[loop_name].args.args or functions[loop_name].args.posonlyargs)
    call = f"{loop_name}({config_src or '{}'})" if takes_config else f"{loop_name}()"
    # The script's own path, as when it runs (an rtnb export finds its inputs by it).
    code = f"__file__ = {path!r}\n\n{body}\n\n{call}\n"
    return TrainScript(path, code, loop_name, workers, gpu, notes)


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _find_trainer(tree: ast.Module) -> tuple[ast.Call | None, list[ast.stmt]]:
    """The first trainer built in the script, and the statements of the innermost
    scope that builds it (where its config's name is assigned)."""
    trainer = next(
        (n for n in ast.walk(tree) if isinstance(n, ast.Call) and _callee(n) in _TRAINERS), None
    )
    if trainer is None:
        return None, tree.body
    scope = tree.body
    # ast.walk goes outside in: the last scope holding it is the innermost.
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and any(
            any(n is trainer for n in ast.walk(statement)) for statement in body
        ):
            scope = body
    return trainer, scope


def _callee(call: ast.Call) -> str:
    func = call.func
    return (
        func.attr
        if isinstance(func, ast.Attribute)
        else func.id
        if isinstance(func, ast.Name)
        else ""
    )


def _resolve(node: ast.expr | None, scope: list[ast.stmt]) -> ast.expr | None:
    """A name's value where the scope assigns it once (``config = {...}``)."""
    if not isinstance(node, ast.Name):
        return node
    values = [
        s.value
        for s in scope
        if isinstance(s, ast.Assign)
        and len(s.targets) == 1
        and isinstance(s.targets[0], ast.Name)
        and s.targets[0].id == node.id
    ]
    return values[-1] if len(values) == 1 else node


def _scaling(
    call: ast.Call, scope: list[ast.stmt], notes: list[str]
) -> tuple[int | None, bool | None]:
    workers = gpu = None
    value = _resolve(_keyword(call, "num_workers"), scope)
    if value is not None:
        try:
            literal = ast.literal_eval(value)
        except ValueError:
            literal = None
        if isinstance(literal, int) and not isinstance(literal, bool):
            workers = literal
        elif isinstance(literal, tuple):
            notes.append(
                f"the script asks for an elastic group {literal}; the group keeps its size"
            )
        else:
            notes.append("the script's num_workers is not a number here; the group keeps its size")
    use_gpu = _keyword(call, "use_gpu")
    if use_gpu is not None:
        try:
            gpu = bool(ast.literal_eval(use_gpu))
        except ValueError:
            gpu = None
    return workers, gpu


def _cell_statements(
    tree: ast.Module, trainer: ast.Call | None, loop_name: str
) -> tuple[list[ast.stmt], list[str]]:
    """The module's statements a rank runs (kept) and the driver's (left out): the
    ``__main__`` block, what builds or fits the trainer (and calls to a function
    that does), ``ray.init``/``shutdown``."""
    kept: list[ast.stmt] = []
    left: list[str] = []
    builders = {
        n.name
        for n in tree.body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and trainer is not None
        and any(node is trainer for node in ast.walk(n))
    }
    # Names the left-out statements bind (the trainer, fit()'s result, a Tuner):
    # a later statement reading one is the driver's too.
    driver_names: set[str] = set()
    for statement in tree.body:
        contains_trainer = trainer is not None and any(n is trainer for n in ast.walk(statement))
        if isinstance(statement, ast.If) and _is_main_guard(statement):
            left.append("the `if __name__ == '__main__':` block")
            continue
        if contains_trainer:
            name = getattr(statement, "name", None)
            left.append(f"{name}() (builds the trainer)" if name else "building the trainer")
        elif isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue  # the module's docstring
        elif (
            _calls_driver(statement)
            or _calls(statement, builders)
            or _reads(statement, driver_names)
        ):
            left.append(f"line {statement.lineno} ({_first_line(statement)})")
        else:
            kept.append(statement)
            continue
        if not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            driver_names |= _bound(statement)
    return kept, left


def _bound(statement: ast.stmt) -> set[str]:
    return {
        node.id
        for node in ast.walk(statement)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
    }


def _reads(statement: ast.stmt, names: set[str]) -> bool:
    return any(
        isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in names
        for node in ast.walk(statement)
    )


def _calls(statement: ast.stmt, names: set[str]) -> bool:
    return any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
        for node in ast.walk(statement)
    )


def _is_main_guard(statement: ast.If) -> bool:
    test = statement.test
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
    )


def _calls_driver(statement: ast.stmt) -> bool:
    for node in ast.walk(statement):
        if isinstance(node, ast.Call):
            name = _callee(node)
            if (
                name in _TRAINERS
                or name in ("ScalingConfig", "RunConfig")
                or (
                    name in _DRIVER_ONLY_CALLS
                    and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "ray"
                )
            ):
                return True
    return False


def _first_line(statement: ast.stmt) -> str:
    text = ast.unparse(statement).splitlines()[0]
    return text if len(text) <= 60 else text[:57] + "..."
