"""Host registration of pageable memory that is staged again and again (``OFFLOAD_SHIM_REGISTER_BYTES``).

A pageable tensor is staged through pinned bounce buffers: two host copies beside the DMA. Optimizer states, a
reused state dict or weight buffer are staged call after call from the same storage; registering that storage with
the accelerator (``cudaHostRegister``, as ``torch.distributed.checkpoint``'s stager does) page-locks it in place, and
its later calls take the pinned path: DMA straight from and to the caller's memory.

A storage is registered at its second pipelined staging (a storage staged once, as a fresh tensor each step is,
never is), if it fits under the budget: :func:`budget` by default, half of the host's memory shared by the node's
ranks. The least recently staged ones are unregistered to make room, and a storage unregistered so is registered
again only into free room (storages reused in turn beyond the budget would otherwise be registered and unregistered
at every call); one larger than the budget never is. A storage is unregistered as it is freed, by a finalizer on
torch's storage object (which lives exactly as long as the storage): the driver keeps a range registered after its
memory is unmapped (a new mapping there is refused as already registered), and a copy to or from a tensor the
allocator later maps at that address may move the old pages, so the registration must go with the memory. The
finalizer takes no lock (it may run under any) and waits for nothing (no staging copy can still use memory the shim
no longer references); only where this thread is capturing a CUDA graph (where unregistering is illegal), or the
driver refuses, is the pointer left to the module's next call. A storage resized since its registration (its old
memory freed) has the old registration undone at its next pipelined call. A storage is also unregistered when the
budget needs its room, when the budget is lowered (at the next pipelined call), and by :func:`unregister_all` (which
``destroy_process_group()`` of every group and ``release_buffers()`` call); each registration is undone once, by its
finalizer or, detaching it first, by one of these. Before memory still in use is unregistered, the host waits for
events recorded on the streams that staging copies on (:func:`_groups.copy_streams`), which follow every copy queued
so far: never for the whole device, never under the module's lock, and never while a stream of this thread captures
a CUDA graph (the pointers wait for the next call). A registration that fails (the driver's limit, a container's)
leaves the storage pageable, its calls take the bounce path, and one log line says so. Nothing is kept alive: the
registry holds no reference to a storage. A child made by ``fork()`` starts with empty tables: the registrations are
its parent's (the driver's, in the parent's context), which it neither uses nor undoes.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import os
import threading
import weakref

import torch

from offload_shim import _config, _groups

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context, as torch's own stager registers

_lock = threading.Lock()  # around the tables; never held while the device is synchronized or memory unregistered
# data pointer -> (weak reference to the storage, bytes, its finalizer), least recently staged first
_registered: collections.OrderedDict[int, tuple[weakref.ref, int, weakref.finalize]] = collections.OrderedDict()
_seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storages staged once, not registered
_failed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storages whose registration failed
_evicted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # unregistered for room: again only into free room
_pointers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # registered storages -> the pointer registered
_log = logging.getLogger("offload_shim")
_logged_failure = False
# Pointers of registered storages since freed, appended by their finalizer (which may run anywhere, under any lock;
# list.append is atomic): unregistered by it, their table entries dropped at the module's next call (_released); or,
# freed during this thread's CUDA graph capture, unregistered at the next call (_freed_pointers).
_released: list[int] = []
_freed_pointers: list[int] = []
_deferred: list[int] = []  # pointers taken off the table during a CUDA graph capture, unregistered after it


BUDGET = "half of the host's memory (MemTotal, or the cgroup's memory.max where lower) over LOCAL_WORLD_SIZE"


def budget(environ=os.environ) -> int:
    """The default budget of registered memory, in bytes: half of the memory this process's host gives it (the
    smaller of ``MemTotal`` in ``/proc/meminfo`` and its cgroup's ``memory.max``), divided among the ranks of the
    node (``LOCAL_WORLD_SIZE``, which torchrun sets; 1 where unset). Registration locks pages the storage already
    holds, so it takes no memory; the budget bounds how much of it cannot be swapped or reclaimed. The driver's
    pinning is not counted against ``ulimit -l``. 0 where the host does not say (no ``/proc``)."""
    sizes = [size for size in (_meminfo_total(), _cgroup_limit()) if size]
    if not sizes:
        return 0
    try:
        ranks = max(1, int(environ.get("LOCAL_WORLD_SIZE") or 1))
    except ValueError:
        ranks = 1
    return min(sizes) // 2 // ranks


@functools.lru_cache(maxsize=None)
def _meminfo_total() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@functools.lru_cache(maxsize=None)
def _cgroup_limit() -> int | None:
    """This process's cgroup memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), ``None`` if none."""
    try:
        with open("/proc/self/cgroup") as cgroups:
            entries = [line.strip().split(":", 2) for line in cgroups if line.strip()]
    except OSError:
        return None
    for hierarchy, controllers, path in entries:
        names = ("memory.max",) if hierarchy == "0" else ("memory.limit_in_bytes",) if "memory" in controllers else ()
        root = "/sys/fs/cgroup" if hierarchy == "0" else "/sys/fs/cgroup/memory"
        for name in names:
            # The cgroup's folder, or the mount's root where a container shows its own cgroup there.
            for folder in (os.path.join(root, path.lstrip("/")), root):
                try:
                    with open(os.path.join(folder, name)) as limit:
                        value = limit.read().strip()
                except OSError:
                    continue
                if value.isdigit() and int(value) < 1 << 60:  # not "max", nor v1's "no limit" (a huge number)
                    return int(value)
                break
    return None


