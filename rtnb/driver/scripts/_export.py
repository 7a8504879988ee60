"""A notebook's training, out as a Ray Train script (``%rtnb export``).

:func:`export_script` turns a run's journal into a standalone ``TorchTrainer``
script: the cells that built the ranks' state (the journal's replay plan, in order)
become the body of ``train_loop_per_worker``, the values pushed from the notebook
its ``config``, the Datasets handed over its ``datasets``, and the session's
options its ``ScalingConfig``/``RunConfig``. rtnb's names in the cells become Ray
Train's (:func:`to_ray_train`); rtnb's two conveniences that Ray Train lacks
(``Checkpoint.from_state`` and ``checkpoint.load_state()``) become two small
functions written into the script, in rtnb's file layout, so a checkpoint the script
saves loads in rtnb and the other way round. The script never imports rtnb.

Values that Python cannot write as literals (a tensor, a function) and Datasets'
lineage go in a file beside the script (``NAME.inputs.pkl``), loaded by it.
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import pickle
import textwrap
from dataclasses import dataclass, field
from typing import Any

from rtnb.core._context import CONFIG_NAME
from rtnb.driver.cluster import DATA_CPUS
from rtnb.storage._journal import EntryKind, Journal, JournalEntry

__all__ = [
    "EXPORT_MARK",
    "ExportedScript",
    "export_run",
    "export_script",
    "to_ray_train",
    "write_export",
]

# The first line of every exported script: an export overwrites only its own kind.
EXPORT_MARK = "exported by rtnb as a Ray Train script"

# rtnb's in-cell names and the Ray Train names they stand for.
_RAY_NAMES = {
    "report": "ray.train.report",
    "get_context": "ray.train.get_context",
    "get_checkpoint": "ray.train.get_checkpoint",
    "get_dataset_shard": "ray.train.get_dataset_shard",
    "Checkpoint": "ray.train.Checkpoint",
    "prepare_model": "ray.train.torch.prepare_model",
    "prepare_data_loader": "ray.train.torch.prepare_data_loader",
    "get_device": "ray.train.torch.get_device",
    "get_devices": "ray.train.torch.get_devices",
    "prepare_trainer": "ray.train.huggingface.transformers.prepare_trainer",
    "RayTrainReportCallback": "ray.train.huggingface.transformers.RayTrainReportCallback",
}
_GET_CONFIG = f"dict(loop_config.get({CONFIG_NAME!r}, loop_config))"
_FROM_STATE = "checkpoint_from_state"
_LOAD_STATE = "load_state"
_PREPARE_FSDP = "prepare_model_fsdp"
_GET_CHECKPOINT = "get_checkpoint"

_HELPERS = {
    _FROM_STATE: '''
_checkpoint_directories: list = []


def _remove_checkpoint_directories() -> None:
    import shutil

    while _checkpoint_directories:
        shutil.rmtree(_checkpoint_directories.pop(), ignore_errors=True)


def checkpoint_from_state(state: dict) -> ray.train.Checkpoint:
    """rtnb's Checkpoint.from_state: ``state`` saved with torch.save as this rank's
    file (rtnb's layout: state-rank<R>.pt) in a new directory, as a Checkpoint.
    The directory of the call before is removed: ray.train.report has copied it to
    the run's storage by now, and a long run would otherwise fill the disk."""
    import atexit
    import tempfile

    import torch

    _remove_checkpoint_directories()
    atexit.unregister(_remove_checkpoint_directories)  # one exit handler, however many calls
    atexit.register(_remove_checkpoint_directories)
    directory = tempfile.mkdtemp(prefix="checkpoint-")
    _checkpoint_directories.append(directory)
    rank = ray.train.get_context().get_world_rank()
    torch.save(state, os.path.join(directory, f"state-rank{rank}.pt"))
    return ray.train.Checkpoint.from_directory(directory)
''',
    _GET_CHECKPOINT: '''
def get_checkpoint():
    """ray.train.get_checkpoint(), else the checkpoint named by --resume-from (a
    folder or URI: one of the notebook's, say). Ray Train 2's TorchTrainer takes no
    resume_from_checkpoint; this is what the loop starts from instead."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None and RESUME_FROM:
        checkpoint = ray.train.Checkpoint(RESUME_FROM)
    return checkpoint
''',
    _PREPARE_FSDP: '''
def prepare_model_fsdp(model, move_to_device=True, parallel_strategy="fsdp",
                       parallel_strategy_kwargs=None):
    """rtnb's prepare_model(parallel_strategy="fsdp"): FSDP2's fully_shard on the model,
    over a mesh of every rank. Ray Train's "fsdp" is FSDP1's wrapper, whose sharded
    state is laid out otherwise: this keeps the notebook's sharding, so the script
    and the notebook load each other's DCP checkpoints."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = ray.train.torch.get_device()
    if move_to_device:
        model = model.to(device)
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return model
    kwargs = dict(parallel_strategy_kwargs or {})
    kwargs.setdefault("mesh", init_device_mesh(device.type, (dist.get_world_size(),)))
    return fully_shard(model, **kwargs)
''',
    _LOAD_STATE: '''
def load_state(checkpoint: ray.train.Checkpoint, map_location="cpu"):
    """rtnb's checkpoint.load_state(): this rank's saved state (rank 0's where this
    rank saved none, e.g. after a scale-up)."""
    import torch

    rank = ray.train.get_context().get_world_rank()
    with checkpoint.as_directory() as directory:
        path = os.path.join(directory, f"state-rank{rank}.pt")
        if not os.path.exists(path):
            path = os.path.join(directory, "state-rank0.pt")
        return torch.load(path, map_location=map_location, weights_only=False)
''',
}


@dataclass
class ExportedScript:
    """The script's text, what goes in its inputs file (None: nothing), and what the
    notebook did that the script leaves out or changes, one line each; once written,
    the files' paths."""

    text: str
    inputs: dict[str, Any] | None
    notes: list[str] = field(default_factory=list)
    cells: int = 0
    path: str = ""
    inputs_path: str | None = None

    def __str__(self) -> str:
        lines = [
            f"rtnb: {self.cells} cell{'s' if self.cells != 1 else ''} exported to {self.path}"
            + (f" (values and dataset lineage in {self.inputs_path})" if self.inputs_path else "")
        ]
        lines += [f"rtnb: {note}" for note in self.notes]
        return "\n".join(lines)


def to_ray_train(
    code: str, known: tuple[set[str], dict[str, str]] | None = None
) -> tuple[str, set[str]]:
    """``code`` with rtnb's in-cell names written as Ray Train's, and the helper
    functions it then needs (``checkpoint_from_state``, ``load_state``). Only names
    are replaced (by their positions in the parsed code): comments, layout and
    everything else stay as written. ``known``: the names earlier cells bound to
    rtnb (a cell uses the ``import rtnb`` of an earlier one), added to here."""
    helpers: set[str] = set()
    modules, names = known if known is not None else ({"rtnb"}, {})
    modules.add("rtnb")
    seen = _rtnb_aliases(ast.parse(code))
    modules |= seen[0]
    names.update(seen[1])
    aliases = (modules, names)
    rewrites = (
        _rewrite_load_state,
        _rewrite_from_state,
        _rewrite_fsdp,
        _rewrite_names,
        _rewrite_imports,
    )
    for rewrite in rewrites:
        while True:
            tree = ast.parse(code)
            edits = rewrite(tree, code, aliases, helpers)
            if not edits:
                break
            code = _apply(code, edits)
    return code, helpers


# ---- the rewrites (each returns non-overlapping (start, end, text) edits) -------------
def _rtnb_aliases(tree: ast.AST) -> tuple[set[str], dict[str, str]]:
    """Names bound to the rtnb module, and names imported from it (local → rtnb's)."""
    modules, names = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "rtnb":
                    modules.add(alias.asname or "rtnb")
        elif isinstance(node, ast.ImportFrom) and node.module == "rtnb" and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = alias.name
    return modules, names


def _is_rtnb(node: ast.AST, aliases, name: str | None = None) -> bool:
    """``node`` is ``rtnb.NAME`` (or the name imported from rtnb as it)."""
    modules, names = aliases
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id in modules and (name is None or node.attr == name)
    if isinstance(node, ast.Name) and node.id in names:
        return name is None or names[node.id] == name
    return False


def _rewrite_load_state(tree, code, aliases, helpers) -> list:
    edits = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "load_state"
            and not _is_rtnb(node.func.value, aliases)
        ):
            owner = ast.get_source_segment(code, node.func.value)
            args = [ast.get_source_segment(code, a) for a in (*node.args, *node.keywords)]
            edits.append((node, f"{_LOAD_STATE}({', '.join([owner, *args])})"))
            helpers.add(_LOAD_STATE)
    return _outermost(code, edits)


def _rewrite_from_state(tree, code, aliases, helpers) -> list:
    edits = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "from_state"
            and _is_rtnb(node.value, aliases, "Checkpoint")
        ):
            edits.append((node, _FROM_STATE))
            helpers.add(_FROM_STATE)
    return _outermost(code, edits)


def _rewrite_fsdp(tree, code, aliases, helpers) -> list:
    edits = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and _is_rtnb(node.func, aliases, "prepare_model")
            and _strategy(node) == "fsdp"
        ):
            edits.append((node.func, _PREPARE_FSDP))
            helpers.add(_PREPARE_FSDP)
    return _outermost(code, edits)


def _strategy(call: ast.Call) -> Any:
    """The literal ``parallel_strategy`` of a prepare_model call ("ddp" when unsaid)."""
    given = next((k.value for k in call.keywords if k.arg == "parallel_strategy"), None)
    if given is None and len(call.args) >= 3:
        given = call.args[2]
    if given is None:
        return "ddp"
    return given.value if isinstance(given, ast.Constant) else None


def _rewrite_names(tree, code, aliases, helpers) -> list:
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_rtnb(node.func, aliases, "get_config"):
            # Ray Train hands the config to train_loop_per_worker: the loop's argument
            # (a sweep trial's config was pushed whole, under rtnb's name for it).
            edits.append((node, _GET_CONFIG))
        elif isinstance(node, ast.Attribute) and _is_rtnb(node, aliases, "get_checkpoint"):
            edits.append((node, _GET_CHECKPOINT))
            helpers.add(_GET_CHECKPOINT)
        elif isinstance(node, ast.Attribute) and _is_rtnb(node, aliases):
            if node.attr in _RAY_NAMES:
                edits.append((node, _RAY_NAMES[node.attr]))
    return _outermost(code, edits)


def _rewrite_imports(tree, code, aliases, helpers) -> list:
    edits = []
    for node in tree.body if isinstance(tree, ast.Module) else []:
        for statement in ast.walk(node):
            if isinstance(statement, ast.Import) and any(a.name == "rtnb" for a in statement.names):
                kept = [
                    f"{a.name} as {a.asname}" if a.asname else a.name
                    for a in statement.names
                    if a.name != "rtnb"
                ]
                text = "import ray.train, ray.train.torch"
                if kept:
                    text = f"import {', '.join(kept)}; {text}"
                edits.append((statement, text))
            elif isinstance(statement, ast.ImportFrom) and statement.module == "rtnb":
                by_module: dict[str, list[str]] = {}
                for alias in statement.names:
                    target = _RAY_NAMES.get(alias.name)
                    if target is None:
                        continue
                    module, name = target.rsplit(".", 1)
                    by_module.setdefault(module, []).append(
                        name if alias.asname in (None, name) else f"{name} as {alias.asname}"
                    )
                text = "; ".join(f"from {m} import {', '.join(n)}" for m, n in by_module.items())
                edits.append((statement, text or "pass  # (rtnb names with no Ray Train twin)"))
    return _outermost(code, edits)


def _outermost(code: str, edits: list[tuple[ast.AST, str]]) -> list[tuple[int, int, str]]:
    """Edits as character spans, dropping any inside another (done on the next pass)."""
    spans = sorted(
        ((*_span(code, node), text) for node, text in edits), key=lambda e: (e[0], -e[1])
    )
    kept: list[tuple[int, int, str]] = []
    for start, end, text in spans:
        if kept and start < kept[-1][1]:
            continue
        kept.append((start, end, text))
    return kept


def _span(code: str, node: ast.AST) -> tuple[int, int]:
    lines = code.splitlines(keepends=True)

    def offset(line: int, col: int) -> int:
        # ast's columns count UTF-8 bytes
        before = sum(len(text) for text in lines[: line - 1])
        return before + len(lines[line - 1].encode()[:col].decode(errors="ignore"))

    return offset(node.lineno, node.col_offset), offset(node.end_lineno, node.end_col_offset)


def _apply(code: str, edits: list[tuple[int, int, str]]) -> str:
    for start, end, text in sorted(edits, reverse=True):
        code = code[:start] + text + code[end:]
    return code


# ---- the script ------------------------------------------------------------------------
def export_script(
    journal: Journal,
    config: dict[str, Any],
    run_name: str,
    storage_path: str,
    inputs_name: str,
    script_name: str,
) -> ExportedScript:
    """The run's training as a TorchTrainer script (see the module docstring).
    ``config`` is the run's options as run.json records them."""
    body: list[str] = []
    notes: list[str] = []
    helpers: set[str] = set()
    loop_config: dict[str, str] = {}  # key → the Python expression of its value
    inputs: dict[str, Any] = {}
    datasets: dict[str, str] = {}
    datasets_to_split: list[str] | str = "all"
    cells = 0
    known: tuple[set[str], dict[str, str]] = ({"rtnb"}, {})  # rtnb's names, cell to cell
    for step in journal.replay_plan():
        entry = step.entry
        if step.skipped:
            notes.append(f"{_name(entry)} left out: {step.skipped}")
            body.append(f"# {_name(entry)} left out: {step.skipped}")
            continue
        if entry.kind is EntryKind.PUSH:
            values = _values(journal, entry)
            lines = []
            for name in entry.names:
                key = _unique(name, loop_config)
                loop_config[key] = _literal_or_input(values[name], key, inputs)
                lines.append(f"{name} = loop_config[{key!r}]")
            body.append(_on_ranks(entry, "\n".join(lines), f"# pushed: {', '.join(entry.names)}"))
            continue
        if entry.kind is EntryKind.DATASETS:
            record = pickle.loads(journal.read_values(entry))
            datasets_to_split = record.datasets_to_split
            for name in record.names:
                lineage = record.lineage.get(name)
                if lineage is None:
                    datasets[name] = "None  # TODO: build it here (made from the notebook's memory)"
                    notes.append(
                        f"dataset {name!r} was made from the notebook's memory: build it in the script"
                    )
                else:
                    inputs[f"dataset:{name}"] = lineage
                    datasets[name] = (
                        f"ray.data.Dataset.deserialize_lineage(INPUTS['dataset:{name}'])"
                    )
            continue
        if entry.values is not None:
            notes.append(f"{_name(entry)} left out: a function sent by value (Session.run(fn))")
            body.append(f"# {_name(entry)} left out: a function sent by value (Session.run(fn))")
            continue
        code, needed = to_ray_train((entry.code or "").lstrip("\n").rstrip() or "pass", known)
        helpers |= needed
        body.append(_on_ranks(entry, code, f"# ---- {_name(entry)}"))
        cells += 1
    if not cells:
        from rtnb.errors import SessionError

        raise SessionError(
            f"run {run_name!r} has no cell that ran to its end to export: run the training "
            "cells first (failed, interrupted and --once cells are left out)"
        )
    text = _script(
        body,
        helpers,
        loop_config,
        datasets,
        datasets_to_split,
        config,
        run_name,
        storage_path,
        inputs_name if inputs else None,
        script_name,
    )
    return ExportedScript(text, inputs or None, notes, cells)


def _name(entry: JournalEntry) -> str:
    return f"cell {entry.label or entry.cell_id}"


def _values(journal: Journal, entry: JournalEntry) -> dict[str, Any]:
    from ray import cloudpickle

    return cloudpickle.loads(journal.read_values(entry))


def _unique(name: str, taken: dict[str, str]) -> str:
    key, n = name, 1
    while key in taken:
        n += 1
        key = f"{name}_{n}"
    return key


def _literal_or_input(value: Any, key: str, inputs: dict[str, Any]) -> str:
    """``value`` as Python source if it reads back equal, else from the inputs file."""
    try:
        text = repr(value)
        if ast.literal_eval(text) == value and type(ast.literal_eval(text)) is type(value):
            return text
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
        pass
    inputs[f"value:{key}"] = value
    return f"INPUTS['value:{key}']"


def _on_ranks(entry: JournalEntry, code: str, heading: str) -> str:
    """``code`` under its heading, only on the ranks it ran on when not on all."""
    if entry.ranks is None:
        return f"{heading}\n{code}"
    ranks = ", ".join(map(str, entry.ranks)) + ("," if len(entry.ranks) == 1 else "")
    return (
        f"{heading} (ranks {', '.join(map(str, entry.ranks))} only)\n"
        f"if ray.train.get_context().get_world_rank() in ({ranks}):\n"
        + textwrap.indent(code, "    ")
    )


def _script(
    body,
    helpers,
    loop_config,
    datasets,
    datasets_to_split,
    config,
    run_name,
    storage_path,
    inputs_name,
    script_name,
) -> str:
    workers = int(config.get("workers") or 0)
    gpu = bool(config.get("gpu"))
    cpus = float(config.get("cpus_per_worker") or 1.0)
    data_note = (
        f"""
It reads Ray Data. Its read and map tasks need a CPU the workers do not hold: on
a Ray this script starts itself (no RAY_ADDRESS) it declares {DATA_CPUS} logical CPU
more than the machine has, as the notebook's own Ray did; without it, workers
holding every CPU leave the pipeline waiting for ever, without a word. On a
cluster of your own, keep a CPU free for them (or lower resources_per_worker).
"""
        if datasets
        else ""
    )
    head = f'''"""Run {run_name!r} of a notebook, {EXPORT_MARK}
({datetime.date.today().isoformat()}).

The cells that built the ranks' state, in the order they ran, are the body of
train_loop_per_worker; the values pushed from the notebook are its loop_config.

    python {script_name}
        Ray Train on the Ray that RAY_ADDRESS names, else on a new local Ray.
    RAY_TRAIN_V2_ENABLED=1 torchrun --nproc-per-node={max(workers, 1)} {script_name}
        torchrun starts the processes; Ray Train runs in its local mode in each
        (Ray Data is not supported there).

As in Ray Train, ray.train.get_checkpoint() is the checkpoint a run was restored
from (None on a fresh start), not the latest one an earlier cell saved as in rtnb.
With --resume-from CHECKPOINT (a folder or URI, e.g. one of the notebook's run's
checkpoints/step-...), the cells' get_checkpoint() starts from that one instead.
{data_note}"""

import argparse
import os

import ray.train
import ray.train.torch
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
'''
    parts = [head]
    if inputs_name is not None:
        parts.append(
            f"""
# Values Python cannot write as literals, and Datasets' lineage: saved beside this file.
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), {inputs_name!r}), "rb") as _f:
    from ray import cloudpickle

    INPUTS = cloudpickle.load(_f)
"""
        )
    if datasets:
        parts.append("\nimport ray.data\n")
    for helper in sorted(helpers):
        parts.append("\n" + _HELPERS[helper])
    parts.append(
        "\n\ndef train_loop_per_worker(loop_config: dict) -> None:\n"
        + textwrap.indent("\n\n".join(body), "    ")
        + "\n"
    )
    config_text = (
        "{" + ", ".join(f"{k!r}: {v}" for k, v in loop_config.items()) + "}"
        if loop_config
        else "{}"
    )
    keep = config.get("keep")
    score = config.get("score")
    checkpoint = [f"num_to_keep={keep!r}"]
    if score:
        order = "max" if config.get("mode") == "max" else "min"
        checkpoint += [f"checkpoint_score_attribute={score!r}", f"checkpoint_score_order={order!r}"]
    data_lines = ""
    if datasets:
        data_lines = (
            "        datasets={"
            + ", ".join(f"{name!r}: {expr}" for name, expr in datasets.items())
            + "},\n"
        )
        if datasets_to_split != "all":
            data_lines += f"        dataset_config=ray.train.DataConfig(datasets_to_split={datasets_to_split!r}),\n"
    workers_text = "0" if workers == 0 else f"0 if UNDER_TORCHRUN else {workers}"
    data_init = (
        '    if not UNDER_TORCHRUN and not os.environ.get("RAY_ADDRESS"):\n'
        f"        ray.init(num_cpus=(os.cpu_count() or 1) + {DATA_CPUS})  # a CPU for Ray Data\n"
        if datasets
        else ""
    )
    parts.append(
        f"""

# Under torchrun the processes are torchrun's: Ray Train then runs in its local mode
# (num_workers=0) and takes the rank and world size from torchrun's environment.
UNDER_TORCHRUN = "TORCHELASTIC_RUN_ID" in os.environ
RESUME_FROM = None

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume-from", help="a checkpoint folder or URI to start from")
    RESUME_FROM = parser.parse_known_args()[0].resume_from
{data_init}    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={config_text},
        scaling_config=ScalingConfig(
            num_workers={workers_text},
            use_gpu={gpu!r},
            resources_per_worker={{"CPU": {cpus!r}}},
            placement_strategy={config.get("strategy") or "PACK"!r},
        ),
        run_config=RunConfig(
            name={run_name + "-export"!r},
            storage_path={storage_path!r},
            failure_config=FailureConfig(max_failures={int(config.get("max_failures") or 0)}),
            checkpoint_config=CheckpointConfig({", ".join(checkpoint)}),
        ),
{data_lines}    )
    result = trainer.fit()
    print(f"final metrics: {{result.metrics}}")
    print(f"checkpoint: {{result.checkpoint}}")
"""
    )
    return "".join(parts)


def export_run(
    storage: str, run: str, path: str, force: bool = False, session=None
) -> ExportedScript:
    """Export run ``run`` of ``storage`` to the script ``path`` (and its inputs file
    beside it, when needed). ``session``: the session holding the run, whose journal
    and options are the newest."""
    import os

    from rtnb.core._redact import redact_uri
    from rtnb.errors import ConfigError
    from rtnb.storage._layout import read_run_record
    from rtnb.storage._rundir import RunDirectory

    if not str(path).endswith(".py"):
        raise ConfigError(f"export writes a Python script: name it FILE.py, got {path!r}")
    path = os.path.abspath(os.path.expanduser(str(path)))
    if session is not None:
        session.journal.flush(timeout=10.0)
        journal, options = session.journal, session.config.to_dict()
    else:
        run_dir = RunDirectory(storage, run)
        record = read_run_record(run_dir)
        if record is None:
            raise ConfigError(
                f"no run {run!r} in {redact_uri(storage)}: `%rtnb runs` lists the runs there"
            )
        journal, options = Journal(run_dir), record.config
    inputs_path = path[: -len(".py")] + ".inputs.pkl"
    shown_storage = redact_uri(storage)
    exported = export_script(
        journal,
        options,
        run,
        shown_storage,
        os.path.basename(inputs_path),
        os.path.basename(path),
    )
    if shown_storage != storage:
        exported.notes.append(
            "the storage URI's credentials were left out of the script: give them to "
            "Ray the way its filesystem reads them (environment, config file)"
        )
    write_export(exported, path, inputs_path, force)
    exported.path = path
    exported.inputs_path = inputs_path if exported.inputs is not None else None
    return exported


def write_export(exported: ExportedScript, path: str, inputs_path: str, force: bool) -> None:
    """Write the script (and its inputs file) atomically; a file there that is not an
    earlier export is kept unless ``force``. One ConfigError line for a path that
    cannot be written."""
    import os

    from rtnb.errors import ConfigError, one_line

    try:
        with open(path, encoding="utf-8") as existing:
            earlier = existing.read(400)
    except FileNotFoundError:
        earlier = None
    except OSError as exc:
        raise ConfigError(f"cannot export to {path!r}: {one_line(exc)}") from None
    if earlier is not None and EXPORT_MARK not in earlier and not force:
        raise ConfigError(
            f"{path!r} exists and is not an rtnb export: choose another file, or pass "
            "--force to replace it"
        )
    files = [(path, exported.text.encode())]
    if exported.inputs is not None:
        from ray import cloudpickle

        files.append((inputs_path, cloudpickle.dumps(exported.inputs)))
    for target, data in files:
        temp = f"{target}.tmp-{os.getpid()}"
        try:
            with open(temp, "wb") as out:
                out.write(data)
            os.replace(temp, target)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise ConfigError(f"cannot export to {target!r}: {one_line(exc)}") from None
