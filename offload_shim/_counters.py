"""What was staged: counters by collective, route and mode (:func:`staging_counters`), one log line at the first
staged call from each line of code, and the table printed at exit (``OFFLOAD_SHIM_SUMMARY``).

Every staged call but a replayed one (below) reports here from two places, in one thread:

* its staging decision, :func:`decided`: ``_plan._decided``, which every decision to stage a call on a
  process group passes (the ``torch.distributed`` collectives in place, on lists and point-to-point, the
  ``CPU`` kernels of the collective ops that compiled code, the functional collectives and DTensor run), and
  ``_communicators._call`` for registered communicators, which decide for themselves. It keeps, for this thread,
  the route, the staging device and the time; where the ``offload_shim`` logger is enabled for INFO (the one
  question the decision asks the logger, where it asked for DEBUG before) and the call site has not been logged,
  also the call site and why the call is staged;
* its end, :func:`count`: each family's wrapper, in a ``finally`` around its staged branch, with the call's name,
  mode and bytes. It adds the call to the counters and logs the call site's first staged call.

A small call replayed from a captured CUDA graph (``_replay.replayed``) adds itself, at its end, to its capture's
own counter (:func:`tally`), which only its thread writes, so without the lock: its key's first calls, which made
the capture, passed both.

No other decision comes between the two in a thread: a collective called from inside a staged call is not
staged (``_staging.in_staged_call``), so it never reaches :func:`decided`. Calls that need no staging pass neither.

Per staged call: two ``perf_counter`` readings, a thread-local write and read, and a dict update under a lock;
per replayed call, two readings and two additions.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import types
from time import perf_counter
from typing import Mapping, NamedTuple

import torch
import wrapt

from offload_shim import _config, _staging
from offload_shim._state import state

# Routes: what took a call off torch's own path.
STAGED = "staged"  # the group has no backend for the tensor's device (a CPU tensor on a NCCL-only group); or a
# registered communicator got a tensor off its device
ROUTED = "routed"  # the group serves CPU (Gloo) and the accelerator through another backend, and the call's size
# is at least route_min_bytes: through the accelerator's backend
MIXED = "mixed"  # host tensors beside tensors on an accelerator that the group serves through another backend
# than the CPU's (cpu:gloo,cuda:nccl): the host tensors go through those tensors' device
FORCED = "forced"  # always_stage: nothing else would have taken the call off torch's path
HOST = "host"  # accelerator tensors that the group's backends serve for this collective only through the host (a
# CUDA send on a Gloo group, an XPU tensor on a Gloo-only group): through pinned host memory
# Modes: how a call was staged.
WHOLE = "whole"  # each staged tensor copied whole, to the staging device and back as the call needs
SMALL = "small"  # a synchronous in-place call of at most _plan.SMALL_CALL_BYTES under two chunks, through this
# thread's reused slot (_staging.stage_small_in_place)
PIPELINED = "pipelined"  # in chunks (_execute)
REPLAYED = "replayed"  # a small call as SMALL, replayed from a CUDA graph captured at its second call (_replay)


class StagingKey(NamedTuple):
    """What a counter counts: one collective (e.g. ``'torch.distributed.all_reduce'``), route and mode."""

    op: str
    route: str
    mode: str


class StagingCount(NamedTuple):
    """Staged calls of one :class:`StagingKey`: how many, their bytes, and their wall-clock seconds."""

    calls: int
    bytes: int
    seconds: float


# state.counters: [calls, bytes, seconds] by (op, route, mode); state.logged_sites: (call site, collective) logged;
# state.tallies: (key, bytes per call, [calls, seconds] added to by one thread, [calls, seconds] at the last reset),
# see tally(); state.thread.decision: this thread's last decision (route, staging device, (call site, why) where the
# call is to be logged, perf_counter() at the decision).
_NO_DECISION = (STAGED, None, None, 0.0)
_summary_registered = 0  # the process id that registered the table at exit (0: none yet)
_log = logging.getLogger("offload_shim")

_SHIM_FILES = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (sys.modules[__package__], wrapt))
_TORCH_FILES = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def decided(route: str, device, op: str = "", why=None) -> None:
    """A call of collective ``op`` is staged, by ``route``, through ``device``. ``why``: where the ``offload_shim``
    logger is enabled for INFO, a function saying why in a few words, called here if ``op`` has not been logged from
    the call site yet (and not kept: what it refers to, a process group, is not held beyond the call); ``None``
    otherwise."""
    note = None
    if why is not None:
        site = _call_site()
        if (site, op) not in state.logged_sites:
            note = (site, why())
    state.thread.decision = (route, device, note, perf_counter())


def count(op: str, mode: str, nbytes: int) -> None:
    """The staged call this thread last decided (:func:`decided`) returned or raised: count it under ``op``, its
    route and ``mode``, with ``nbytes`` and the seconds since the decision; log it if it is its call site's first."""
    end = perf_counter()
    route, device, note, start = state.thread.decision or _NO_DECISION
    lock = state.counters_lock
    lock.acquire()  # not `with`: this is on every staged call's path, and the statement costs more
    try:
        _add((op, route, mode), nbytes, end - start)
        if note is not None:
            if (note[0], op) in state.logged_sites:  # logged by another thread since the decision
                note = None
            else:
                state.logged_sites.add((note[0], op))
    finally:
        lock.release()
    if note is not None:
        site, why = note
        _log.info(
            "offload_shim: first staged call at %s: %s, %s, route %s (%s), mode %s, through %s",
            site, op, format_bytes(nbytes), route, why, mode, device,
        )


