"""Ctrl-C held back while a staged call runs, as torch holds it back while its collective runs.

torch runs a collective as one C++ call: a ``KeyboardInterrupt`` that arrives during it is raised once it returns,
its results written. A staged call runs Python between its steps (copies in, the collective or a pipelined call's
chunks, copies back; before a group's first staged call, the ranks' agreement on their settings): interrupted there,
this rank would stop part way, the caller's tensor without its result or half-written, and where other collectives
were still to come, its peers would go on and the group's next collective would pair with the wrong one (Gloo
aborts the process). From the first step (:func:`hold`) to the end of the call (:func:`release`, by the executor),
Python's SIGINT handler in the main thread is replaced by one that notes the signal; the handler it replaced then
runs: ``KeyboardInterrupt`` is raised there, as after torch's call. A handler the program sets meanwhile (from
another signal's handler) is kept; another thread's calls, and a SIGINT that Python does not handle (``SIG_IGN``,
``SIG_DFL``), are left as they are. Both steps together cost 0.7 us on the 2-core CPU machine (0.3 us of it the two
system calls). An asynchronous call is held until it returns its handle, and the handle's ``wait()``, which writes
the results, until they are written. A replayed small call (``_replay``) holds nothing back on its way: a
``KeyboardInterrupt`` raised after its launch is caught, and the replay finished under a hold before it is raised."""

from __future__ import annotations

import _signal  # (signal's own C module: signal.signal and signal.getsignal add enum conversions, 20 times slower)
import contextlib
import signal
import threading

from offload_shim import _state
from offload_shim._state import state

SIGINT = int(signal.SIGINT)
# state.sigint_held: [True] while the main thread holds SIGINT back; state.sigint_caught: the frame of each SIGINT
# noted meanwhile.
_replaced: list = [signal.default_int_handler]  # the handler _note stands in for
_main = threading.main_thread


def _noting(signum, frame) -> None:
    if state.sigint_held:
        state.sigint_caught.append(frame)
    else:  # put back by the program after it read it during a call: the handler it stood in for
        _replaced[0](signum, frame)


_note = _noting  # the SIGINT handler while held back


def hold() -> None:
    """Hold SIGINT back until :func:`release` (holding already, or outside the main thread: nothing)."""
    if state.sigint_held or threading.get_ident() != _main().ident:
        return
    previous = _signal.getsignal(SIGINT)
    if previous is not _note:
        if not callable(previous):  # SIG_IGN, SIG_DFL: not Python's to hold back
            return
        _replaced[0] = previous
        _signal.signal(SIGINT, _note)
    state.sigint_held.append(True)


def release() -> None:
    """Put the SIGINT handler back (unless the program set another meanwhile), and run it for a SIGINT held back
    meanwhile (Python's raises ``KeyboardInterrupt``, here)."""
    if not state.sigint_held or threading.get_ident() != _main().ident:
        return
    state.sigint_held.clear()
    try:
        if _signal.getsignal(SIGINT) is _note:
            _signal.signal(SIGINT, _replaced[0])
    finally:
        frame = state.sigint_caught[0] if state.sigint_caught else None
        state.sigint_caught.clear()
    if frame is not None:
        _replaced[0](SIGINT, frame)


@_state.after_fork
def _put_back_after_fork() -> None:
    """A child forked while the main thread held SIGINT back (from another thread) would never release it: its
    handler is put back."""
    if _signal.getsignal(SIGINT) is _note:
        _signal.signal(SIGINT, _replaced[0])


@contextlib.contextmanager
def held():
    """Hold SIGINT back for the block, unless held already (then until that hold's :func:`release`)."""
    outer = bool(state.sigint_held)
    hold()
    try:
        yield
    finally:
        if not outer:
            release()
