"""Device and backend resolution: which device types a process group serves, and where to stage.

The decision for one call (:func:`staging_device_for`):

* the input is not a CPU tensor, or the call comes from inside a staged call: no staging (the caller's call
  runs untouched);
* the group serves CPU: no staging, except that a CPU tensor of at least ``route_min_bytes`` on a group whose
  accelerator is served by another backend (``cpu:gloo,cuda:nccl``) is routed through the accelerator, for
  collectives whose size is the same on every rank (so that every rank takes the same route);
* otherwise the tensor is staged through an accelerator device of a type the group serves: the device bound
  to the group (``ProcessGroup.bound_device_id``), else the current ``torch.accelerator`` device;
* no such device: :class:`StagingError`, raised before any collective is entered, so every rank of the
  group raises it instead of some ranks blocking in the collective.

Which device types a group serves comes from the group's own record (``ProcessGroup._device_types``, the
device types that have a backend registered on it, which is what ``ProcessGroup::getBackend`` dispatches
on); where a torch lacks that record, from ``Backend.backend_capability`` for the group's backend names.
"""

from __future__ import annotations

import logging
import warnings
import weakref

import torch
import torch.distributed as dist

from offload_shim import _config, _counters, _staging


_log = logging.getLogger("offload_shim")


class StagingError(RuntimeError):
    """A CPU tensor reached a collective whose process group serves no CPU backend, and it cannot be staged
    through an accelerator from this process. The caller's tensors are unchanged.

    Subclasses ``RuntimeError``, the type of torch's own ``No backend type associated with device type cpu``.
    """


_served_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_last_served: tuple = (lambda: None, frozenset())  # (weak reference to the last group asked about, its answer)


def served_device_types(group: dist.ProcessGroup) -> frozenset[str]:
    """Device types (``"cpu"``, ``"cuda"``, ...) that have a backend registered on ``group``. Cached per group:
    a group's backends are fixed when it is made, and this is on every collective's path (the last group's
    answer first: a loop of calls on one group asks about it alone)."""
    global _last_served
    last, served = _last_served
    if last() is group:
        return served
    served = _served_cache.get(group)
    if served is None:
        devices = getattr(group, "_device_types", None)
        if devices is not None:
            served = frozenset(d.type for d in devices)
        else:
            served = frozenset(t for name in _backend_names(group) for t in dist.Backend.backend_capability.get(name, ()))
        try:
            _served_cache[group] = served
        except TypeError:  # a group type without weak references: not cached
            return served
    _last_served = (weakref.ref(group), served)
    return served


_last_host_answer: tuple = (lambda: None, None, False)  # (weak reference to a group, the settings then, the answer)


def host_calls_served(group: dist.ProcessGroup) -> bool:
    """Whether every call on ``group`` goes to torch untouched, whatever its host tensors, under the current
    settings: the group serves CPU through the same backend as every other device type it serves (a plain Gloo
    group: no other backend to route a host tensor to, none to stage a mixed call's host tensors through), and
    ``always_stage`` is off. The served path's first question about a group: the answer for the last group and
    settings asked is kept, so a call on a Gloo group costs two identity checks more than torch's."""
    global _last_host_answer
    settings = _config.settings()
    last, last_settings, answer = _last_host_answer
    if last() is group and last_settings is settings:
        return answer
    cpu = backend_for(group, "cpu")
    answer = cpu is not None and not settings.always_stage and all(
        backend_for(group, t) == cpu for t in served_device_types(group)
    )
    try:
        _last_host_answer = (weakref.ref(group), settings, answer)
    except TypeError:  # a group type without weak references: not remembered
        pass
    return answer


def backend_description(group: dist.ProcessGroup) -> str:
    """The group's backend configuration as torch names it, e.g. ``'nccl'`` or ``'cpu:gloo,cuda:nccl'``."""
    try:
        return str(dist.get_backend(group))
    except Exception:  # a group torch does not know by handle (never expected): describe what we can
        return "unknown"


def _backend_names(group: dist.ProcessGroup) -> list[str]:
    names = []
    for part in backend_description(group).split(","):
        names.append(part.split(":")[-1].strip().lower())
    return names


