"""A Ray Train script, back into the notebook (``%rtnb import FILE.py``).

:func:`read_train_script` reads a script that builds a ``TorchTrainer`` (as Ray
Train's examples and an rtnb export do) and makes the cell that runs its training
loop on the live group: the script's imports, functions, classes and constants,
then ``train_loop_per_worker(config)`` with the script's ``train_loop_config``, as
its driver code would build it: names it reads are worked out from the scope that
builds the trainer (an assignment, the function's parameters as the script's own call
or their defaults give them, an ``argparse`` option's default for ``args.NAME``), or
one line names the value that cannot be. What only makes sense in a driver (``ray.init``, building and fitting the trainer,
the ``__main__`` block, the function that does it) is left out and said so. The
script's ``ScalingConfig(num_workers=N)`` is the group size the cell asks for.
Nothing of the script runs in the kernel: it is only parsed.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import copy
import os
from dataclasses import dataclass, field

from rtnb.core._names import names_bound
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


def read_train_script(path: str, argv: list[str] | None = None) -> TrainScript:
    """Parse ``path`` (see the module docstring); one ConfigError line when it is
    not a script with a training loop. A torchrun script (no trainer, a ``__main__``
    block) runs whole on every rank, with ``argv`` as its command line."""
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
    if trainer is None and any(isinstance(n, ast.If) and _is_main_guard(n) for n in tree.body):
        return _torchrun_script(path, source, tree, list(argv or ()))
    if argv:
        raise ConfigError(
            f"{path!r} builds a TorchTrainer: its config comes from the script, so "
            f"arguments ({' '.join(argv)}) are for a torchrun script; run it without them"
        )
    functions = {
        n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    loop_name = None
    config_src = None
    config_definitions = ""
    workers: int | None = None
    gpu: bool | None = None
    if trainer is not None:
        loop = trainer.args[0] if trainer.args else _keyword(trainer, "train_loop_per_worker")
        if isinstance(loop, ast.Name):
            loop_name = loop.id
        values = _ScriptValues(tree, scope, path)
        config = _resolve(_keyword(trainer, "train_loop_config"), scope)
        if config is not None:
            config_definitions, config_src = values.expression(config, "train_loop_config")
        scaling = _resolve(_keyword(trainer, "scaling_config"), scope)
        if isinstance(scaling, ast.Call):
            workers, gpu = _scaling(scaling, values, notes)
        notes += values.notes
        if _keyword(trainer, "datasets") is not None:
            notes.append(_datasets_note(trainer, scope, source))
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
    if config_definitions:
        body += "\n\n\n# train_loop_config as the script's driver code builds it\n"
        body += config_definitions
    code = f"__file__ = {path!r}\n\n{body}\n\n{call}\n"
    return TrainScript(path, code, loop_name, workers, gpu, notes)


def _torchrun_script(path: str, source: str, tree: ast.Module, argv: list[str]) -> TrainScript:
    """A script torchrun runs: every rank runs it whole as ``__main__`` with
    ``sys.argv`` as torchrun gives it (the script's path, then its arguments), its
    ``init_process_group``/``destroy_process_group`` on the session's group."""
    missing = _missing_positionals(tree, argv)
    if missing:
        usage = " ".join(name.upper() for name in _positionals(tree))
        raise ConfigError(
            f"{os.path.basename(path)} needs its positional argument {missing[0]!r} "
            f"(torchrun ... {os.path.basename(path)} {usage}): "
            f"%rtnb import {path} {usage}"
        )
    code = (
        f"import sys as _rtnb_sys\n_rtnb_sys.argv = {[path, *argv]!r}\n"
        f"__file__ = {path!r}\n\n{source}\n"
    )
    shown = " ".join([os.path.basename(path), *argv])
    return TrainScript(
        path,
        code,
        "__main__",
        None,
        notes=[f"a torchrun script: every rank runs it as `torchrun ... {shown}` would"],
    )


# argparse actions that take no value after their flag.
_NO_VALUE = {"store_true", "store_false", "store_const", "append_const", "count", "help", "version"}


def _argument_calls(tree: ast.Module) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "add_argument"
        and n.args
        and isinstance(n.args[0], ast.Constant)
        and isinstance(n.args[0].value, str)
    ]


def _positionals(tree: ast.Module) -> list[str]:
    """The script's required positional arguments (argparse), in order."""
    names = []
    for call in _argument_calls(tree):
        name = call.args[0].value
        nargs = _keyword(call, "nargs")
        optional = isinstance(nargs, ast.Constant) and nargs.value in ("?", "*")
        if not name.startswith("-") and not optional:
            names.append(name)
    return names


