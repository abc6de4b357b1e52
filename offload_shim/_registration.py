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

import ctypes
import functools
import logging

import torch

from offload_shim import _config, _groups
from offload_shim._state import state

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context, as torch's own stager registers
_NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered: nothing left to undo

# state.registration_lock: around the tables; never held while memory is registered or unregistered, nor events
# waited. state.registered: data pointer -> (the storage, bytes registered), least recently staged first; it holds
# the storage, so its memory is not freed before the safe point unregisters it. state.unregistering: taken off the
# table and still registered, (pointer, bytes, storage): unregistered, and the storage let go, by the next safe
# point, which drops each only once the driver has undone it. state.registering: pointers whose registration is under
# way (the driver's call in flight). state.staged_once: storages staged once, not registered; state.registration_failed:
# whose registration failed; state.evicted: unregistered for room, again only into free room.
_log = logging.getLogger("offload_shim")


def registered_bytes() -> int:
    """Bytes of pageable host memory registered now (storages no tensor uses any more included, until the next safe
    point unregisters them)."""
    with state.registration_lock:
        return _total()


def register_for_staging(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor``'s storage (host memory, contiguous) is registered with ``device``'s runtime for this call:
    already, or now at its second staging (see the module). ``False`` where the cap is 0, the device is no CUDA
    device, or the storage is not (yet) registered. The call's safe point (:func:`drain`) runs first."""
    if device.type != "cuda":
        return False
    cap = _config.settings().register_bytes
    if cap <= 0 and not (state.registered or state.unregistering):
        return False  # (registration off: a few reads)
    with state.registration_lock:
        _shrink(cap)  # (a lowered budget)
    drain()
    storage = tensor.untyped_storage()
    pointer, nbytes = storage.data_ptr(), storage.nbytes()
    under_way = False
    try:
        with state.registration_lock:
            if pointer in state.registering:  # another thread is registering this memory: its answer stands
                return False
            entry = state.registered.get(pointer)
            if entry is not None and entry[0] is storage and entry[1] == nbytes:
                state.registered.move_to_end(pointer)
                return True
            if cap <= 0 or nbytes > cap or storage in state.registration_failed or tensor.is_pinned():  # pinned by torch or others
                return False
            if storage in state.evicted and _total() + nbytes > cap:  # unregistered for room once: only into free room
                return False
            if storage not in state.staged_once:
                state.staged_once[storage] = True
                return False
            del state.staged_once[storage]
            evicted = _shrink(cap - nbytes)
            # On the table before the driver's call: the budget counts it, and an interruption leaves no
            # registration untracked (one left behind is unregistered as unused, the driver answering 713).
            mine = (storage, nbytes)
            under_way = True
            state.registering.add(pointer)
            state.registered[pointer] = mine
        drain()  # (the room made, before registering into it)
        with state.registration_lock:  # a range not yet undone in the way (the driver would refuse it), or room still held
            blocked = _overlaps(pointer, nbytes) or _total() > cap
        code = 0 if blocked else int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, _PORTABLE))
        with state.registration_lock:
            kept = not blocked and code == 0 and state.registered.get(pointer) is mine
            if blocked or code != 0:
                if state.registered.get(pointer) is mine:
                    del state.registered[pointer]
                for each in evicted:  # evicted for nothing: back at their next stagings
                    state.evicted.pop(each, None)
                if code != 0:
                    state.registration_failed[storage] = True
            elif not kept:  # taken off meanwhile (unregister_all in another thread): undone at once
                state.unregistering.append((pointer, nbytes, storage))
    finally:
        if under_way:
            with state.registration_lock:
                state.registering.discard(pointer)
    if code != 0:
        _clear_error()
        _log_failure(code, nbytes)
    elif not kept and not blocked:
        drain()
    return kept


def _overlaps(pointer: int, nbytes: int) -> bool:
    """Whether a range taken off the table and not yet unregistered overlaps ``nbytes`` at ``pointer`` (lock held):
    the old range of a resized storage, where the allocator has since placed other memory."""
    return any(start < pointer + nbytes and pointer < start + size for start, size, _ in state.unregistering)


def _shrink(cap: int) -> list[torch.UntypedStorage]:
    """Take the least recently staged storages off the table, into :data:`state.unregistering`, until at most ``cap`` bytes are
    registered, pending ones included (lock held); returns those storages. Each is pending before it leaves the
    table (an interruption loses none); one whose registration is under way stays."""
    evicted = []
    total = _total()
    for pointer, (storage, nbytes) in list(state.registered.items()):
        if total <= cap:
            break
        if pointer in state.registering:
            continue
        state.unregistering.append((pointer, nbytes, storage))
        del state.registered[pointer]
        state.evicted[storage] = True
        evicted.append(storage)
        total -= nbytes
    return evicted


def _total() -> int:
    """Bytes registered: on the table and pending (lock held)."""
    return sum(entry[1] for entry in state.registered.values()) + sum(entry[1] for entry in state.unregistering)


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
    if not (state.registered or state.unregistering):
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    with state.registration_lock:
        for pointer, (storage, nbytes) in list(state.registered.items()):
            if pointer not in state.registering and _unused(storage, pointer, nbytes):
                state.unregistering.append((pointer, nbytes, storage))
                del state.registered[pointer]
        taken = list(state.unregistering)
    if not taken:
        return
    for event in [stream.record_event() for stream in _groups.copy_streams()]:
        event.synchronize()
    for item in taken:
        code = int(torch.cuda.cudart().cudaHostUnregister(item[0]))
        if code != 0:
            _clear_error()
        if code in (0, _NOT_REGISTERED):  # (713: the driver holds nothing there; another safe point undid it)
            with state.registration_lock:
                if item in state.unregistering:
                    state.unregistering.remove(item)


def unregister_all() -> None:
    """Unregister every storage staging registered, as the safe point does (:func:`drain`); during this thread's
    CUDA graph capture, at the next safe point after it."""
    with state.registration_lock:
        state.unregistering.extend((pointer, nbytes, storage) for pointer, (storage, nbytes) in state.registered.items())
        state.registered.clear()
    drain()


def _log_failure(code: int, nbytes: int) -> None:
    if not state.registration_failure_logged:
        state.registration_failure_logged = True
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
