"""A sweep's pieces without Ray: Tune's suggestions, the metric check, the trials table (driver/tuning, widgets/_sweep)."""

from __future__ import annotations

import pytest

from rtnb.errors import ConfigError


def test_a_sweeps_trials_come_from_tunes_variants_num_samples_times_over_the_grid():
    from ray import tune

    from rtnb.driver.tuning._tune import Suggestions, check_space

    # As given to a TorchTrainer under a Tuner: the train_loop_config is the space.
    space = check_space(
        {"train_loop_config": {"lr": tune.grid_search([0.1, 0.01]), "bs": tune.choice([8, 16])}}
    )
    suggestions = Suggestions(space, num_samples=3, searcher=None)
    assert suggestions.total == 6
    configs = []
    while (made := suggestions.next("t")) is not None:
        configs.append(made[0])
    assert suggestions.finished and len(configs) == 6
    assert sorted(c["lr"] for c in configs) == [0.01] * 3 + [0.1] * 3
    assert all(c["bs"] in (8, 16) for c in configs)


def test_a_sweeps_metric_check_reads_the_training_codes_reports():
    from rtnb.driver.tuning._tune import check_reports

    check_reports("rtnb.report({'loss': l, 'acc': a})", "acc")
    check_reports("metrics = {'acc': a}\nrtnb.report(metrics)", "acc")  # built at run time
    check_reports("trainer.train()", "eval_loss")  # reports some other way: the trials tell
    with pytest.raises(ConfigError, match="never reports 'acc'.*name loss"):
        check_reports("ray.train.report(metrics={'loss': l})", "acc")


def test_a_sweeps_table_sorts_by_score_with_the_best_marked():
    from rtnb.widgets._sweep import sort_trials, sweep_table

    from rtnb.driver.tuning._sweep import SweepTrial, TrialState

    trials = [
        SweepTrial(0, "a", {"lr": 0.1}, "s-t000", TrialState.TERMINATED, [0, 1], [3.0, 2.0]),
        SweepTrial(1, "b", {"lr": 0.3}, "s-t001", TrialState.STOPPED, [0], [5.0], stopped_at=1),
        SweepTrial(2, "c", {"lr": 0.2}, "s-t002", TrialState.RUNNING, [0, 1, 2], [4.0, 1.0, 1.5]),
    ]

    class Sweep:
        metric, mode = "loss", "min"

        def __init__(self) -> None:
            self.trials = trials

        def best_trial(self):
            return min(self.trials, key=lambda t: t.values[-1])

    assert [t.index for t in sort_trials(trials, "last", "min")] == [2, 0, 1]
    assert [t.index for t in sort_trials(trials, "best", "max")] == [1, 2, 0]
    assert [t.index for t in sort_trials(trials, "iterations", "min")] == [2, 0, 1]
    head, *rows = sweep_table(Sweep(), key="last")
    assert "last loss" in head and rows[0].startswith("*2")
    assert "lr=0.3" in rows[2] and "stopped" in rows[2]