def tally(op: str, route: str, mode: str, nbytes: int) -> list:
    """A counter of calls of ``op`` under ``route`` and ``mode``, each of ``nbytes``, that one thread alone adds to,
    without the lock: ``[calls, seconds]``, where its thread adds 1 and a call's seconds (``perf_counter`` readings)
    for each call, returned or raised; :func:`staging_counters` adds it in. A replayed small call's
    (``_replay.replayed``, whose capture belongs to one thread; its key's first calls were decided, counted and
    logged); :func:`fold` it when it is dropped."""
    counts = [0, 0.0]
    with state.counters_lock:
        state.tallies.append(((op, route, mode), nbytes, counts, [0, 0.0]))
    return counts


def fold(counts: list) -> None:
    """Add the calls of tally ``counts`` (:func:`tally`) not yet reset into the counters, and stop reading it."""
    with state.counters_lock:
        for at, entry in enumerate(state.tallies):
            if entry[2] is counts:
                del state.tallies[at]
                _add_tally(state.counters, entry, clear=False)
                return


def _add_tally(table: dict, entry, clear: bool) -> None:  # under state.counters_lock
    key, nbytes, counts, base = entry
    calls, seconds = counts[0], counts[1]  # (its thread adds to calls first)
    if calls != base[0]:
        total = table.get(key)
        if total is None:
            total = table[key] = [0, 0, 0.0]
        total[0] += calls - base[0]
        total[1] += (calls - base[0]) * nbytes
        total[2] += seconds - base[1]
    if clear:
        base[0], base[1] = calls, seconds


def _add(key: tuple[str, str, str], nbytes: int, seconds: float) -> None:  # under state.counters_lock
    entry = state.counters.get(key)
    if entry is None:
        entry = state.counters[key] = [0, 0, 0.0]
    entry[0] += 1
    entry[1] += nbytes
    entry[2] += seconds


def host_bytes(values, source: str = "cpu") -> int:
    """The bytes of the tensors among ``values`` (tensors, ``None``, other objects, and lists or tuples of them,
    nested) that a staged call stages: those on ``source``, the host's or, staged through the host, an
    accelerator's (``_staging.needs_staging``)."""
    total = 0
    for value in values:
        if isinstance(value, (list, tuple)):
            total += host_bytes(value, source)
        elif _staging.needs_staging(value, source):
            total += value.nbytes
    return total


