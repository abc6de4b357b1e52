"""What a child made by ``fork()`` does with the parent's state.

The parent's threads are not in the child: a lock one of them held is held for ever, its copy threads, lanes and
writer of dropped handles never run, and the calls it had in flight never complete. So each module marks a reset
with :func:`after_fork`; one hook runs them in the child, in the order they were marked (the order the modules were
imported), and the child's first staged call starts from empty tables.

What the parent's tables held (pinned host buffers, accelerator memory, events, CUDA graphs, calls in flight) is
never freed in the child: a reset hands it to :func:`keep`. Freeing it would reach the accelerator's runtime, which a
forked child cannot use: torch's pinned memory, freed, records an event on each stream that copied it, CUDA answers
``cudaErrorInitializationError`` in a forked child, and the ``c10::AcceleratorError`` thrown from that deleter ends
the child (status 6). A DataLoader worker is such a child. No reset makes a call to the accelerator's runtime.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable

_resets: dict = globals().get("_resets", {})  # (kept across importlib.reload, as the hook below is)
# What children keep of their parents' state (see keep()); a reference the interpreter never drops, so that it
# outlives the child's own exit too, where the modules' tables are torn down.
if "_kept" not in globals():
    _kept: list = []
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_kept))


def after_fork(reset: Callable[[], None]) -> Callable[[], None]:
    """Decorator: run ``reset()`` in every child forked after this, once, however often its module is reloaded (a
    reloaded module's reset replaces its earlier one). No effect where ``os.register_at_fork`` is missing (Windows)."""
    _resets[reset.__module__, reset.__qualname__] = reset
    return reset


def keep(*objects) -> None:
    """In a forked child: keep ``objects`` (what the parent's tables held) for the rest of the process's life,
    never freed, so that nothing of the parent's reaches the accelerator's runtime (see the module docstring)."""
    _kept.append(objects)


def _in_child() -> None:
    for reset in list(_resets.values()):
        reset()


if not globals().get("_registered") and hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)
    _registered = True