def group_label(group: dist.ProcessGroup) -> str:
    name = getattr(group, "group_name", None)
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


_usable_devices: dict[torch.device, bool] = {}


def _usable(device: torch.device) -> bool:
    """Whether this process can stage through accelerator ``device``. Cached: a process's accelerators do not
    change, and asking the runtime costs more than a small staged call's copies."""
    usable = _usable_devices.get(device)
    if usable is None:
        accelerator = torch.accelerator.current_accelerator()
        usable = accelerator is not None and accelerator.type == device.type and torch.accelerator.is_available()
        usable = usable and (device.index is None or device.index < torch.accelerator.device_count())
        _usable_devices[device] = usable
    return usable


def _accelerator_device(served: frozenset[str]) -> torch.device | None:
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type not in served or not torch.accelerator.is_available():
        return None
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def backend_for(group: dist.ProcessGroup, device_type: str) -> str | None:
    """Name of the backend that serves ``device_type`` on ``group`` (``'gloo'``, ``'nccl'``, ...), from the group's
    backend string (``'cpu:gloo,cuda:nccl'``, or one name for every device type it serves)."""
    if device_type not in served_device_types(group):
        return None
    description = backend_description(group)
    if ":" not in description:
        return description.lower()
    for part in description.split(","):
        kind, _, name = part.partition(":")
        if kind.strip() == device_type:
            return name.strip().lower()
    return None


# The last group whose host tensors were staged through a device fixed by the group and the settings: (weak
# reference to the group, the settings then, the device). One call on that group with those settings decides the
# same way for every dense host tensor, and a small staged call costs little more than this decision.
_last_staged: tuple = (lambda: None, None, None)


def _remember(group: dist.ProcessGroup, settings: _config.Settings, device: torch.device) -> None:
    global _last_staged
    try:
        _last_staged = (weakref.ref(group), settings, device)
    except TypeError:  # a group type without weak references: not remembered
        pass


def staging_device_for(
    tensor: torch.Tensor, group: dist.ProcessGroup, collective: str, route_bytes: int | None = None
) -> torch.device | None:
    """Where to stage ``tensor`` for ``collective`` on ``group``; ``None`` to run the call untouched.

    Args:
        route_bytes: for a collective that may be routed off a group's CPU backend, its size in bytes as every
            rank of the group sees it (the same on every rank, so that every rank takes the same route); ``None``
            for collectives whose sizes may differ per rank, which are never routed.

    Raises:
        StagingError: ``tensor`` is on the CPU, ``group`` serves no CPU backend, and no device of a type the
            group serves is usable from this process.
    """
    if not tensor.is_cpu or _staging.in_staged_call():
        return None
    settings = _config.settings()
    last, last_settings, last_device = _last_staged
    if last() is group and last_settings is settings and _staging.needs_staging(tensor):
        return _staging_through(last_device, tensor, group, collective, _counters.STAGED)  # as decided below before
    served = served_device_types(group)
    cpu_served = "cpu" in served
    if cpu_served and not (settings.always_stage or _routes(route_bytes, settings, group)):
        return None  # the served path: no more work than this on a call that needs no staging
    if not _staging.needs_staging(tensor):  # sparse or nested: left to a CPU backend, never staged
        return _unstaged_layout(tensor, group, collective, served)
    device = settings.staging_device
    fixed = device is not None  # a device that depends on nothing but the group and the settings
    if device is None:
        bound = getattr(group, "bound_device_id", None)
        fixed = bound is not None and bound.type in served
        device = bound if fixed else _accelerator_device(served)  # else the current device, which may change
    if device is not None and device.type != "cpu" and not _usable(device):
        device = None
    if device is not None and device.type in served:
        route = _counters.STAGED
        if cpu_served:
            # Routing off the CPU backend pays only where another backend serves an accelerator to stage through
            # (never through the CPU itself, the testing configuration: there only always_stage stages).
            routed = (
                _routes(route_bytes, settings, group)
                and device.type != "cpu"
                and backend_for(group, device.type) != backend_for(group, "cpu")
            )
            if not (routed or settings.always_stage):
                return None
            route = _counters.ROUTED if routed else _counters.FORCED
        if fixed and not cpu_served:  # the same answer for every dense tensor on this group, whatever its size
            _remember(group, settings, device)
        return _staging_through(device, tensor, group, collective, route, (route_bytes, settings.route_min_bytes))
    if cpu_served:
        return None
    raise StagingError(_unstageable_message(tensor, group, collective, served, settings.staging_device))


