"""Hyperparameter sweeps: the Sweep, its runner, Ray Tune's side, the pool of reused groups, trial values."""

from typing import TYPE_CHECKING

from rtnb.core._faces import lazy_face

_FACE = {
    "Sweep": "rtnb.driver.tuning._sweep",
    "sweep": "rtnb.driver.tuning._runner",
    "SweepTrial": "rtnb.driver.tuning._sweep",
    "TrialState": "rtnb.driver.tuning._sweep",
}
__all__ = ["Sweep", "sweep", "SweepTrial", "TrialState"]
__getattr__ = lazy_face(globals(), _FACE)

if TYPE_CHECKING:  # what type checkers see
    from rtnb.driver.tuning._runner import sweep
    from rtnb.driver.tuning._sweep import Sweep, SweepTrial, TrialState
