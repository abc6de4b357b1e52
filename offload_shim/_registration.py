"""Host registration of pageable memory that is staged again and again (``OFFLOAD_SHIM_REGISTER_BYTES``).

A pageable tensor is staged through pinned bounce buffers: two host copies beside the DMA. Optimizer states, a
reused state dict or weight buffer are staged call after call from the same storage; registering that storage with
the accelerator (``cudaHostRegister``, as ``torch.distributed.checkpoint``'s stager does) page-locks it in place, and
its later calls take the pinned path: DMA straight from and to the caller's memory.

A storage is registered at its second pipelined staging, if it fits under the cap (the least recently staged ones
unregistered to make room; a storage larger than the cap never is), and unregistered when its storage is freed (a
finalizer on torch's storage object, which lives exactly as long as the storage), when the cap needs its room,
when the cap is lowered (at the next pipelined call), and by :func:`unregister_all` (which
``destroy_process_group()`` of every group and ``release_buffers()`` call). A registration that fails leaves the storage pageable, and
the call takes the bounce path. Nothing is kept alive: the registry holds no reference to a storage.
"""

from __future__ import annotations

import collections
import ctypes
import threading
import weakref

import torch

from offload_shim import _config

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context, as torch's own stager registers

_lock = threading.RLock()  # re-entered where a storage is freed (its finalizer runs) while the lock is held
# data pointer -> (weak reference to the storage, bytes), least recently staged first
_registered: collections.OrderedDict[int, tuple[weakref.ref, int]] = collections.OrderedDict()
_seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storages staged once, not registered
_failed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storages whose registration failed


def registered_bytes() -> int:
    """Bytes of pageable host memory registered now."""
    with _lock:
        return sum(nbytes for _, nbytes in _registered.values())


def register_for_staging(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor``'s storage (host memory, contiguous) is registered with ``device``'s runtime for
    this call: already, or now at its second staging (see the module). ``False`` where the cap is 0, the device
    is no CUDA device, or the storage is not (yet) registered."""
    cap = _config.settings().register_bytes
    if cap <= 0 and not _registered or device.type != "cuda":
        return False  # (the common case, at the cost of two reads)
    storage = tensor.untyped_storage()
    pointer, nbytes = storage.data_ptr(), storage.nbytes()
    with _lock:
        _shrink(cap)
        entry = _registered.get(pointer)
        if entry is not None:
            if entry[0]() is storage and entry[1] == nbytes:
                _registered.move_to_end(pointer)
                return True
            _unregister(pointer)  # another storage at that address: the registered one was resized or freed
        if cap <= 0 or nbytes > cap or storage in _failed or tensor.is_pinned():  # pinned by torch or others
            return False
        if storage not in _seen:
            _seen[storage] = True
            return False
        del _seen[storage]
        _shrink(cap - nbytes)
        if int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, _PORTABLE)) != 0:
            _clear_error()
            _failed[storage] = True
            return False
        _registered[pointer] = (weakref.ref(storage), nbytes)
    weakref.finalize(storage, _freed, pointer)  # holds the pointer only, not the storage
    return True


def _shrink(cap: int) -> None:
    """Unregister the least recently staged storages until at most ``cap`` bytes are registered (lock held)."""
    total = sum(nbytes for _, nbytes in _registered.values())
    while _registered and total > cap:
        pointer, (_, nbytes) = next(iter(_registered.items()))
        _unregister(pointer)
        total -= nbytes


def _unregister(pointer: int) -> None:
    """Unregister ``pointer``'s registration (lock held). The device may still copy from or into it: wait first."""
    _registered.pop(pointer, None)
    torch.cuda.synchronize()
    if int(torch.cuda.cudart().cudaHostUnregister(pointer)) != 0:
        _clear_error()


def _freed(pointer: int) -> None:
    """The storage registered at ``pointer`` is being freed: unregister it (if the cap did not already)."""
    with _lock:
        if pointer in _registered:
            _unregister(pointer)


def unregister_all() -> None:
    """Unregister every storage staging registered."""
    with _lock:
        for pointer in list(_registered):
            _unregister(pointer)


def _clear_error() -> None:
    """Reset the CUDA runtime's last error, which a failed registration sets and torch's next kernel launch check
    would otherwise report as its own."""
    try:
        ctypes.CDLL(None).cudaGetLastError()
    except (AttributeError, OSError):  # the runtime's symbols are not global here: nothing to reset through them
        pass
