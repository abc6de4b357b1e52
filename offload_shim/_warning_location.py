"""Warnings raised inside a wrapped call point at the caller's line, not at offload_shim's.

torch's Python code warns with ``stacklevel`` counted from the function it is in (``@deprecated`` on
``all_reduce_coalesced`` warns at its caller, ``_warn_not_in_group`` at the collective's caller). Under the shim that
caller is a wrapper frame of offload_shim (or wrapt), so the warning would name the shim's file and line, and filters
by module and the once-per-location registry would see the shim instead of the user's code. While installed,
``warnings.warn`` is replaced by :func:`warn`, which moves a warning whose location is a frame of offload_shim or
wrapt outward to the first frame outside them, as ``skip_file_prefixes`` (Python 3.12) does for one call. Every
other warning is passed to the original unchanged, and a warning costs one frame walk more; calls that raise no
warning pay nothing.
"""

from __future__ import annotations

import os
import sys
import warnings

import wrapt

_SHIM_FILES = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (sys.modules[__package__], wrapt))
_original = globals().get("_original") or warnings.warn  # kept across importlib.reload of this module
# Every version of warn() this process has bound at warnings.warn (one per reload of this module): what uninstall()
# may take back. A function someone wrapped around it (functools.wraps copies its name and module) is theirs.
_bound: list = globals().get("_bound", [])
_installed = globals().get("_installed", [False])  # [whether installed]: a warn() kept by another wrapper asks it


def warn(message, category=None, stacklevel=1, source=None, **kwargs):
    """``warnings.warn``, with a location inside offload_shim or wrapt moved out to the caller; once removed (and
    still called by a wrapper someone put around it), ``warnings.warn`` as it was."""
    if kwargs or not isinstance(stacklevel, int) or stacklevel < 1:  # the caller's own skip_file_prefixes
        return _original(message, category, stacklevel, source, **kwargs)
    if not _installed[0]:  # removed, and called by a wrapper someone put around it: as warnings.warn would
        return _original(message, category, stacklevel + 1, source)  # + 1: this frame
    try:
        frame = sys._getframe(stacklevel)
    except ValueError:  # deeper than the stack: the original says so its way
        return _original(message, category, stacklevel + 1, source)
    while frame is not None and frame.f_code.co_filename.startswith(_SHIM_FILES):
        frame = frame.f_back
        stacklevel += 1
    return _original(message, category, stacklevel + 1, source)  # + 1: this frame


def install() -> None:
    _installed[0] = True
    if warnings.warn is _original:
        warnings.warn = warn
        if not any(warn is bound for bound in _bound):
            _bound.append(warn)


def uninstall() -> None:
    _installed[0] = False
    if any(warnings.warn is bound for bound in _bound):  # ours (this warn, or one from before a reload); else theirs
        warnings.warn = _original
