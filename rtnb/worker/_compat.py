"""Makes code written for Ray Train's ``train_loop_per_worker`` run unchanged in a cell.

Inside a rank, ``ray.train.report/get_context/get_checkpoint/get_dataset_shard``,
``ray.train.torch.prepare_model/prepare_data_loader/get_device`` and
``ray.train.huggingface.transformers.prepare_trainer/RayTrainReportCallback`` and a Tune
function trainable's ``ray.tune.report/get_checkpoint`` are pointed at rtnb's versions;
``ray.train.lightning``'s strategies and environment run as Ray ships them, on those
names, and its ``RayTrainReportCallback`` is rtnb's (``_lightning``: every step's logs
too). The patch is applied when the user's code imports those modules (an import
hook), because importing ``ray.train.torch`` costs ~3 s that a rank that never uses
it should not pay at start-up; for the same reason ``ray.train.torch``,
``.lightning`` and ``.huggingface.transformers`` are attributes that import
themselves on first use, as they are there already on a Ray Train worker.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

__all__ = ["install_ray_train_aliases", "remove_ray_train_aliases"]


def _set(module, name: str, value) -> None:
    """``module.name = value``, remembering Ray's own for remove_ray_train_aliases."""
    _ORIGINALS.setdefault((module.__name__, name), getattr(module, name, _ABSENT))
    setattr(module, name, value)


_ABSENT = object()
_ORIGINALS: dict[tuple[str, str], object] = {}


def _lazy_submodules(*names: str):
    """A patch that makes ``module.NAME`` import ``module.NAME`` on first use for each
    of ``names`` (PEP 562), as on a Ray Train worker, where TorchTrainer has imported
    them already: ``from ray import train`` then ``train.torch.prepare_model(...)``, the
    form of Ray's own examples. A cell that never touches one does not pay its import."""

    def patch(module) -> None:
        inner = getattr(module, "__getattr__", None)

        def __getattr__(name: str):
            if name in names:
                return importlib.import_module(f"{module.__name__}.{name}")
            if inner is not None:
                return inner(name)
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")

        _set(module, "__getattr__", __getattr__)

    return patch


_TRAIN_SUBMODULES = _lazy_submodules("torch", "lightning", "huggingface")


def _patch_train(module) -> None:
    from rtnb.worker import _api as _train

    for name in ("report", "get_context", "get_checkpoint", "get_dataset_shard"):
        _set(module, name, getattr(_train, name))
    _TRAIN_SUBMODULES(module)


def _patch_train_torch(module) -> None:
    from rtnb.worker import _api as _train

    for name in ("prepare_model", "prepare_data_loader", "get_device"):
        _set(module, name, getattr(_train, name))
    if hasattr(module, "get_devices"):
        _set(module, "get_devices", _train.get_devices)


def _patch_train_transformers(module) -> None:
    # Imported only when the cell imports Ray Train's transformers module, which
    # imports transformers itself: rtnb's versions cost nothing more then.
    from rtnb.worker import _hf

    _set(module, "prepare_trainer", _hf.prepare_trainer)
    _set(module, "RayTrainReportCallback", _hf.RayTrainReportCallback)


def _patch_train_lightning(module) -> None:
    # Ray's Lightning strategies ask ``ray.train.torch.get_device()`` through the
    # attribute, which exists once that module is imported (in a Ray Train worker,
    # TorchTrainer has done so): import it, patched, with Lightning's own import.
    importlib.import_module("ray.train.torch")
    from rtnb.worker import _lightning

    _set(module, "RayTrainReportCallback", _lightning.RayTrainReportCallback)


def _patch_tune(module) -> None:
    # A Tune function trainable's own names: its body runs as a sweep's trial cell.
    from rtnb.worker import _api as _train

    for name in ("report", "get_checkpoint"):
        _set(module, name, getattr(_train, name))


_PATCHES = {
    "ray.train": _patch_train,
    "ray.tune": _patch_tune,
    "ray.train.torch": _patch_train_torch,
    "ray.train.huggingface": _lazy_submodules("transformers"),
    "ray.train.huggingface.transformers": _patch_train_transformers,
    "ray.train.lightning": _patch_train_lightning,
}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner, patch) -> None:
        self._inner = inner
        self._patch = patch

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        self._patch(module)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def install_ray_train_aliases() -> None:
    for name, patch in _PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def remove_ray_train_aliases() -> None:
    """Ray Train's own names again (local mode ends: the kernel is no rank any more)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PatchOnImport)]
    for (module_name, name), original in list(_ORIGINALS.items()):
        module = sys.modules.get(module_name)
        if module is None:
            continue
        if original is _ABSENT:
            module.__dict__.pop(name, None)
        else:
            setattr(module, name, original)
    _ORIGINALS.clear()
