"""Ray Tune's pieces as a sweep uses them: its variant generator or Searcher for each
trial's config, a stand-in for the controller its schedulers call, and the checks of
what the user passed (training code, search space, scheduler, searcher, metric)."""

from __future__ import annotations

import ast
import copy
import inspect
import math
import textwrap
from collections.abc import Callable, Mapping
from typing import Any

from rtnb.driver.cells import check_syntax
from rtnb.driver.tuning._values import constants_of, flat_config, short_text
from rtnb.errors import (
    CellError,
    ConfigError,
)

__all__ = [
    "Suggestions",
    "TuneController",
    "check_reports",
    "check_scheduler",
    "check_searcher",
    "check_space",
    "check_train",
    "metric_and_mode",
]


# Schedulers that pause trials and resume them later (from a checkpoint, perhaps
# with another trial's weights): rtnb's trials run to their end or stop early.
_PAUSING = ("HyperBandScheduler", "PopulationBasedTraining", "ResourceChangingScheduler")


# Search-space objects of other libraries, which Tune does not sample.
_FOREIGN_SPACES = ("optuna", "hyperopt", "skopt", "nevergrad", "ConfigSpace", "scipy", "ax")


# ---- the search: Tune's pieces ------------------------------------------------------------
class Suggestions:
    """The next trial's config, from Tune's variant generator (grid and random
    search, ``num_samples`` times over) or from a Tune ``Searcher``."""

    def __init__(self, param_space: dict, num_samples: int, searcher: Any) -> None:
        self.param_space = param_space
        self.num_samples = num_samples
        self.searcher = searcher
        self.made = 0
        self.finished = False
        self._variants = None if searcher is not None else self._generate()

    def _generate(self):
        from ray.tune.search.variant_generator import format_vars, generate_variants

        for _ in range(self.num_samples):
            for resolved, config in generate_variants(copy.deepcopy(self.param_space)):
                yield config, format_vars(resolved)

    def next(self, trial_id: str) -> tuple[dict, str] | None:
        """(config, tag) for the next trial; None when none now (the searcher wants
        results first) or none any more (:attr:`finished`)."""
        if self.finished:
            return None
        if self._variants is not None:
            try:
                config, tag = next(self._variants)
            except StopIteration:
                self.finished = True
                return None
            self.made += 1
            return config, tag
        if self.made >= self.num_samples:
            self.finished = True
            return None
        from ray.tune.search import Searcher
        from ray.tune.utils.util import merge_dicts

        suggestion = self.searcher.suggest(trial_id)
        if suggestion == Searcher.FINISHED:
            self.finished = True
            return None
        if suggestion is None:
            return None
        self.made += 1
        config = merge_dicts(constants_of(self.param_space), copy.deepcopy(suggestion))
        return config, ",".join(f"{k}={short_text(v)}" for k, v in flat_config(suggestion).items())

    @property
    def total(self) -> int | None:
        """How many trials the sweep will have, when known."""
        if self.searcher is not None:
            return self.num_samples
        from ray.tune.search.variant_generator import parse_spec_vars

        _resolved, _domains, grids = parse_spec_vars(self.param_space)
        return self.num_samples * math.prod(len(grid.categories) for _path, grid in grids)


class TuneController:
    """What Tune's schedulers ask of the controller that drives them."""

    def __init__(self) -> None:
        self.trials: list[Any] = []

    def get_trials(self) -> list[Any]:
        return list(self.trials)

    def get_live_trials(self) -> list[Any]:
        from ray.tune.experiment import Trial

        return [t for t in self.trials if t.status not in (Trial.TERMINATED, Trial.ERROR)]


# ---- checks: one line before any trial starts ---------------------------------------------
def check_train(train: Any) -> str | Callable:
    if callable(train):
        return train
    if not isinstance(train, str) or not train.strip():
        raise ConfigError(
            "a sweep trains with a cell's code (a string) or a function train(config), "
            f"not {type(train).__name__}"
        )
    code = textwrap.dedent(train)
    try:
        check_syntax(code, "<sweep trial>")
    except CellError as exc:
        raise CellError(
            str(exc)
            .replace("the cell has", "the trial's code has", 1)
            .replace("was not sent to the ranks", "no trial started", 1),
            exc_type="SyntaxError",
        ) from None
    return code


def check_space(param_space: Any) -> dict:
    if not isinstance(param_space, Mapping):
        raise ConfigError(
            f"param_space must be a dict of Tune search spaces, e.g. "
            f"{{'lr': tune.loguniform(1e-4, 1e-1)}}, not {type(param_space).__name__}"
        )
    space = dict(param_space)
    if set(space) == {"train_loop_config"} and isinstance(space["train_loop_config"], Mapping):
        space = dict(space["train_loop_config"])  # as given to a TorchTrainer under a Tuner
    for path, value in _walk(space):
        module = type(value).__module__.split(".")[0]
        if module in _FOREIGN_SPACES:
            raise ConfigError(
                f"param_space[{path}] is a {type(value).__module__}.{type(value).__name__}: "
                "a sweep takes Ray Tune's search spaces (tune.loguniform(...), "
                "tune.choice([...]), tune.grid_search([...])); a library's own space goes "
                "to its Tune searcher (e.g. OptunaSearch(space=...), search_alg=...)"
            )
    return space


