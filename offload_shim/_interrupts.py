"""Ctrl-C held back while a staged call is part way through what every rank must finish alike.

torch runs a collective as one C++ call: a ``KeyboardInterrupt`` that arrives during it is raised once it returns,
its results written. A staged call that runs several collectives (a pipelined call's chunks; the ranks' agreement on
their settings before a group's first staged call, then the call itself) runs Python between them: interrupted
there, this rank would stop part way while its peers go on, and the group's next collective would pair with the
wrong one (Gloo aborts the process). From the first of them (:func:`hold`) to the end of the call (:func:`release`,
by the executor), Python's SIGINT handler in the main thread is replaced by one that notes the signal; the handler
it replaced then runs: ``KeyboardInterrupt`` is raised there, as after torch's call. Another thread's calls, and a
SIGINT that Python does not handle (``SIG_IGN``, ``SIG_DFL``), are left as they are. Replacing the handler and
putting it back costs about 3 us, so calls staged in one collective (which torch's own call completes) do not.
"""

from __future__ import annotations

import contextlib
import signal
import threading

_holding: list = []  # [(the handler replaced, the SIGINTs noted)] while the main thread holds SIGINT back


def hold() -> None:
    """Hold SIGINT back until :func:`release` (holding already: nothing more)."""
    if _holding or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        return
    caught: list = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    _holding.append((previous, caught))


def release() -> None:
    """Put the SIGINT handler back, and run it for a SIGINT held back meanwhile (Python's raises
    ``KeyboardInterrupt``, here)."""
    if not _holding or threading.current_thread() is not threading.main_thread():
        return
    previous, caught = _holding.pop()
    signal.signal(signal.SIGINT, previous)
    if caught:
        previous(signal.SIGINT, caught[0])


@contextlib.contextmanager
def held():
    """Hold SIGINT back for the block, unless held already (then until that hold's :func:`release`)."""
    outer = bool(_holding)
    hold()
    try:
        yield
    finally:
        if not outer:
            release()
