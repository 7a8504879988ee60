"""The run directory and everything in it: run.json, the journal, metrics and log
records, checkpoints and their manifests (local paths or object storage).

Imports only ``rtnb.core`` and ``rtnb.errors``: it runs on both sides.
"""

from typing import TYPE_CHECKING

from rtnb.core._faces import lazy_face

# Its face, for the magics: loaded on first use (a rank imports only what it saves).
_FACE = {
    "CheckpointInfo": "rtnb.storage._checkpoints",
    "list_runs": "rtnb.storage._result",
}
__all__ = ["CheckpointInfo", "list_runs"]
__getattr__ = lazy_face(globals(), _FACE)

if TYPE_CHECKING:  # what type checkers see
    from rtnb.storage._checkpoints import CheckpointInfo
    from rtnb.storage._result import list_runs