def _missing_positionals(tree: ast.Module, argv: list[str]) -> list[str]:
    """The required positional arguments ``argv`` does not give, as argparse would
    see it (an option's value is not a positional)."""
    flags_without_value = set()
    for call in _argument_calls(tree):
        action = _keyword(call, "action")
        if isinstance(action, ast.Constant) and action.value in _NO_VALUE:
            flags_without_value |= {
                a.value
                for a in call.args
                if isinstance(a, ast.Constant) and isinstance(a.value, str)
            }
    given, i = 0, 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            given += len(argv) - i - 1
            break
        if token.startswith("-") and len(token) > 1 and not _is_number(token):
            if "=" not in token and token not in flags_without_value:
                i += 1  # the option's value
        else:
            given += 1
        i += 1
    return _positionals(tree)[given:]


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _datasets_note(trainer: ast.Call, scope: list[ast.stmt], source: str) -> str:
    """What to hand the ranks before the cell, as exactly as the script says it: the
    datasets' names, what builds each, and which are split (its DataConfig)."""
    given = _resolve(_keyword(trainer, "datasets"), scope)
    if not isinstance(given, ast.Dict) or not all(
        isinstance(k, ast.Constant) and isinstance(k.value, str) for k in given.keys
    ):
        return (
            "the script's datasets are built in its driver code: build them in the notebook "
            "and hand them with %rtnb datasets NAME=DATASET first"
        )
    names = [k.value for k in given.keys]
    built = ", ".join(
        f"{name} = {ast.get_source_segment(source, _resolve(value, scope)) or ast.unparse(value)}"
        for name, value in zip(names, given.values)
    )
    split = ""
    config = _resolve(_keyword(trainer, "dataset_config"), scope)
    chosen = _keyword(config, "datasets_to_split") if isinstance(config, ast.Call) else None
    if chosen is not None:
        with contextlib.suppress(ValueError):
            value = ast.literal_eval(chosen)
            if isinstance(value, (list, tuple)):
                split = f" --split {','.join(value)}" if value else " --split ''"
    pairs = " ".join(f"{name}={name}" for name in names)
    return (
        f"the script hands the ranks {', '.join(names)}, built by its driver code "
        f"({built}): build them in the notebook, then %rtnb datasets {pairs}{split}"
    )


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
    call: ast.Call, values: _ScriptValues, notes: list[str]
) -> tuple[int | None, bool | None]:
    workers = gpu = None
    value = _keyword(call, "num_workers")
    if value is not None:
        literal = values.literal(value)
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
        literal = values.literal(use_gpu)
        gpu = None if literal is None else bool(literal)
    return workers, gpu