def _walk(space: Mapping, prefix: str = ""):
    for key, value in space.items():
        path = f"{prefix}{key!r}"
        if isinstance(value, Mapping) and "grid_search" not in value:
            yield from _walk(value, f"{path}][")
        else:
            yield path, value


def check_scheduler(scheduler: Any) -> Any:
    from ray.tune.schedulers import FIFOScheduler, TrialScheduler

    if scheduler is None:
        return FIFOScheduler()
    if isinstance(scheduler, str):
        from ray.tune.schedulers import ASHAScheduler, MedianStoppingRule

        made = {"asha": ASHAScheduler, "median": MedianStoppingRule, "fifo": FIFOScheduler}
        if scheduler not in made:
            raise ConfigError(
                f"scheduler={scheduler!r}: use 'asha', 'median', 'fifo' or a Tune scheduler "
                "object, e.g. ASHAScheduler(max_t=20, grace_period=2)"
            )
        return made[scheduler]()
    if not isinstance(scheduler, TrialScheduler):
        raise ConfigError(
            f"scheduler must be a Ray Tune TrialScheduler (ASHAScheduler, MedianStoppingRule, "
            f"FIFOScheduler), not {type(scheduler).__name__}"
        )
    for cls in type(scheduler).__mro__:
        if cls.__name__ in _PAUSING:
            raise ConfigError(
                f"{type(scheduler).__name__} pauses trials and resumes them later; a sweep's "
                "trials run to their end or stop early: use ASHAScheduler, "
                "AsyncHyperBandScheduler or MedianStoppingRule"
            )
    return scheduler


def check_searcher(search_alg: Any) -> Any:
    if search_alg is None:
        return None
    if search_alg == "optuna":
        try:
            from ray.tune.search.optuna import OptunaSearch

            return OptunaSearch()
        except (ImportError, AssertionError):
            raise ConfigError("search_alg='optuna' needs Optuna: pip install optuna") from None
    if isinstance(search_alg, str):
        raise ConfigError(
            f"search_alg={search_alg!r}: use 'optuna' or a Tune Searcher object, e.g. "
            "OptunaSearch(), HyperOptSearch()"
        )
    from ray.tune.search import Searcher

    if not isinstance(search_alg, Searcher):
        raise ConfigError(
            f"search_alg must be a Ray Tune Searcher (OptunaSearch, HyperOptSearch, ... "
            f"optionally in a ConcurrencyLimiter), not {type(search_alg).__name__}"
        )
    return search_alg


def metric_and_mode(metric: Any, mode: Any, scheduler: Any, searcher: Any) -> tuple[str, str]:
    for source in (scheduler, searcher):
        if source is None:
            continue
        own = getattr(source, "_metric", None), getattr(source, "_mode", None)
        for given, its, what in ((metric, own[0], "metric"), (mode, own[1], "mode")):
            if given and its and given != its:
                raise ConfigError(
                    f"the sweep's {what} is {given!r} but {type(source).__name__} was made "
                    f"with {what}={its!r}: give it in one place"
                )
        metric = metric or own[0]
        mode = mode or own[1]
    if not metric or not isinstance(metric, str):
        raise ConfigError(
            "name the metric the sweep optimises: metric='loss' (a key the training code "
            "passes to rtnb.report) and mode='min' or 'max'"
        )
    if mode not in ("min", "max"):
        raise ConfigError(f"mode is 'min' or 'max' (for metric {metric!r}), not {mode!r}")
    return metric, mode


def check_reports(code: str | Callable, metric: str) -> None:
    """One line when every ``report(...)`` of the training code is a dict literal and
    none names ``metric`` (code that reports some other way is left to the trials)."""
    if callable(code):
        try:
            source = textwrap.dedent(inspect.getsource(code))
        except (OSError, TypeError):
            return
    else:
        source = code
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    names: set[str] = set()
    found = False
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if called != "report":
            continue
        found = True
        arg = (
            node.args[0]
            if node.args
            else next((k.value for k in node.keywords if k.arg == "metrics"), None)
        )
        if not isinstance(arg, ast.Dict) or not all(
            isinstance(k, ast.Constant) and isinstance(k.value, str) for k in arg.keys
        ):
            return  # built at run time: the trials tell
        names.update(k.value for k in arg.keys)
    if found and metric not in names:
        raise ConfigError(
            f"the training code never reports {metric!r} (its report() calls name "
            f"{', '.join(sorted(names)) or 'nothing'}): name one of those as the metric"
        )