def _call_site() -> str:
    """``file:line`` of the innermost frame outside offload_shim, wrapt and torch: the application's line that led to
    the call, also where torch makes it (``clip_grad_norm_``, DTensor, compiled code); where there is none (a hook run
    by a thread of torch's own), the innermost frame outside offload_shim and wrapt."""
    frame, fallback = sys._getframe(1), None
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_SHIM_FILES):
            if not filename.startswith(_TORCH_FILES):
                break
            fallback = fallback or frame
        frame = frame.f_back
    frame = frame or fallback
    return "<unknown>" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def format_bytes(n: int) -> str:
    """``n`` bytes for people: ``'16 B'``, ``'4.0 KiB'``, ``'1.5 MiB'``, ``'2.0 GiB'``."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"


def staging_counters() -> Mapping[StagingKey, StagingCount]:
    """The staged calls of this process so far, counted by collective, route and mode: an immutable snapshot.

    Returns:
        A read-only mapping, sorted by key, from ``StagingKey(op, route, mode)`` (a named tuple; a plain tuple
        finds it too) to ``StagingCount(calls, bytes, seconds)``:

        * ``op``: the collective as offload_shim names it: ``'torch.distributed.all_reduce'``,
          ``'torch.ops._c10d_functional.all_reduce'`` (compiled code, the functional collectives, DTensor),
          ``'torch.distributed._functional_collectives.all_gather_single'`` (a functional collective's accelerator
          input through the host), or a registered communicator's method (``'module.Class.method'``).
        * ``route``, what took the call off torch's own path: ``'staged'`` (the group has no backend for CPU, e.g.
          NCCL only; for a communicator, a tensor not on its device), ``'routed'`` (a group with Gloo for CPU and
          another backend for the accelerator, and a call of at least ``route_min_bytes``), ``'mixed'`` (host
          tensors beside accelerator tensors that such a group serves: staged through their device),
          ``'forced'`` (``always_stage``, and nothing else).
        * ``mode``: ``'small'`` (a synchronous ``all_reduce``, ``broadcast`` or ``reduce`` of at most 1 MiB
          through this thread's reused buffer), ``'whole'`` (each tensor copied whole), ``'pipelined'``
          (in chunks: those three collectives and ``all_gather_into_tensor``, from two chunks).
        * ``calls``: staged calls, those that raised included.
        * ``bytes``: the sizes of the caller's tensors each call staged: its host tensor arguments, inputs and the
          outputs it writes into, each once (an ``all_reduce``'s tensor counts once, though copied both ways); a
          tensor the call returns new (the functional ops' results) is not counted.
        * ``seconds``: wall-clock seconds (``time.perf_counter``) from the staging decision until the call
          returned, its copies included; for an asynchronous call (``async_op=True``, ``isend``, ``irecv``,
          ``batch_isend_irecv``) until it returned its handle: what ``wait()`` does later is not counted.

        Calls that need no staging are not counted. Counters are per process and count every thread's calls.
    """
    return _snapshot(clear=False)


def reset_staging_counters() -> Mapping[StagingKey, StagingCount]:
    """Set the counters of :func:`staging_counters` to nothing.

    Returns:
        The counters as they were just before, as :func:`staging_counters` gives them: no call is lost between
        reading and resetting (counters per training step: call this once a step).
    """
    return _snapshot(clear=True)


def _snapshot(clear: bool) -> Mapping[StagingKey, StagingCount]:
    """The counters as a read-only mapping sorted by key, taken (and, with ``clear``, emptied) under the lock."""
    with state.counters_lock:
        table = {key: list(value) for key, value in state.counters.items()}
        for entry in state.tallies:
            _add_tally(table, entry, clear)
        items = [(key, tuple(value)) for key, value in sorted(table.items())]
        if clear:
            state.counters.clear()
    return types.MappingProxyType({StagingKey(*key): StagingCount(*value) for key, value in items})


def summary(counters: Mapping[StagingKey, StagingCount] | None = None, rank: str | None = "0") -> str:
    """The table ``OFFLOAD_SHIM_SUMMARY`` prints at exit (of :func:`staging_counters` unless ``counters`` is given),
    one row per collective, route and mode and a total; one line where nothing was staged. No final newline.
    ``rank``: this process's ``RANK``, for the first line (``None``: unset)."""
    counters = staging_counters() if counters is None else counters
    where = f"pid {os.getpid()}" if rank is None else f"rank {rank} (pid {os.getpid()})"
    if not counters:
        return f"offload_shim: no call was staged on {where}"
    rows = [("op", "route", "mode", "calls", "bytes", "seconds")]
    for (op, route, mode), (calls, nbytes, seconds) in counters.items():
        rows.append((op, route, mode, str(calls), format_bytes(nbytes), f"{seconds:.6f}"))
    total = [sum(column) for column in zip(*counters.values())]
    rows.append(("total", "", "", str(total[0]), format_bytes(total[1]), f"{total[2]:.6f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    lines = [
        "  ".join([*(row[i].ljust(widths[i]) for i in range(3)), *(row[i].rjust(widths[i]) for i in range(3, 6))])
        for row in rows
    ]
    return "\n".join([f"offload_shim: staged calls on {where}:", *(line.rstrip() for line in lines)])


def _summary_at_exit() -> None:
    """At interpreter exit, where ``summary_at_exit`` is set and this process is rank 0 (``RANK`` is 0, or unset):
    the table on standard error, in one write. A process without ``RANK`` that staged nothing prints nothing: a
    launcher such as torchrun's, which imports torch (and with ``OFFLOAD_SHIM=1`` the shim) but runs no collective.
    A child made by ``fork()`` that exits through the interpreter prints nothing: the rank's table is its parent's."""
    if os.getpid() != _summary_registered:
        return
    rank = os.environ.get("RANK", "").strip() or None
    if not _config.settings().summary_at_exit or rank not in ("0", None):
        return
    if rank is None and not staging_counters():  # (replays are counted in their tallies, not the table)
        return
    sys.stderr.write(summary(rank=rank) + "\n")
    sys.stderr.flush()


def register_summary_at_exit() -> None:
    """Print the table at exit where the settings ask for it then (``offload_shim.install`` calls this; once per
    process, whatever the number of calls)."""
    global _summary_registered
    with state.counters_lock:
        if _summary_registered:
            return
        _summary_registered = os.getpid()  # (the process that prints it)
    atexit.register(_summary_at_exit)