class _ScriptValues:
    """The values a script's driver code gives the names its trainer is built from,
    worked out without running it: a name assigned once in the scope that builds the
    trainer, a parameter of the function that builds it (what the script's own call
    passes, an ``argparse`` option's default for ``args.NAME``, else the parameter's
    default)."""

    def __init__(self, tree: ast.Module, scope: list[ast.stmt], path: str) -> None:
        self._tree = tree
        self._scope = scope
        self._path = path
        self._sources: dict[str, str] = {}
        self.notes: list[str] = []
        self._module_names = names_bound(tree)  # what the script defines itself
        self._function = next(
            (
                node
                for node in ast.walk(tree)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body is scope
            ),
            None,
        )

    def _options_filled(self, node: ast.expr) -> ast.expr:
        """``node`` with each ``args.NAME`` of an ``argparse`` option replaced by the
        option's default (the ranks have no command line to parse)."""
        tree = self._tree
        notes = self.notes

        class Fill(ast.NodeTransformer):
            def visit_Attribute(self, attribute: ast.Attribute) -> ast.expr:
                option = _argparse_default(tree, attribute)
                if option is None:
                    return self.generic_visit(attribute)
                note = (
                    f"{ast.unparse(attribute)} = {ast.unparse(option[1])} "
                    f"(the default of {option[0]})"
                )
                if note not in notes:
                    notes.append(note)
                return option[1]

        return ast.fix_missing_locations(Fill().visit(copy.deepcopy(node)))

    def literal(self, node: ast.expr) -> object | None:
        """``node``'s value where it comes to a Python literal, else None."""
        node = self._options_filled(node)
        try:
            names = {name: ast.literal_eval(value) for name, value in self._bindings(node)}
            code = compile(ast.Expression(node), "<script>", "eval")
            # Only the literals above and the expression's own operators: no builtins.
            return eval(code, {"__builtins__": {}}, names)  # noqa: S307
        except Exception:  # noqa: BLE001 - not worked out: the caller says so
            return None

    def expression(self, node: ast.expr, what: str) -> tuple[str, str]:
        """(definitions, expression): source that evaluates ``node`` where the cell
        runs, the names it reads from the driver code bound in a function of their
        own; one ConfigError line naming a value that cannot be worked out."""
        node = self._options_filled(node)
        try:
            bindings = self._bindings(node)
        except LookupError as missing:
            name = missing.args[0]
            raise ConfigError(
                f"{what} in {self._path!r} uses {name!r}, whose value %rtnb import cannot "
                f"work out from the script: give {name} a value there (a default, or an "
                "argparse option's default), or call the training function in a cell "
                "yourself with the config you want"
            ) from None
        text = ast.unparse(node)
        if not bindings:
            return "", text
        for name, value in bindings:
            self.notes.append(f"{what}: {name} = {ast.unparse(value)} ({self._sources[name]})")
        lines = [f"    {name} = {ast.unparse(value)}" for name, value in bindings]
        definitions = "\n".join(["def _script_config():", *lines, f"    return {text}"])
        return definitions, "_script_config()"

    def _bindings(self, node: ast.expr, seen: set[str] | None = None) -> list[tuple[str, ast.expr]]:
        """(name, value) for each name ``node`` reads from the driver code, those a
        value reads first; LookupError(name) for one that cannot be worked out."""
        seen = set() if seen is None else seen
        found: list[tuple[str, ast.expr]] = []
        for name in sorted(_free_names(node) - self._module_names - seen):
            seen.add(name)
            value = self._value_of(name)
            if value is None:
                raise LookupError(name)
            value = self._options_filled(value)
            found += self._bindings(value, seen)
            found.append((name, value))
        return found

    def _value_of(self, name: str) -> ast.expr | None:
        asked = ast.Name(id=name, ctx=ast.Load())
        assigned = _resolve(asked, self._scope)
        if assigned is not asked:
            self._sources[name] = "assigned in the script"
            return assigned
        function = self._function
        if function is None:
            return None
        args = function.args
        params = [a.arg for a in (*args.posonlyargs, *args.args)]
        defaults = dict(zip(params[len(params) - len(args.defaults) :], args.defaults))
        defaults.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d})
        if name not in params and name not in defaults:
            return None
        passed = self._passed(function.name, params, name)
        if passed is not None:
            return passed
        if name in defaults:
            self._sources[name] = f"the default of {function.name}()"
            return defaults[name]
        return None

    def _passed(self, function: str, params: list[str], name: str) -> ast.expr | None:
        """What the script's own call of ``function`` passes for ``name``."""
        call = next(
            (
                node
                for node in ast.walk(self._tree)
                if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == function
            ),
            None,
        )
        if call is None:
            return None
        value = next((k.value for k in call.keywords if k.arg == name), None)
        if value is None and name in params and params.index(name) < len(call.args):
            value = call.args[params.index(name)]
        if value is None:
            return None
        option = _argparse_default(self._tree, value)
        if option is not None:
            self._sources[name] = f"the default of {option[0]}"
            return option[1]
        value = self._options_filled(value)
        if _free_names(value) - self._module_names:
            return None
        self._sources[name] = f"what the script passes to {function}()"
        return value


def _free_names(node: ast.AST) -> set[str]:
    return {
        n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    } - set(dir(builtins))


def _argparse_default(tree: ast.Module, value: ast.expr) -> tuple[str, ast.expr] | None:
    """For ``args.lr``: ("--lr", the default its ``add_argument`` declares)."""
    if not (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name)):
        return None
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and _callee(node) == "add_argument" and node.args):
            continue
        flags = [a.value for a in node.args if isinstance(a, ast.Constant)]
        dest = _keyword(node, "dest")
        named = (
            dest.value
            if isinstance(dest, ast.Constant)
            else next((f.lstrip("-").replace("-", "_") for f in flags if f.startswith("--")), "")
            or (flags[0].lstrip("-").replace("-", "_") if flags else "")
        )
        if named != value.attr:
            continue
        default = _keyword(node, "default")
        action = _keyword(node, "action")
        if default is None and isinstance(action, ast.Constant):
            default = ast.Constant(value=action.value == "store_false")
        return (flags[0] if flags else value.attr), (default or ast.Constant(value=None))
    return None


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
