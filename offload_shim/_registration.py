"""Host registration of pageable memory that is staged again and again (``OFFLOAD_SHIM_REGISTER_BYTES``).

A pageable tensor is staged through pinned bounce buffers: two host copies beside the DMA. Optimizer states, a
reused state dict or weight buffer are staged call after call from the same storage; registering that storage with
the accelerator (``cudaHostRegister``, as ``torch.distributed.checkpoint``'s stager does) page-locks it in place, and
its later calls take the pinned path: DMA straight from and to the caller's memory.

A storage is registered at its second pipelined staging, if it fits under the cap (the least recently staged ones
unregistered to make room; a storage larger than the cap never is), and unregistered: once it is freed (a
finalizer on torch's storage object, which lives exactly as long as the storage, queues it, and the module's next
call unregisters it: never the finalizer itself, which may run during a CUDA graph capture or under any lock), when
the cap needs its room, when the cap is lowered (at the next pipelined call), and by :func:`unregister_all` (which
``destroy_process_group()`` of every group and ``release_buffers()`` call). The device is waited for before memory is
unregistered, outside the module's lock, and never while a stream of this thread captures a CUDA graph (the
pointers wait for the next call). A registration that fails leaves the storage pageable, and the call takes the
bounce path. Nothing is kept alive: the registry holds no reference to a storage. A child made by ``fork()`` starts
with empty tables: the registrations are its parent's (the driver's, in the parent's context), which it neither
uses nor undoes.
"""

from __future__ import annotations

import collections
import ctypes
import os
import threading
import weakref

import torch

from offload_shim import _config

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context, as torch's own stager registers

_lock = threading.Lock()  # around the tables; never held while the device is synchronized or memory unregistered
# data pointer -> (weak reference to the storage, bytes), least recently staged first
_registered: collections.OrderedDict[int, tuple[weakref.ref, int]] = collections.OrderedDict()
_seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storages staged once, not registered
_failed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storages whose registration failed
# Pointers of registered storages since freed, queued by their finalizer (which may run anywhere: inside a CUDA graph
# capture, under any lock) and unregistered at the next call of this module's (list.append is atomic).
_freed_pointers: list[int] = []
_deferred: list[int] = []  # pointers taken off the table during a CUDA graph capture, unregistered after it


def registered_bytes() -> int:
    """Bytes of pageable host memory registered now."""
    _unregister(_drain())
    with _lock:
        return sum(nbytes for _, nbytes in _registered.values())


def register_for_staging(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor``'s storage (host memory, contiguous) is registered with ``device``'s runtime for
    this call: already, or now at its second staging (see the module). ``False`` where the cap is 0, the device
    is no CUDA device, or the storage is not (yet) registered."""
    cap = _config.settings().register_bytes
    if cap <= 0 and not _registered and not _freed_pointers or device.type != "cuda":
        return False  # (the common case, at the cost of a few reads)
    storage = tensor.untyped_storage()
    pointer, nbytes = storage.data_ptr(), storage.nbytes()
    done = _drain()
    try:
        with _lock:
            done += _shrink(cap)
            entry = _registered.get(pointer)
            if entry is not None:
                if entry[0]() is storage and entry[1] == nbytes:
                    _registered.move_to_end(pointer)
                    return True
                del _registered[pointer]  # another storage at that address: the registered one was freed
                done.append(pointer)
            if cap <= 0 or nbytes > cap or storage in _failed or tensor.is_pinned():  # pinned by torch or others
                return False
            if storage not in _seen:
                _seen[storage] = True
                return False
            del _seen[storage]
            done += _shrink(cap - nbytes)
    finally:
        _unregister(done)  # outside the lock: it waits for the device
    if int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, _PORTABLE)) != 0:
        _clear_error()
        with _lock:
            _failed[storage] = True
        return False
    with _lock:
        _registered[pointer] = (weakref.ref(storage), nbytes)
    weakref.finalize(storage, _freed_pointers.append, pointer)  # holds the pointer only, not the storage
    return True


def _shrink(cap: int) -> list[int]:
    """Take the least recently staged storages off the table until at most ``cap`` bytes are registered (lock held);
    returns their pointers, for :func:`_unregister`."""
    taken = []
    total = sum(nbytes for _, nbytes in _registered.values())
    while _registered and total > cap:
        pointer, (_, nbytes) = _registered.popitem(last=False)
        taken.append(pointer)
        total -= nbytes
    return taken


def _drain() -> list[int]:
    """The pointers freed storages queued, taken off the table (those the table still holds)."""
    taken = []
    while _freed_pointers:
        pointer = _freed_pointers.pop()
        with _lock:
            if _registered.pop(pointer, None) is not None:
                taken.append(pointer)
    return taken


def _unregister(pointers: list[int]) -> None:
    """Unregister ``pointers`` (no lock held): the device may still copy from or into them, so it is waited for
    first, once; during a CUDA graph capture (where waiting for the device is illegal) they are queued again."""
    pointers = pointers + [_deferred.pop() for _ in range(len(_deferred))]
    if not pointers:
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        _deferred.extend(pointers)  # (off the table already: undone by the next call outside the capture)
        return
    torch.cuda.synchronize()
    for pointer in pointers:
        if int(torch.cuda.cudart().cudaHostUnregister(pointer)) != 0:
            _clear_error()


def unregister_all() -> None:
    """Unregister every storage staging registered."""
    taken = _drain()
    with _lock:
        taken += list(_registered)
        _registered.clear()
    _unregister(taken)


def _clear_error() -> None:
    """Reset the CUDA runtime's last error, which a failed registration sets and torch's next kernel launch check
    would otherwise report as its own."""
    try:
        ctypes.CDLL(None).cudaGetLastError()
    except (AttributeError, OSError):  # the runtime's symbols are not global here: nothing to reset through them
        pass


def _forget_the_parents() -> None:
    """In a child made by ``fork()``: the tables describe the parent's registrations; the child forgets them."""
    global _lock
    _lock = threading.Lock()  # (another thread of the parent may have held it at the fork)
    _registered.clear()
    _seen.clear()
    _failed.clear()
    _freed_pointers.clear()
    _deferred.clear()


os.register_at_fork(after_in_child=_forget_the_parents)
