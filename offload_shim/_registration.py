"""Host registration of pageable memory that is staged again and again (``OFFLOAD_SHIM_REGISTER_BYTES``).

A pageable tensor is staged through pinned bounce buffers: two host copies beside the DMA. Optimizer states, a
reused state dict or weight buffer are staged call after call from the same storage; registering that storage with
the accelerator (``cudaHostRegister``, as ``torch.distributed.checkpoint``'s stager does) page-locks it in place, and
its later calls take the pinned path: DMA straight from and to the caller's memory.

Opt-in (``register_bytes``, 0 by default): registered, the caller's own storage is pinned memory to the whole process
(``is_pinned()``, ``pin_memory()`` returning the tensor itself, ``non_blocking`` copies that no longer wait), which the
shim must not change unasked. A storage is registered at its second pipelined staging (a storage staged once, as a
fresh tensor each step is, never is), if it fits under the budget, ``register_bytes``. The least recently staged ones
are unregistered to make room, and a storage unregistered so is registered again only into free room (storages
reused in turn beyond the budget would otherwise be registered and unregistered at every call); one larger than the
budget never is. ``uninstall()`` unregisters every one (:func:`unregister_all`).

Registered memory must be unregistered before it is freed: the driver keeps a range registered after its memory is
unmapped, refuses a new mapping there, and may copy the old pages for a tensor the allocator later places at that
address. So the table holds each registered storage, and a storage no tensor uses any more (torch's count of its
users down to the table's own reference) is unregistered, then let go, at the next safe point, :func:`drain`: at the
start of the next pipelined call, ``release_buffers()`` and ``destroy_process_group()`` of every group. Until then
its memory stays allocated (the delay is the only cost: nothing is freed while registered, and nothing is
unregistered from a finalizer, which would run wherever the last reference goes, under any lock, inside another
thread's CUDA graph capture). The safe point unregisters a range only after events recorded on the streams that
staging copies on (:func:`_groups.copy_streams`), which follow every copy queued so far, have completed: the host
waits for them, never for the whole device, never under the module's lock, and never while this thread captures a
CUDA graph (then the safe point is the next one). A storage also comes off the table when the budget needs its room
or is lowered (ranges not yet undone count against it), and by :func:`unregister_all`. A range stays pending, its
storage held, until the driver has undone it (a range it no longer holds answers 713, and is dropped). Torch can
replace a storage's memory in place (``resize_``, ``share_memory_()``): the old memory is then freed while
registered, a safe point undoes the old range where the address or the size changed, and nothing can tell where new
memory came back at the same address and size; registration is not for storages resized between their stagings
(docs/operations.md). A registration is entered on the table before the driver's call (one at a time for a range; it
is not evicted while the call is under way), and a range leaves the table only once it is pending: an exception at
any step leaves no registered range the tables do not hold. A registration that fails (the driver's limit, a
container's) leaves the storage pageable, its calls take the bounce path, and one log line says so. A child made by
``fork()`` starts with empty tables: the registrations are its parent's (the driver's, in the parent's context),
which it neither uses nor undoes.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import threading
import weakref

import torch

from offload_shim import _config, _fork, _groups

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context, as torch's own stager registers
_NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered: nothing left to undo

_lock = threading.Lock()  # around the tables; never held while memory is registered or unregistered, nor events waited
# data pointer -> (the storage, bytes registered), least recently staged first. The table holds the storage, so its
# memory is not freed before the safe point unregisters it.
_registered: collections.OrderedDict[int, tuple[torch.UntypedStorage, int]] = collections.OrderedDict()
# Taken off the table and still registered, ``(pointer, bytes, storage)``: unregistered, and the storage let go, by
# the next safe point, which drops each only once the driver has undone it.
_pending: list[tuple[int, int, torch.UntypedStorage]] = []
_registering: set[int] = set()  # pointers whose registration is under way (the driver's call in flight)
_seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storages staged once, not registered
_failed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storages whose registration failed
_evicted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # unregistered for room: again only into free room
_log = logging.getLogger("offload_shim")
_logged_failure = False


def registered_bytes() -> int:
    """Bytes of pageable host memory registered now (storages no tensor uses any more included, until the next safe
    point unregisters them)."""
    with _lock:
        return _total()


def register_for_staging(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor``'s storage (host memory, contiguous) is registered with ``device``'s runtime for this call:
    already, or now at its second staging (see the module). ``False`` where the cap is 0, the device is no CUDA
    device, or the storage is not (yet) registered. The call's safe point (:func:`drain`) runs first."""
    if device.type != "cuda":
        return False
    cap = _config.settings().register_bytes
    if cap <= 0 and not (_registered or _pending):
        return False  # (registration off: a few reads)
    with _lock:
        _shrink(cap)  # (a lowered budget)
    drain()
    storage = tensor.untyped_storage()
    pointer, nbytes = storage.data_ptr(), storage.nbytes()
    under_way = False
    try:
        with _lock:
            if pointer in _registering:  # another thread is registering this memory: its answer stands
                return False
            entry = _registered.get(pointer)
            if entry is not None and entry[0] is storage and entry[1] == nbytes:
                _registered.move_to_end(pointer)
                return True
            if cap <= 0 or nbytes > cap or storage in _failed or tensor.is_pinned():  # pinned by torch or others
                return False
            if storage in _evicted and _total() + nbytes > cap:  # unregistered for room once: only into free room
                return False
            if storage not in _seen:
                _seen[storage] = True
                return False
            del _seen[storage]
            evicted = _shrink(cap - nbytes)
            # On the table before the driver's call: the budget counts it, and an interruption leaves no
            # registration untracked (one left behind is unregistered as unused, the driver answering 713).
            mine = (storage, nbytes)
            under_way = True
            _registering.add(pointer)
            _registered[pointer] = mine
        drain()  # (the room made, before registering into it)
        with _lock:  # a range not yet undone in the way (the driver would refuse it), or room still held
            blocked = _overlaps(pointer, nbytes) or _total() > cap
        code = 0 if blocked else int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, _PORTABLE))
        with _lock:
            kept = not blocked and code == 0 and _registered.get(pointer) is mine
            if blocked or code != 0:
                if _registered.get(pointer) is mine:
                    del _registered[pointer]
                for each in evicted:  # evicted for nothing: back at their next stagings
                    _evicted.pop(each, None)
                if code != 0:
                    _failed[storage] = True
            elif not kept:  # taken off meanwhile (unregister_all in another thread): undone at once
                _pending.append((pointer, nbytes, storage))
    finally:
        if under_way:
            with _lock:
                _registering.discard(pointer)
    if code != 0:
        _clear_error()
        _log_failure(code, nbytes)
    elif not kept and not blocked:
        drain()
    return kept


