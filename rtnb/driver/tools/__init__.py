"""Looking into running ranks: the debugger, the hang doctor, profiles, a checkpoint's validation."""

from typing import TYPE_CHECKING

from rtnb.core._faces import lazy_face

_FACE = {
    "attach": "rtnb.driver.tools._debugger",
    "Breakpoints": "rtnb.driver.tools._debugger",
    "HangWatch": "rtnb.driver.tools._hang_doctor",
    "merge_profile": "rtnb.driver.tools._profiles",
    "post_mortem": "rtnb.driver.tools._debugger",
    "StackReader": "rtnb.driver.tools._hang_doctor",
    "Validations": "rtnb.driver.tools._validation",
}
__all__ = [
    "attach",
    "Breakpoints",
    "HangWatch",
    "merge_profile",
    "post_mortem",
    "StackReader",
    "Validations",
]
__getattr__ = lazy_face(globals(), _FACE)

if TYPE_CHECKING:  # what type checkers see
    from rtnb.driver.tools._debugger import Breakpoints, attach, post_mortem
    from rtnb.driver.tools._hang_doctor import HangWatch, StackReader
    from rtnb.driver.tools._profiles import merge_profile
    from rtnb.driver.tools._validation import Validations