def _cap() -> int:
    cap = _config.settings().register_bytes
    return budget() if cap is None else cap


def registered_bytes() -> int:
    """Bytes of pageable host memory registered now."""
    _unregister(_drain())
    with _lock:
        return _total()


def register_for_staging(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor``'s storage (host memory, contiguous) is registered with ``device``'s runtime for
    this call: already, or now at its second staging (see the module). ``False`` where the cap is 0, the device
    is no CUDA device, or the storage is not (yet) registered."""
    if device.type != "cuda":
        return False
    cap = _cap()
    if cap <= 0 and not _registered and not _freed_pointers and not _released and not _deferred:
        return False  # (registration off: a few reads)
    storage = tensor.untyped_storage()
    pointer, nbytes = storage.data_ptr(), storage.nbytes()
    # Freed storages first: until unregistered, their pages stay registered, and a tensor the allocator has since
    # placed in them would look pinned (``is_pinned``) and be passed over as "pinned by others".
    _unregister(_drain())
    done = []
    try:
        with _lock:
            done += _shrink(cap)
            moved = _pointers.pop(storage, pointer)
            if moved != pointer:  # resized since it was registered: its old memory is freed, still registered
                done += _take_off(moved)
            entry = _registered.get(pointer)
            if entry is not None:
                if entry[0]() is storage and entry[1] == nbytes:
                    _registered.move_to_end(pointer)
                    _pointers[storage] = pointer
                    return True
                done += _take_off(pointer)  # another storage at that address, or this one resized
            if cap <= 0 or nbytes > cap or storage in _failed or tensor.is_pinned():  # pinned by torch or others
                return False
            if storage in _evicted and _total() + nbytes > cap:  # unregistered for room once: only into free room
                return False
            if storage not in _seen:
                _seen[storage] = True
                return False
            del _seen[storage]
            done += _shrink(cap - nbytes)
    finally:
        _unregister(done)  # outside the lock: it waits for the copies queued on them
    code = int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, _PORTABLE))
    if code != 0:
        _clear_error()
        with _lock:
            _failed[storage] = True
        _log_failure(code, nbytes)
        return False
    _track(storage, pointer, nbytes)
    return True


def _track(storage, pointer: int, nbytes: int) -> None:
    """Enter ``storage``, registered at ``pointer`` for ``nbytes``, in the table, with the finalizer that unregisters
    it when it is freed (holding the pointer only, not the storage)."""
    finalizer = weakref.finalize(storage, _freed, pointer, os.getpid())
    finalizer.atexit = False  # (the process's end releases its registrations)
    with _lock:
        _registered[pointer] = (weakref.ref(storage), nbytes, finalizer)
        _pointers[storage] = pointer


def _freed(pointer: int, pid: int) -> None:
    """The finalizer of a registered storage (see the module): unregister its memory as it is freed, without the
    lock and without waiting; during this thread's CUDA graph capture, or where the driver refuses, at the module's
    next call; in a child made by ``fork()``, never (the registration is its parent's)."""
    if pid != os.getpid():
        return
    try:
        if not torch.cuda.is_current_stream_capturing():
            if int(torch.cuda.cudart().cudaHostUnregister(pointer)) == 0:
                _released.append(pointer)
                return
            _clear_error()  # (refused: another thread's capture in global mode, say)
    except Exception:  # (the interpreter shutting down)
        pass
    _freed_pointers.append(pointer)  # the module's next call unregisters it


def _shrink(cap: int) -> list[int]:
    """Take the least recently staged storages off the table until at most ``cap`` bytes are registered (lock held);
    returns their pointers, for :func:`_unregister`."""
    taken = []
    total = _total()
    while _registered and total > cap:
        pointer, (reference, nbytes, _) = next(iter(_registered.items()))
        storage = reference()
        if storage is not None:
            _evicted[storage] = True
        taken += _take_off(pointer)
        total -= nbytes
    return taken


def _take_off(pointer: int) -> list[int]:
    """Take ``pointer``'s entry off the table (lock held): ``[pointer]`` where the caller is to unregister it (its
    finalizer detached), ``[]`` where there is none or its finalizer has run, or runs, and undoes the registration
    itself."""
    entry = _registered.pop(pointer, None)
    return [pointer] if entry is not None and entry[2].detach() is not None else []


def _total() -> int:
    return sum(entry[1] for entry in _registered.values())


def _drain() -> list[int]:
    """Take freed storages off the table: those their finalizer unregistered (where the table still holds their
    entry, not a later storage's at that address), and those it left to this call, whose pointers it returns for
    :func:`_unregister` whether or not the table still holds them (an eviction may have taken the entry off while
    the finalizer ran; the driver registers nothing else at an address it still holds)."""
    while _released:
        pointer = _released.pop()
        with _lock:
            entry = _registered.get(pointer)
            if entry is not None and entry[0]() is None:
                del _registered[pointer]
    taken = []
    while _freed_pointers:
        pointer = _freed_pointers.pop()
        with _lock:
            entry = _registered.pop(pointer, None)
        if entry is not None:
            entry[2].detach()  # (its finalizer has run, unless the pointer was queued by hand)
        taken.append(pointer)
    return taken


def _unregister(pointers: list[int]) -> None:
    """Unregister ``pointers`` (no lock held): staging may still copy from or into them, so the host first waits for
    events recorded now on the streams it copies on, which follow every copy queued so far; during a CUDA graph
    capture (where waiting is illegal) they are queued again."""
    pointers = list(pointers)
    while _deferred:  # (another thread may take them first)
        try:
            pointers.append(_deferred.pop())
        except IndexError:
            break
    if not pointers:
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        _deferred.extend(pointers)  # (off the table already: undone by the next call outside the capture)
        return
    for event in [stream.record_event() for stream in _groups.copy_streams()]:
        event.synchronize()
    for pointer in pointers:
        if int(torch.cuda.cudart().cudaHostUnregister(pointer)) != 0:
            _clear_error()


def unregister_all() -> None:
    """Unregister every storage staging registered."""
    taken = _drain()
    with _lock:
        for pointer in list(_registered):
            taken += _take_off(pointer)
    _unregister(taken)


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


def _forget_the_parents() -> None:
    """In a child made by ``fork()``: the tables describe the parent's registrations; the child forgets them."""
    global _lock
    _lock = threading.Lock()  # (another thread of the parent may have held it at the fork)
    _registered.clear()
    _seen.clear()
    _failed.clear()
    _evicted.clear()
    _pointers.clear()
    _released.clear()
    _freed_pointers.clear()
    _deferred.clear()


os.register_at_fork(after_in_child=_forget_the_parents)