def _overlaps(pointer: int, nbytes: int) -> bool:
    """Whether a range taken off the table and not yet unregistered overlaps ``nbytes`` at ``pointer`` (lock held):
    the old range of a resized storage, where the allocator has since placed other memory."""
    return any(start < pointer + nbytes and pointer < start + size for start, size, _ in _pending)


def _shrink(cap: int) -> list[torch.UntypedStorage]:
    """Take the least recently staged storages off the table, into :data:`_pending`, until at most ``cap`` bytes are
    registered, pending ones included (lock held); returns those storages. Each is pending before it leaves the
    table (an interruption loses none); one whose registration is under way stays."""
    evicted = []
    total = _total()
    for pointer, (storage, nbytes) in list(_registered.items()):
        if total <= cap:
            break
        if pointer in _registering:
            continue
        _pending.append((pointer, nbytes, storage))
        del _registered[pointer]
        _evicted[storage] = True
        evicted.append(storage)
        total -= nbytes
    return evicted


def _total() -> int:
    """Bytes registered: on the table and pending (lock held)."""
    return sum(entry[1] for entry in _registered.values()) + sum(entry[1] for entry in _pending)


@functools.lru_cache(maxsize=None)
def _held_only_by_its_object() -> int:
    """Torch's count of a storage's users when only its Python object holds it: measured (a storage whose tensor is
    gone), not assumed."""
    storage = torch.empty(1).untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata)


