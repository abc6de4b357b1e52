"""Device and backend resolution: which device types a process group serves, through which backends, where this
rank stages, and the errors that say why it cannot.

Which device types a group serves comes from the group's own record (``ProcessGroup._device_types``, the device
types that have a backend registered on it, which is what ``ProcessGroup::getBackend`` dispatches on); where a
group keeps no record (a torch without it, or a group implemented in Python, such as torch's threaded test groups
and backends registered with ``Backend.register_backend``), from ``Backend.backend_capability`` for the group's
backend names, which is where torch records what a registered backend serves. The staging device for host tensors
(:func:`staging_device`) is the configured one, else the device bound to the group (``ProcessGroup.bound_device_id``),
else the current ``torch.accelerator`` device. What a call does with these answers is decided in ``_plan``.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import threading
import warnings
import weakref

import torch
import torch.distributed as dist

from offload_shim import _config
from offload_shim._state import state


_log = logging.getLogger("offload_shim")


class StagingError(RuntimeError):
    """A CPU tensor reached a collective whose process group serves no CPU backend, and it cannot be staged
    through an accelerator from this process. The caller's tensors are unchanged.

    Subclasses ``RuntimeError``, the type of torch's own ``No backend type associated with device type cpu``.
    """


class Group:
    """What offload_shim knows and keeps of one process group: one record (:func:`record`), read once where the group
    is first met, since a group's backends are fixed when it is made, and read by the served path and the decision
    alike.

    Read once: ``served`` (the device types it has a backend for), ``backends`` (device type -> backend name,
    ``'gloo'``, ``'nccl'``, ...), ``description`` (torch's backend string, ``'cpu:gloo,cuda:nccl'``), ``cpu`` (the
    backend that serves the host, or ``None``), ``plain`` (one backend serves the host and every other device type:
    nothing to route a host tensor to), ``ordered`` (device type -> whether that backend orders its collectives on
    the device's streams, as torch records in ``Backend.backend_capability``: one that serves the accelerator only),
    ``nccl`` (an NCCL-only group whose small calls CUDA graphs may replay), ``store`` (the group's own store) and
    ``bound`` (``ProcessGroup.bound_device_id``). Kept as calls go: the ranks' ``agreement`` and its ``lock``, the
    copy ``lanes``, ``out_of_step`` (why its collectives no longer pair alike), the served path's ``below`` (the size
    below which its host-only calls go to torch, ``None`` until found), ``device`` (``(settings, device)``: the
    staging device fixed by the group and those settings), whether ``passed`` (its calls go to torch, logged), and
    ``unchecked`` (a future completed once the latest asynchronous chunked call's agreement has been checked, on its
    completion lane, and complete until there is one: a later staged call on the group waits for it before sending
    anything)."""

    __slots__ = ("ref", "served", "backends", "description", "cpu", "plain", "ordered", "nccl", "store", "bound",
                 "lock", "agreement", "lanes", "out_of_step", "below", "device", "passed", "unchecked", "__weakref__")

    def __init__(self, group: dist.ProcessGroup, ref):
        self.ref = ref
        self.description = backend_description(group)
        devices = getattr(group, "_device_types", None)
        capability = dist.Backend.backend_capability
        if devices:
            self.served = frozenset(d.type for d in devices)
        else:  # no record of its own: what torch recorded for its backends when they were registered
            names = [part.split(":")[-1].strip().lower() for part in self.description.split(",")]
            self.served = frozenset(t for name in names for t in capability.get(name, ()))
        self.backends = {t: _backend_named(self.description, t) for t in self.served}
        self.cpu = self.backends.get("cpu")
        self.plain = self.cpu is not None and all(name == self.cpu for name in self.backends.values())
        self.ordered = {t: "cpu" not in capability.get(name or "", ("cpu",)) for t, name in self.backends.items()}
        self.nccl = self.description.lower() == "nccl" and dist.get_debug_level() != dist.DebugLevel.DETAIL
        entry = getattr(dist.distributed_c10d._world, "pg_map", {}).get(group)
        self.store = None if entry is None else entry[1]  # a prefix of the job's store no other group shares
        self.bound = getattr(group, "bound_device_id", None)
        self.lock = threading.Lock()
        self.agreement = None
        self.lanes: dict = {}
        self.out_of_step: str | None = None
        self.below: float | None = None
        self.device = None
        self.passed = False
        self.unchecked = concurrent.futures.Future()
        self.unchecked.set_result(None)


def _backend_named(description: str, device_type: str) -> str | None:
    if ":" not in description:
        return description.lower()
    for part in description.split(","):
        kind, _, name = part.partition(":")
        if kind.strip() == device_type:
            return name.strip().lower()
    return None


def record(group: dist.ProcessGroup) -> Group:
    """The record of ``group`` (:class:`Group`), made at its first use. Records are kept by the group's identity
    (``state.groups``) and never keep a group alive: one goes with its group, or with ``forget``."""
    found = state.groups.get(id(group))
    if found is not None and found.ref() is group:
        return found
    with state.groups_lock:
        found = state.groups.get(id(group))
        if found is None or found.ref() is not group:
            key, groups = id(group), state.groups
            try:  # freed, the group's record goes from the table it is in (unless another group's is there now)
                ref = weakref.ref(group, lambda gone: groups.get(key) is not None and groups[key].ref is gone
                                  and groups.pop(key, None))
            except TypeError:  # a group type without weak references: kept until forgotten
                ref = lambda: group  # noqa: E731
            found = groups[key] = Group(group, ref)
    return found


def forget(group: dist.ProcessGroup | None = None) -> list[Group]:
    """Drop the record of ``group`` (of every group for ``None``) and return what was dropped."""
    with state.groups_lock:
        if group is None:
            dropped = list(state.groups.values())
            state.groups.clear()
            return dropped
        found = state.groups.get(id(group))
        if found is None or found.ref() is not group:
            return []
        return [state.groups.pop(id(group))]


def host_calls_served(group: dist.ProcessGroup) -> bool:
    """Whether every call on ``group`` goes to torch untouched, whatever its host tensors, under the current
    settings: one backend serves CPU and every other device type of the group (a plain Gloo group: no other backend
    to route a host tensor to, none to stage a mixed call's host tensors through), and ``always_stage`` is off."""
    return record(group).plain and not _config.settings().always_stage


def backend_description(group: dist.ProcessGroup) -> str:
    """The group's backend configuration as torch names it, e.g. ``'nccl'`` or ``'cpu:gloo,cuda:nccl'``."""
    try:
        return str(dist.get_backend(group))
    except Exception:  # a group torch does not know by handle (never expected): describe what we can
        return "unknown"


def unreadable(group: dist.ProcessGroup) -> bool:
    """Whether the device types ``group`` serves cannot be read (no record of its own, none in
    ``Backend.backend_capability`` for its backend: a Python process group registered with ``devices=[]``, say).
    The shim cannot tell what such a group serves, so its calls go to torch untouched, in every mode; the first time
    per group, one log line says so (``offload-shim doctor`` says it for the default group)."""
    if record(group).served:
        return False
    passed_through(group, "it records no device types (neither the group nor "
                          "torch.distributed.Backend.backend_capability)")
    return True


def passed_through(group: dist.ProcessGroup, why: str) -> None:
    """Say once per group, in one log line, that its calls go to torch untouched, never staged, and ``why``."""
    found = record(group)
    if not found.passed:
        found.passed = True
        _log.warning("offload_shim: process group %s with backend %r: its calls go to torch untouched, never staged: "
                     "%s", group_label(group), backend_description(group), why)


def group_label(group: dist.ProcessGroup) -> str:
    try:  # (a Python process group's property may raise: torch's test groups raise until named)
        name = getattr(group, "group_name", None)
    except Exception:  # noqa: BLE001
        name = None
    desc = getattr(group, "group_desc", None)
    return f"{name!r}" + (f" ({desc})" if desc and desc != "undefined" else "")


def resolve_c10d_group(group) -> dist.ProcessGroup | None:
    """The process group a ``torch.distributed`` collective will use: ``group``, or the default group for
    ``None``. ``None`` when there is none (torch then raises its own error) or when ``group`` is not a
    process group (e.g. ``GroupMember.NON_GROUP_MEMBER``, for which torch returns without communicating)."""
    if group is None:
        group = dist.group.WORLD  # None until init_process_group
    return group if isinstance(group, dist.ProcessGroup) else None


def resolve_functional_group(group, tag: str = "") -> dist.ProcessGroup | None:
    """The process group a functional collective (``torch.distributed._functional_collectives``) will use.

    ``group`` is anything those functions take: a ``ProcessGroup``, a group name, a 1-D ``DeviceMesh``, a
    ``(DeviceMesh, dim)`` pair, or a list of ranks. ``None`` when it cannot be resolved (torch then raises).
    """
    if isinstance(group, dist.ProcessGroup):
        return group
    try:
        if isinstance(group, tuple) and len(group) == 2 and hasattr(group[0], "get_group"):
            return group[0].get_group(group[1])
        if hasattr(group, "get_group") and hasattr(group, "ndim"):
            return group.get_group(0) if group.ndim == 1 else None
        import torch.distributed._functional_collectives as funcol

        with warnings.catch_warnings():
            # A list of ranks is deprecated: torch's own call, just after ours, warns once.
            warnings.simplefilter("ignore", FutureWarning)
            name = funcol._resolve_group_name(group, tag)
        return dist.distributed_c10d._resolve_process_group(name)
    except Exception:
        return None


def _usable(device: torch.device) -> bool:
    """Whether this process can stage through accelerator ``device``. Cached: a process's accelerators do not
    change, and asking the runtime costs more than a small staged call's copies."""
    usable = state.usable_devices.get(device)
    if usable is None:
        accelerator = torch.accelerator.current_accelerator()
        usable = accelerator is not None and accelerator.type == device.type and torch.accelerator.is_available()
        usable = usable and (device.index is None or device.index < torch.accelerator.device_count())
        state.usable_devices[device] = usable
    return usable


def staging_device(group: dist.ProcessGroup, served: frozenset[str], settings) -> tuple[torch.device | None, str]:
    """The device through which this rank stages host tensors for ``group``, and whether that depends on the group
    and the settings alone (``fixed``: a configured device, or the group's bound one; otherwise the current
    accelerator device, which the program may change): ``(device, fixed)``, or ``(None, why)`` where no device of a
    type the group serves is usable from this process (``why``: a sentence). A configured ``cpu`` is the testing
    configuration: a device, where the group serves CPU."""
    device = settings.staging_device
    fixed = device is not None
    if device is None:
        bound = record(group).bound
        fixed = bound is not None and bound.type in served
        device = bound if fixed else _accelerator_device(served)
    if device is not None and device.type != "cpu" and not _usable(device):
        device = None
    if device is not None and device.type in served:
        return device, fixed
    return None, _why_unstageable(served, settings.staging_device)


def _accelerator_device(served: frozenset[str]) -> torch.device | None:
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type not in served or not torch.accelerator.is_available():
        return None
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    """The group's timeout (what its collectives wait for their peers): its backends' option, else the store's."""
    for device_type in sorted(record(group).served):
        try:
            return group._get_backend(torch.device(device_type)).options._timeout
        except Exception:  # a backend without that record (a Python one)
            continue
    store = record(group).store
    return getattr(store, "timeout", None) or datetime.timedelta(minutes=30)


# Where a backend serves an accelerator's tensors for some collectives only, the collectives it runs on them, by
# backend and device type; a collective not listed is staged through the host. torch offers no query for this (its
# documentation gives Gloo's CUDA support as broadcast and all_reduce). Gloo and CUDA, measured with torch 2.11 on
# an H200, two ranks sharing the GPU on a plain Gloo group: these gave the right results; send, recv and
# batch_isend_irecv ended the job (Gloo hands the device pointer to its socket: "writev ...: Bad address"), and the
# functional all_gather_tensor killed the ranks.
PARTLY_SERVED = {
    ("gloo", "cuda"): frozenset(
        f"torch.distributed.{name}"
        for name in (
            "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "gather",
            "scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single",
        )
    ) | {"torch.distributed._functional_collectives.all_reduce"},
}
# What torch raises, before any communication, for a tensor whose device type no backend of the group serves
# (``ProcessGroup::getBackend``).
NO_BACKEND = "No backend type associated with device type"


def refused_for_host(collective: str) -> bool:
    """Whether an accelerator tensor needs the host for ``collective`` only where the group has no backend for its
    device type at all: every backend that serves an accelerator in part still runs this collective on it
    (:data:`PARTLY_SERVED`). Such calls go to torch undecided, and torch's own refusal (:data:`NO_BACKEND`), raised
    on every rank before any communication, is what sends them to the host: the calls that need no staging cost
    nothing more."""
    return all(collective in names for names in PARTLY_SERVED.values())


def lacks_backend(error: BaseException) -> bool:
    """Whether ``error`` is torch's refusal of a tensor whose device type the group has no backend for."""
    return isinstance(error, RuntimeError) and NO_BACKEND in str(error)


def torch_first(wrapped, args, kwargs) -> tuple[object, RuntimeError | None]:
    """Torch's own call, for accelerator tensors on a collective that needs the host only where torch refuses them
    (:func:`refused_for_host`): ``(result, None)``, or ``(None, refusal)`` where torch refused their device type
    and host staging is on (:func:`sends_to_host`); the caller raises the refusal where it stages nothing. Any
    other error propagates as torch raised it. (The served paths of ``_wrappers`` write this out inline.)"""
    try:
        return wrapped(*args, **kwargs), None
    except RuntimeError as error:
        if not sends_to_host(error):
            raise
        return None, error


def sends_to_host(error: RuntimeError) -> bool:
    """Whether torch's ``error`` sends a call of accelerator tensors to the host: torch refused their device type
    (:func:`lacks_backend`), and host staging is on."""
    return _config.settings().host_staging and lacks_backend(error)


# Device types whose tensors are never staged through the host: the host's own, and ``meta``, which holds no data.
_NOT_THROUGH_HOST = frozenset({"cpu", "meta"})


def accelerator_call_served(group: dist.ProcessGroup, device_type: str, collective: str) -> bool:
    """Whether a call of ``collective`` on ``group`` with tensors of ``device_type`` (not the host's) goes to torch
    untouched: host staging is off, the group serves no CPU, or it runs this collective on them itself (a backend
    serves that device type, for this collective: :data:`PARTLY_SERVED`). The served path's question for the
    accelerator's own calls (FSDP2's gathers, a training loop's all_reduce)."""
    if not _config.settings().host_staging or device_type in _NOT_THROUGH_HOST:
        return True
    found = record(group)
    only = PARTLY_SERVED.get((found.backends.get(device_type), device_type))
    return "cpu" not in found.served or device_type in found.served and (only is None or collective in only)


def unstaged_layout(tensor, group, collective: str, served) -> None:
    """``None`` (left to torch) for a sparse, nested or quantized CPU tensor, or one of a tensor subclass with its own
    ``__torch_dispatch__``, on a group that serves CPU; otherwise
    :class:`StagingError`, on every rank before any collective: the accelerator backends have no sparse
    collectives (NCCL: 'NCCL does not support all_reduce with sparse tensors'), and a quantized tensor cannot be
    copied as its bytes, so staging could only fail later (on some ranks only: a broadcast's receivers copy
    nothing in), or convert behind the caller's back."""
    if "cpu" in served:
        return None
    if tensor.layout == torch.strided and not tensor.is_nested and not tensor.is_quantized:  # a dispatch subclass
        raise StagingError(
            f"offload_shim: {collective} got a {type(tensor).__name__} on {tensor.device} ({tuple(tensor.shape)}, "
            f"{tensor.dtype}), a tensor subclass with a __torch_dispatch__ of its own, and process group "
            f"{group_label(group)} with backend {backend_description(group)!r} serves device types {sorted(served)} "
            f"only. offload_shim stages tensors whose bytes are their values only. Ways out: pass its plain tensors "
            f"(a DTensor's to_local(), or full_tensor()); or give the group a CPU backend, e.g. "
            f"init_process_group({with_cpu_backend(group, served)!r}). The tensor was not modified."
        )
    if tensor.is_quantized:
        kind, dense = "quantized", "tensor.dequantize()"
    else:
        kind, dense = "nested" if tensor.is_nested else str(tensor.layout).replace("torch.", ""), "tensor.to_dense()"
    raise StagingError(
        f"offload_shim: {collective} got a {kind} tensor on {tensor.device} ({tuple(tensor.shape)}, {tensor.dtype}), "
        f"and process group {group_label(group)} with backend {backend_description(group)!r} serves device types "
        f"{sorted(served)} only. offload_shim stages dense (strided), unquantized tensors only: the accelerator "
        f"backends have no {kind} collectives. Ways out: pass a dense tensor ({dense}); or give the group a CPU "
        f"backend, e.g. init_process_group({with_cpu_backend(group, served)!r}), which Gloo serves for sparse COO "
        f"all_reduce. The tensor was not modified."
    )


def _why_unstageable(served, configured) -> str:
    accelerator = torch.accelerator.current_accelerator()
    if configured is not None:
        named = (f"the configured staging device {str(configured)!r} (configure(staging_device=...) or "
                 f"{_config.ENV_STAGING_DEVICE})")
        if configured.type not in served:
            return (f"{named} is of type {configured.type!r}, which the group does not serve (staging through "
                    f"'cpu' is for a group whose backend serves CPU, such as plain 'gloo')")
        return f"{named} is not usable from this process"
    if accelerator is None:
        return "this process has no accelerator (torch.accelerator.current_accelerator() is None)"
    if accelerator.type not in served:
        return f"this process's accelerator is {accelerator.type!r}, which the group does not serve"
    return f"this process's accelerator {accelerator.type!r} is not available"


def unstageable_message(tensor, group, collective: str, served, why: str) -> str:
    return (
        f"offload_shim: {collective} got a tensor on {tensor.device} ({tuple(tensor.shape)}, {tensor.dtype}), but "
        f"process group {group_label(group)} with backend {backend_description(group)!r} serves device types "
        f"{sorted(served)} only, and staging through an accelerator is impossible: {why}. "
        f"Ways out: run this rank where an accelerator of a served type is usable "
        f"({', '.join(sorted(served))}); or give the group a CPU backend, e.g. "
        f"init_process_group({with_cpu_backend(group, served)!r}) "
        f"(CPU tensors then travel over Gloo); or move the tensor to the accelerator before the call. "
        f"The tensor was not modified. (This is torch's 'No backend type associated with device type cpu'.)"
    )


def with_cpu_backend(group, served) -> str:
    """The group's backend string with Gloo added for CPU, e.g. ``'nccl'`` -> ``'cpu:gloo,cuda:nccl'``."""
    description = backend_description(group)
    if ":" not in description:
        description = ",".join(f"{t}:{description}" for t in sorted(served))
    return f"cpu:gloo,{description}"
