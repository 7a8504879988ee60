"""Which checkpoint is "best": the browser's star, its "best" badge, its timeline's
first metric, ``Result.get_best_checkpoint`` and the runs table all follow one rule
(``--score``, else a metric named like a loss or an accuracy, else no best)."""

from __future__ import annotations

import pytest

import rtnb
from rtnb.core._score import ScoreSource, direction_of, score_rule
from rtnb.errors import ConfigError


@pytest.mark.parametrize(
    ("name", "direction"),
    [
        ("loss", "min"),
        ("val_loss", "min"),
        ("trainLoss", "min"),
        ("eval/perplexity", "min"),
        ("MSE", "min"),
        ("acc", "max"),
        ("top1_acc", "max"),
        ("eval_accuracy", "max"),
        ("f1", "max"),
        ("lr", None),
        ("epoch", None),
        ("score", None),  # says neither
        ("acc_loss", None),  # says both
    ],
)
def test_a_metric_name_says_which_way_is_better_only_when_it_is_unambiguous(name, direction):
    assert direction_of(name) == direction


def test_the_rule_is_the_given_score_else_the_first_reported_metric_that_says_its_way():
    given = score_rule("acc", "min", ["loss", "acc"])
    assert (given.metric, given.mode, given.source) == ("acc", "min", ScoreSource.GIVEN)
    inferred = score_rule(None, "min", ["lr", "acc", "loss"])
    assert (inferred.metric, inferred.mode) == ("acc", "max")
    assert inferred.source is ScoreSource.INFERRED
    assert "by its name" in inferred.describe() and "highest acc" in inferred.describe()
    assert score_rule(None, "min", ["lr", "epoch"]) is None


def _rows(metrics_by_step: dict[int, dict]) -> list:
    return [
        rtnb.CheckpointInfo(
            id=f"step-{step:09d}", step=step, time=float(step), metrics=metrics, ranks=[0, 1]
        )
        for step, metrics in metrics_by_step.items()
    ]


# Training that gets better: loss falls and accuracy rises from step 49 to 199
# (both reported, loss first, as a training loop writes them).
IMPROVING = {49: {"loss": 1.57, "acc": 0.74}, 99: {"loss": 0.9, "acc": 0.86}, 149: {"loss": 0.6, "acc": 0.91}, 199: {"loss": 0.7, "acc": 0.93}}  # fmt: skip


@pytest.mark.parametrize(
    ("case", "score", "mode", "best_step", "timeline", "says"),
    [
        ("loss only", None, "min", 149, "loss", "best: lowest loss (by its name"),
        ("acc only", None, "min", 199, "acc", "best: highest acc (by its name"),
        ("loss and acc", None, "min", 149, "loss", "best: lowest loss (by its name"),
        ("--score acc --mode max", "acc", "max", 199, "acc", "best: highest acc (--score)"),
        ("nothing named", None, "min", None, "lr", "no best"),
    ],
)
def test_the_browser_stars_the_best_checkpoint_by_the_rule_it_names(
    case, score, mode, best_step, timeline, says
):
    from rtnb.widgets import CheckpointBrowser

    if case == "loss only":
        data = {s: {"loss": m["loss"]} for s, m in IMPROVING.items()}
    elif case == "acc only":
        data = {s: {"acc": m["acc"]} for s, m in IMPROVING.items()}
    elif case == "nothing named":
        data = {s: {"lr": 0.1 / (s + 1)} for s in IMPROVING}
    else:
        data = IMPROVING
    browser = CheckpointBrowser(lambda: _rows(data), score=score, mode=mode)
    starred = [
        c.id
        for trace in browser.timeline.data
        if trace.mode == "lines+markers"
        for c, symbol in zip(_rows(data), trace.marker.symbol)
        if symbol == "star"
    ]
    badged = [row["id"] for row in browser.table.rows if ["★ best", "best"] in row["badges"]]
    expected = [] if best_step is None else [f"step-{best_step:09d}"]
    assert starred == expected and badged == expected, case
    assert browser._metric.value == timeline, "the timeline starts on the rule's (or first) metric"
    assert says in browser.rule_line.value, browser.rule_line.value


def test_result_get_best_checkpoint_follows_the_rule_or_what_it_is_told():
    pairs = [(f"ck{s}", m) for s, m in IMPROVING.items()]
    result = rtnb.Result(
        path="/x", best_checkpoints=pairs, score_rule=score_rule(None, "min", ["loss", "acc"])
    )
    assert result.get_best_checkpoint() == "ck149"
    assert result.get_best_checkpoint("acc", "max") == "ck199"
    assert result.get_best_checkpoint("loss", "max") == "ck49"
    assert rtnb.Result(path="/x", best_checkpoints=pairs).get_best_checkpoint() is None
    with pytest.raises(ConfigError, match="mode must be"):
        result.get_best_checkpoint("loss", "lowest")