def staging_device_for_call(tensors, group: dist.ProcessGroup, collective: str) -> torch.device | None:
    """Where to stage the CPU tensors among ``tensors`` (every tensor argument of one call, inputs and outputs)
    for ``collective`` on ``group``; ``None`` to run the call untouched. Never routed by size: these calls' sizes
    may differ per rank.

    A call whose other tensors are on an accelerator the group serves (``all_gather_into_tensor`` of a CPU input
    into a GPU output) stages its CPU tensors through that tensor's device, where torch runs the call; otherwise
    the choice is :func:`staging_device_for`'s. Sparse tensors, and calls with a tensor on a device the group does
    not serve (``meta``), are left to torch.

    Raises:
        StagingError: as :func:`staging_device_for`.
    """
    if _staging.in_staged_call():
        return None
    host = other = None
    for t in tensors:
        if t.is_cpu:
            host = t if host is None else host
        elif other is None:
            other = t
    if host is None:
        return None
    served = served_device_types(group)
    if other is None and "cpu" in served and not _config.settings().always_stage:
        return None  # the served path: host tensors only, on a group that serves CPU (never routed)
    for t in tensors:
        if t.is_cpu and not _staging.needs_staging(t):
            return _unstaged_layout(t, group, collective, served)
        if not t.is_cpu and t.device.type not in served:
            # On a device the group does not serve (``meta``, which holds no data): torch decides, as without the
            # shim (for ``meta`` it writes nothing), rather than a staged output filled from memory never written.
            return None
    for t in tensors:
        if t.device.type != "cpu" and t.device.type in served:
            if "cpu" not in served or backend_for(group, "cpu") != backend_for(group, t.device.type):
                route = _counters.STAGED if "cpu" not in served else _counters.MIXED
                return _staging_through(t.device, host, group, collective, route)
            return None
    return staging_device_for(host, group, collective)


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
    (:func:`lacks_backend`) and host staging is on; the caller raises the refusal where it stages nothing. Any
    other error propagates as torch raised it."""
    try:
        return wrapped(*args, **kwargs), None
    except RuntimeError as error:
        if not (_config.settings().host_staging and lacks_backend(error)):
            raise
        return None, error


# Device types whose tensors are never staged through the host: the host's own, and ``meta``, which holds no data.
_NOT_THROUGH_HOST = frozenset({"cpu", "meta"})
_accelerator_served: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> {(type, collective): bool}


def serves_accelerator(group: dist.ProcessGroup, device_type: str, collective: str) -> bool:
    """Whether ``group`` runs ``collective`` on tensors of accelerator ``device_type`` itself: a backend serves that
    device type, for this collective (:data:`PARTLY_SERVED`). Cached per group: it is asked on every call of an
    accelerator tensor."""
    answers = _accelerator_served.get(group)
    if answers is None:
        answers = {}
        try:
            _accelerator_served[group] = answers
        except TypeError:  # a group type without weak references: not cached
            pass
    answer = answers.get((device_type, collective))
    if answer is None:
        only = PARTLY_SERVED.get((backend_for(group, device_type), device_type))
        answer = answers[(device_type, collective)] = device_type in served_device_types(group) and (
            only is None or collective in only
        )
    return answer


# (weak reference to a group, device type, collective, the settings then, the answer)
_last_accelerator: tuple = (lambda: None, None, None, None, True)


def accelerator_call_served(group: dist.ProcessGroup, device_type: str, collective: str) -> bool:
    """Whether a call of ``collective`` on ``group`` with tensors of ``device_type`` (not the host's) goes to torch
    untouched: host staging is off, the group runs it on them, or it serves no CPU either. The served path's question
    for the accelerator's own calls (FSDP2's gathers, a training loop's all_reduce): the last answer is kept."""
    global _last_accelerator
    settings = _config.settings()
    last, last_type, last_collective, last_settings, answer = _last_accelerator
    if last() is group and last_type == device_type and last_collective == collective and last_settings is settings:
        return answer
    answer = (
        not settings.host_staging
        or device_type in _NOT_THROUGH_HOST
        or serves_accelerator(group, device_type, collective)
        or "cpu" not in served_device_types(group)
    )
    try:
        _last_accelerator = (weakref.ref(group), device_type, collective, settings, answer)
    except TypeError:  # a group type without weak references: not remembered
        pass
    return answer


def host_staging_for(tensors, group: dist.ProcessGroup, collective: str) -> str | None:
    """The accelerator device type whose tensors among ``tensors`` (every tensor argument of one call) must go
    through the host for ``collective`` on ``group``, or ``None`` where the call needs no host staging: the group has
    no backend for that device type, or its backend has no path for this collective on it (:data:`PARTLY_SERVED`),
    and the group serves CPU. Only those tensors are staged (a call mixing host and accelerator tensors keeps its
    host ones). Where the group serves neither, torch raises its own error; sparse, nested or quantized accelerator
    tensors are left to torch too.

    Raises:
        StagingError: inside torch's ``_coalescing_manager`` (see :func:`staging_device_for`).
    """
    kind = next((t.device.type for t in tensors if t.device.type not in _NOT_THROUGH_HOST), None)
    if kind is None or _staging.in_staged_call() or accelerator_call_served(group, kind, collective):
        return None
    staged = [t for t in tensors if t.device.type == kind]
    if not all(_staging.needs_staging(t, kind) for t in staged):
        return None
    if _staging_through(torch.device("cpu"), staged[0], group, collective, _counters.HOST) is None:
        return None
    return kind


def _unstaged_layout(tensor, group, collective: str, served) -> None:
    """``None`` (left to torch) for a sparse, nested or quantized CPU tensor on a group that serves CPU; otherwise
    :class:`StagingError`, on every rank before any collective: the accelerator backends have no sparse
    collectives (NCCL: 'NCCL does not support all_reduce with sparse tensors'), and a quantized tensor cannot be
    copied as its bytes, so staging could only fail later (on some ranks only: a broadcast's receivers copy
    nothing in), or convert behind the caller's back."""
    if "cpu" in served:
        return None
    if tensor.is_quantized:
        kind, dense = "quantized", "tensor.dequantize()"
    else:
        kind, dense = "nested" if tensor.is_nested else str(tensor.layout).replace("torch.", ""), "tensor.to_dense()"
    raise StagingError(
        f"offload_shim: {collective} got a {kind} tensor on {tensor.device} ({tuple(tensor.shape)}, {tensor.dtype}), "
        f"and process group {group_label(group)} with backend {backend_description(group)!r} serves device types "
        f"{sorted(served)} only. offload_shim stages dense (strided), unquantized tensors only: the accelerator "
        f"backends have no {kind} collectives. Ways out: pass a dense tensor ({dense}); or give the group a CPU "
        f"backend, e.g. init_process_group({_with_cpu_backend(group, served)!r}), which Gloo serves for sparse COO "
        f"all_reduce. The tensor was not modified."
    )


def _staging_through(
    device: torch.device, tensor: torch.Tensor, group, collective: str, route: str, sizes: tuple = (None, None)
) -> torch.device | None:
    """``device``: the decision to stage ``tensor`` for ``collective`` through it, by ``route`` (a route of
    ``_counters``), kept for the call's count (``_counters.decided``) and logged at DEBUG; ``None`` (or
    :class:`StagingError` where the group serves no CPU) inside torch's ``_coalescing_manager`` on ``group``.
    ``sizes``: the call's bytes and ``route_min_bytes``, which say why a routed call is routed."""
    if group in getattr(dist.distributed_c10d._world, "pg_coalesce_state", {}):
        # torch only records the collective there, to run it at the block's end: a staged copy would be copied
        # back before it held the result.
        served = served_device_types(group)
        if "cpu" in served:
            return None
        raise StagingError(
            f"offload_shim: {collective} got a tensor on {tensor.device} ({tuple(tensor.shape)}, {tensor.dtype}) "
            f"inside torch.distributed's _coalescing_manager on process group {group_label(group)} with backend "
            f"{backend_description(group)!r} (device types {sorted(served)}); offload_shim cannot stage calls that "
            f"torch defers to the end of the block. Ways out: move the tensors to the accelerator before the block; "
            f"or make the calls outside the coalescing manager; or give the group a CPU backend, e.g. "
            f"init_process_group({_with_cpu_backend(group, served)!r}). The tensor was not modified."
        )
    if not _log.isEnabledFor(logging.INFO):  # the one question asked of the logger on a staged call's path
        _counters.decided(route, device)
        return device
    _counters.decided(route, device, collective, lambda: _why(route, group, device, sizes))
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug(
            "offload_shim: staging %s of a %s tensor %s %s through %s (group %s, backend %r)",
            collective, tensor.device.type, tuple(tensor.shape), tensor.dtype, device, group_label(group),
            backend_description(group),
            extra={"offload_shim_collective": collective, "offload_shim_device": str(device)},
        )
    return device


def _why(route: str, group, device: torch.device, sizes: tuple) -> str:
    """Why a call on ``group`` is staged by ``route`` through ``device``, in a few words, for the log."""
    served = ", ".join(sorted(served_device_types(group)))
    where = f"group {group_label(group)} with backend {backend_description(group)} serves {served}"
    if route == _counters.STAGED:
        return f"{where} only"
    if route == _counters.ROUTED:
        nbytes, threshold = sizes
        return f"{_counters.format_bytes(nbytes)} >= route_min_bytes {_counters.format_bytes(threshold)}; {where}"
    if route == _counters.MIXED:
        return f"its other tensors are on {device}; {where}"
    if route == _counters.HOST:
        return f"{where}, not this collective on its accelerator tensors"
    return f"always_stage; {where}"


def _routes(route_bytes: int | None, settings: _config.Settings, group: dist.ProcessGroup) -> bool:
    """Whether a call of ``route_bytes`` is large enough to route off the group's CPU backend. Never on a group of
    one rank: its CPU backend moves nothing between ranks, and staging would only add the copies."""
    return (
        route_bytes is not None
        and settings.route_min_bytes is not None
        and route_bytes >= settings.route_min_bytes
        and group.size() > 1
    )


def _unstageable_message(tensor, group, collective, served, configured) -> str:
    accelerator = torch.accelerator.current_accelerator()
    if configured is not None:
        why = (
            f"the configured staging device {str(configured)!r} (configure(staging_device=...) or "
            f"{_config.ENV_STAGING_DEVICE}) is not usable from this process or not of a served type"
        )
    elif accelerator is None:
        why = "this process has no accelerator (torch.accelerator.current_accelerator() is None)"
    elif accelerator.type not in served:
        why = f"this process's accelerator is {accelerator.type!r}, which the group does not serve"
    else:
        why = f"this process's accelerator {accelerator.type!r} is not available"
    return (
        f"offload_shim: {collective} got a tensor on {tensor.device} ({tuple(tensor.shape)}, {tensor.dtype}), but "
        f"process group {group_label(group)} with backend {backend_description(group)!r} serves device types "
        f"{sorted(served)} only, and staging through an accelerator is impossible: {why}. "
        f"Ways out: run this rank where an accelerator of a served type is usable "
        f"({', '.join(sorted(served))}); or give the group a CPU backend, e.g. "
        f"init_process_group({_with_cpu_backend(group, served)!r}) "
        f"(CPU tensors then travel over Gloo); or move the tensor to the accelerator before the call. "
        f"The tensor was not modified. (This is torch's 'No backend type associated with device type cpu'.)"
    )


def _with_cpu_backend(group, served) -> str:
    """The group's backend string with Gloo added for CPU, e.g. ``'nccl'`` -> ``'cpu:gloo,cuda:nccl'``."""
    description = backend_description(group)
    if ":" not in description:
        description = ",".join(f"{t}:{description}" for t in sorted(served))
    return f"cpu:gloo,{description}"
