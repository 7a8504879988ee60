"""A notebook as a script and back: export and import."""

from typing import TYPE_CHECKING

from rtnb.core._faces import lazy_face

_FACE = {
    "export_run": "rtnb.driver.scripts._export",
    "ExportedScript": "rtnb.driver.scripts._export",
    "read_train_script": "rtnb.driver.scripts._import",
    "TrainScript": "rtnb.driver.scripts._import",
}
__all__ = ["export_run", "ExportedScript", "read_train_script", "TrainScript"]
__getattr__ = lazy_face(globals(), _FACE)

if TYPE_CHECKING:  # what type checkers see
    from rtnb.driver.scripts._export import ExportedScript, export_run
    from rtnb.driver.scripts._import import TrainScript, read_train_script