def _unused(storage: torch.UntypedStorage, pointer: int, nbytes: int) -> bool:
    """Whether no tensor uses ``storage`` any more, or its memory is no longer the range registered (resized)."""
    return (torch._C._storage_Use_Count(storage._cdata) <= _held_only_by_its_object()
            or storage.data_ptr() != pointer or storage.nbytes() != nbytes)


def drain() -> None:
    """The safe point (see the module): take off the table the storages no tensor uses any more (and those resized),
    then unregister every range pending, after events recorded now on the streams staging copies on have completed (the
    host waits for them, off the module's lock), and let their storages go. Nothing while this thread captures a CUDA
    graph. A range stays pending until the driver has undone it (two threads' safe points may both ask; the second is
    answered 713, and its storage, held by both, is not freed before): one it refuses to unregister (another thread's
    capture in global mode, say), or that an interruption leaves, waits for the next safe point. Reads two containers
    where nothing is registered or pending. (A live storage evicted while another thread's call copies from it: that
    thread may queue a copy after the events are recorded; the driver's unregister returns only once the device's queued
    work is done, seen on one H200, and copies queued after it take the pageable path.)"""
    if not (_registered or _pending):
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    with _lock:
        for pointer, (storage, nbytes) in list(_registered.items()):
            if pointer not in _registering and _unused(storage, pointer, nbytes):
                _pending.append((pointer, nbytes, storage))
                del _registered[pointer]
        taken = list(_pending)
    if not taken:
        return
    for event in [stream.record_event() for stream in _groups.copy_streams()]:
        event.synchronize()
    for item in taken:
        code = int(torch.cuda.cudart().cudaHostUnregister(item[0]))
        if code != 0:
            _clear_error()
        if code in (0, _NOT_REGISTERED):  # (713: the driver holds nothing there; another safe point undid it)
            with _lock:
                if item in _pending:
                    _pending.remove(item)


def unregister_all() -> None:
    """Unregister every storage staging registered, as the safe point does (:func:`drain`); during this thread's
    CUDA graph capture, at the next safe point after it."""
    with _lock:
        _pending.extend((pointer, nbytes, storage) for pointer, (storage, nbytes) in _registered.items())
        _registered.clear()
    drain()


def _log_failure(code: int, nbytes: int) -> None:
    global _logged_failure
    if not _logged_failure:
        _logged_failure = True
        _log.warning("offload_shim: cudaHostRegister failed (CUDA error %d) for a storage of %d bytes; it, and any "
                     "other whose registration fails, is staged from pageable memory (%s=0 stops registering)",
                     code, nbytes, _config.ENV_REGISTER_BYTES)


def _clear_error() -> None:
    """Reset the CUDA runtime's last error, which a failed registration sets and torch's next kernel launch check
    would otherwise report as its own."""
    try:
        ctypes.CDLL(None).cudaGetLastError()
    except (AttributeError, OSError):  # the runtime's symbols are not global here: nothing to reset through them
        pass


@_fork.after_fork
def _forget_the_parents() -> None:
    """In a child made by ``fork()``: the tables describe the parent's registrations; the child forgets them."""
    global _lock
    _lock = threading.Lock()  # (another thread of the parent may have held it at the fork)
    _fork.keep(dict(_registered), list(_pending))  # (the parent's storages, registered in its context: never freed)
    _registered.clear()
    _pending.clear()
    _registering.clear()
    _seen.clear()
    _failed.clear()
    _evicted.clear()
