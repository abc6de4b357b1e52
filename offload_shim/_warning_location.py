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


def warn(message, category=None, stacklevel=1, source=None, **kwargs):
    """``warnings.warn``, with a location inside offload_shim or wrapt moved out to the caller."""
    if kwargs or not isinstance(stacklevel, int) or stacklevel < 1:  # the caller's own skip_file_prefixes
        return _original(message, category, stacklevel, source, **kwargs)
    try:
        frame = sys._getframe(stacklevel)
    except ValueError:  # deeper than the stack: the original says so its way
        return _original(message, category, stacklevel + 1, source)
    while frame is not None and frame.f_code.co_filename.startswith(_SHIM_FILES):
        frame = frame.f_back
        stacklevel += 1
    return _original(message, category, stacklevel + 1, source)  # + 1: this frame


def install() -> None:
    if warnings.warn is _original:
        warnings.warn = warn


def uninstall() -> None:
    if getattr(warnings.warn, "__module__", None) == __name__:  # this function, or its copy from before a reload
        warnings.warn = _original
