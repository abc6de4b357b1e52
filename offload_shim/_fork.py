"""What a child made by ``fork()`` resets: the parent's threads are not in the child, so its locks, copy threads and
tables would be the parent's. Each module marks its reset with :func:`after_fork`; one hook runs them, in the order
they were marked (the order the modules were imported)."""

from __future__ import annotations

import os
from typing import Callable

_resets: dict = globals().get("_resets", {})  # (kept across importlib.reload, as the hook below is)


def after_fork(reset: Callable[[], None]) -> Callable[[], None]:
    """Decorator: run ``reset()`` in every child forked after this, once, however often its module is reloaded (a
    reloaded module's reset replaces its earlier one). No effect where ``os.register_at_fork`` is missing (Windows)."""
    _resets[reset.__module__, reset.__qualname__] = reset
    return reset


def _in_child() -> None:
    for reset in list(_resets.values()):
        reset()


if not globals().get("_registered") and hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)
    _registered = True
