"""Which checkpoint is "best": one rule for the checkpoint browser, ``Result``, the
runs table and ``%rtnb checkpoints``.

``--score METRIC --mode min|max`` names it. Without ``--score`` the rule is
inferred only where a name says which way is better (``loss``, ``val_error``,
``perplexity``: lower; ``acc``, ``top1_accuracy``, ``f1``: higher), from the first
reported metric that says so; a run that reported neither kind has no best at all
(as in Ray Train, where only ``checkpoint_score_attribute`` makes one).

Retention (``--keep N``) ranks by ``--score`` only: without it the newest are kept,
as Ray Train's ``num_to_keep`` does. Deleting never acts on a guess from a name.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["NO_BEST", "ScoreRule", "ScoreSource", "direction_of", "score_rule"]

T = TypeVar("T")

# A name's words, each of which says lower is better ...
_LOWER = frozenset(
    {"loss", "error", "err", "mse", "mae", "rmse", "nll", "perplexity", "ppl", "wer", "cer"}
    | {"regret", "cost", "bpd", "bpc", "distance"}
)
# ... or higher is better. "score" and "metric" say neither.
_HIGHER = frozenset(
    {"acc", "accuracy", "top1", "top5", "f1", "auc", "auroc", "precision", "recall"}
    | {"bleu", "rouge", "iou", "miou", "map", "dice", "r2", "reward", "return", "psnr", "ssim"}
)
_WORD = re.compile(r"[A-Z]?[a-z]+\d*|[A-Z]+\d*(?![a-z])|\d+")


class ScoreSource(enum.Enum):
    GIVEN = "given"  # --score/--mode
    INFERRED = "inferred"  # from the metric's name


@dataclass(frozen=True)
class ScoreRule:
    metric: str
    mode: str  # "min" or "max"
    source: ScoreSource

    def value(self, metrics: Mapping) -> float | None:
        """This rule's metric in ``metrics`` as a finite number, else None."""
        raw = metrics.get(self.metric)
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            return None
        return float(raw) if math.isfinite(raw) else None

    def ranked(self, items: Iterable[T], metrics_of: Callable[[T], Mapping]) -> list[T]:
        """``items`` best first; those without the metric last, in their order."""
        listed = list(items)
        sign = 1.0 if self.mode == "min" else -1.0
        scored = [i for i in listed if self.value(metrics_of(i)) is not None]
        scored.sort(key=lambda i: sign * self.value(metrics_of(i)))  # type: ignore[operator]
        return scored + [i for i in listed if self.value(metrics_of(i)) is None]

    def best(self, items: Iterable[T], metrics_of: Callable[[T], Mapping]) -> T | None:
        ranked = self.ranked(items, metrics_of)
        return ranked[0] if ranked and self.value(metrics_of(ranked[0])) is not None else None

    def describe(self) -> str:
        """What the browser says of its star, e.g. ``best: lowest loss (by its name;
        --score METRIC --mode min|max to choose)``."""
        which = "lowest" if self.mode == "min" else "highest"
        how = (
            "--score"
            if self.source is ScoreSource.GIVEN
            else "by its name; --score METRIC --mode min|max to choose"
        )
        return f"best: {which} {self.metric} ({how})"


NO_BEST = (
    "no best: no metric named like a loss or an accuracy was reported "
    "(--score METRIC --mode min|max marks one)"
)


def direction_of(name: str) -> str | None:
    """ "min" when ``name`` reads as something to lower, "max" as something to raise,
    None when it says neither or both (``val_loss`` → min, ``eval/accuracy`` → max,
    ``lr`` → None)."""
    words = {w.lower() for w in _WORD.findall(name)}
    lower, higher = bool(words & _LOWER), bool(words & _HIGHER)
    if lower == higher:
        return None
    return "min" if lower else "max"


def score_rule(score: str | None, mode: str, reported: Iterable[str]) -> ScoreRule | None:
    """The rule for a run: ``score`` as given, else inferred from the first of the
    ``reported`` metric names (in the order they were first reported) whose name
    says which way is better, else None (no best)."""
    if score:
        return ScoreRule(score, mode, ScoreSource.GIVEN)
    for name in reported:
        direction = direction_of(name)
        if direction is not None:
            return ScoreRule(name, direction, ScoreSource.INFERRED)
    return None
