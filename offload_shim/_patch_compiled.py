"""Staging below Python: a ``CPU`` kernel for each collective op of ``torch.ops._c10d_functional`` (compiled code)
and ``torch.ops._dtensor`` (DTensor's Shard to Shard redistribution).

Under ``torch.compile`` Dynamo rewrites ``torch.distributed.X`` and the functional collectives into the C++ ops
``torch.ops._c10d_functional.*`` (``all_reduce``, ``all_reduce_``, ``all_gather_into_tensor``, ...) before any
Python wrapper runs, so the wrapt wrappers of :mod:`offload_shim._patch_c10d` and
:mod:`offload_shim._patch_functional` never see compiled calls. Those ops are registered by torch only as
``CompositeExplicitAutograd`` kernels (``torch._C._dispatch_dump("_c10d_functional::all_reduce")``, torch 2.13),
which serve every backend key, CPU included. A kernel registered for the ``CPU`` key takes precedence over
them for CPU tensors, wherever the op is called from: a compiled graph (Dynamo with any backend, Inductor's
generated code), or eager code that calls the op or a functional collective offload_shim does not wrap. DTensor's
``torch.ops._dtensor.shard_dim_alltoall`` (Shard(i) to Shard(j) on an accelerator mesh, called eagerly with an
offloaded DTensor's CPU local tensor) is registered the same way.

The kernel decides with :func:`offload_shim._devices.staging_device_for`, like the eager wrappers:

* no staging (a group that serves CPU, or a call made from inside a staged call): torch's own
  ``CompositeExplicitAutograd`` kernel runs, on the caller's tensors, untouched;
* staging: the tensor arguments are copied to the staging device, the same op runs there, its result is waited
  for (``wait_tensor``), and it comes back to the CPU: a new CPU tensor (or list) for the functional ops; for
  the in-place and ``out=`` ops the caller's own tensor is written and returned, as the op's schema says. The
  result is complete on return; the ``wait_tensor`` the compiled graph then calls on it does nothing;
* no usable staging device: :class:`offload_shim.StagingError`, before the collective is entered.

Calls here are never routed off a group's Gloo backend by size (``OFFLOAD_SHIM_ROUTE_MIN_BYTES`` is for eager
calls). Where nothing is staged the kernel adds some 10 to 30 us of Python per call (measured on a 2-core CPU).

Point-to-point ops (``isend``, ``irecv``, ``batch_p2p_ops``) are not staged: a staged send would have to wait
for its receive, which can deadlock programs that post both before waiting. On a group that serves no CPU they
raise :class:`offload_shim.StagingError` instead of torch's bare error.

Which ops exist is read from the running torch (``torch._C._dispatch_get_all_op_names()``); an op that already
has a ``CPU`` kernel of its own is left alone.

The eager wrappers themselves are kept out of Dynamo (:func:`_keep_out_of_dynamo`): where compiled code calls a
collective Dynamo does not put in its graph (``broadcast``, ``scatter``, ``send``, any ``async_op=True`` call), it
breaks the graph and runs the call as Python, and would then compile the wrapper as a frame of its own, which it
cannot trace (the decision reads ``ProcessGroup._device_types``). Registered with Dynamo's skip rules, the shim's
frames run as plain Python there, as torch's own ``torch.distributed`` functions do.
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.distributed as dist
import wrapt

from offload_shim import _counters, _devices, _staging

# The namespaces of collective ops with CompositeExplicitAutograd kernels only: the functional collectives, and
# DTensor's Shard(i) to Shard(j) all-to-all (``torch.ops._dtensor.shard_dim_alltoall``, which DTensor redistribution
# calls on an accelerator mesh whatever the local tensor's device, so an offloaded DTensor reaches it eagerly too).
NAMESPACES = ("_c10d_functional", "_dtensor")
POINT_TO_POINT = frozenset({"isend", "irecv", "batch_p2p_ops"})

_log = logging.getLogger("offload_shim")
_lock = globals().get("_lock") or threading.Lock()  # state kept across importlib.reload
_libraries: list = globals().get("_libraries", [])  # the torch.library.Library objects holding the registrations while installed


def install() -> None:
    """Register the ``CPU`` kernels (see the module docstring), and keep the shim's own code out of Dynamo from
    when it is imported (:func:`_keep_out_of_dynamo`). Installing twice changes nothing; does nothing where
    ``torch.distributed`` is unavailable."""
    with _lock:
        if _libraries or not dist.is_available():
            return
        # When Dynamo is first imported, not now: importing it costs about a second, and most programs never compile.
        wrapt.register_post_import_hook(_keep_out_of_dynamo, "torch._dynamo.trace_rules")
        libraries = {namespace: torch.library.Library(namespace, "IMPL") for namespace in NAMESPACES}
        try:
            for op in _collective_ops():
                if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), torch._C.DispatchKey.CPU):
                    _log.info("offload_shim: %s has a CPU kernel of its own; it is left alone, not staged", op)
                    continue
                kernel = _refusing_kernel(op) if op._opname in POINT_TO_POINT else _staging_kernel(op)
                overload = op._schema.overload_name
                libraries[op._namespace].impl(op._opname + (f".{overload}" if overload else ""), kernel, "CPU")
        except BaseException:
            for library in libraries.values():
                library._destroy()  # nothing half-installed
            raise
        _libraries.extend(libraries.values())


def _keep_out_of_dynamo(trace_rules) -> None:
    """Add the ``offload_shim`` package to Dynamo's skip rules (``torch._dynamo.trace_rules.add``, the list torch's
    own modules are on), so that Dynamo never compiles a frame of the shim's: run eagerly from a graph break, the
    wrappers decide and stage as Python. Nothing Dynamo traces changes: it never inlines a wrapper, whose
    ``__code__`` is the wrapped function's. Once per process (a post-import hook runs once); the rule outlives
    :func:`uninstall`, and costs nothing there: the wrappers then pass calls straight through."""
    add = getattr(trace_rules, "add", None)
    if add is None:
        _log.warning(
            "offload_shim: this torch's Dynamo has no trace_rules.add; compiled code that graph-breaks on a wrapped "
            "collective may fail to compile the wrapper"
        )
        return
    add(__name__.rpartition(".")[0])


def uninstall() -> None:
    """Remove exactly the registrations :func:`install` made; torch's own kernels serve CPU tensors again.
    Removing twice changes nothing."""
    with _lock:
        for library in _libraries:
            library._destroy()
        _libraries.clear()


def is_installed() -> bool:
    """Whether the ``CPU`` kernels are registered."""
    return bool(_libraries)


def _collective_ops() -> list[torch._ops.OpOverload]:
    """Every overload in :data:`NAMESPACES` that takes a process group (argument ``group_name``) and tensors."""
    ops = []
    for qualified in sorted(torch._C._dispatch_get_all_op_names()):
        namespace, _, rest = qualified.partition("::")
        if namespace not in NAMESPACES:
            continue
        name, _, overload = rest.partition(".")
        op = getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")
        arguments = op._schema.arguments
        if any(a.name == "group_name" for a in arguments) and any(_is_tensor_type(a.type) for a in arguments):
            ops.append(op)
    return ops


def _is_tensor_type(kind) -> bool:
    return isinstance(kind, torch.TensorType) or (
        isinstance(kind, torch.ListType) and isinstance(kind.getElementType(), torch.TensorType)
    )


def _group(group_name) -> dist.ProcessGroup | None:
    """The process group of a ``group_name`` argument: a group name, or the group itself (torch passes the group
    with ``torch.distributed.config.compile_on_one_rank``). ``None`` if it cannot be resolved (torch then raises
    its own error)."""
    if not isinstance(group_name, str):
        return group_name if isinstance(group_name, dist.ProcessGroup) else None
    try:
        return dist.distributed_c10d._resolve_process_group(group_name)
    except Exception:
        return None


def _tensor_and_group(op):
    """A function of a call's ``(args, kwargs)`` returning its first tensor argument (the first of a list) and
    its process group; either is ``None`` where there is none. Argument positions are read from the schema once."""
    arguments = op._schema.arguments
    names = [a.name for a in arguments]
    tensor_index = next(i for i, a in enumerate(arguments) if _is_tensor_type(a.type))
    group_index = names.index("group_name")

    def get(index, args, kwargs):
        return args[index] if index < len(args) else kwargs.get(names[index])

    def tensor_and_group(args, kwargs):
        tensor = get(tensor_index, args, kwargs)
        if isinstance(tensor, (list, tuple)):
            tensor = tensor[0] if tensor else None
        return tensor, _group(get(group_index, args, kwargs))

    return tensor_and_group


def _label(op) -> str:
    overload = op._schema.overload_name
    return f"torch.ops.{op._namespace}.{op._opname}" + (f".{overload}" if overload else "")


def _original(op):
    """torch's own kernel of ``op`` (the C++ ``CompositeExplicitAutograd`` one), called past our ``CPU`` kernel."""
    key = torch._C.DispatchKey.CompositeExplicitAutograd
    return lambda *args, **kwargs: op._op_dk(key, *args, **kwargs)


def _staging_kernel(op):
    """The ``CPU`` kernel of collective ``op``: same arguments and results as ``op`` (see the module docstring).

    Raises:
        StagingError: the group serves no CPU and no staging device is usable; nothing was written.
    """
    original, schema, label, tensor_and_group = _original(op), op._schema, _label(op), _tensor_and_group(op)
    names = [a.name for a in schema.arguments]
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    outs = {a.name for a in schema.arguments if a.kwarg_only and a.alias_info is not None}  # out=: written, not read

    def kernel(*args, **kwargs):
        tensor, group = tensor_and_group(args, kwargs)
        device = None if tensor is None or group is None else _devices.staging_device_for(tensor, group, label)
        if device is None:
            return original(*args, **kwargs)
        nbytes = _counters.host_bytes((*args, *kwargs.values()))
        try:
            return run_staged(device, args, kwargs)
        finally:
            _counters.count(label, _counters.WHOLE, nbytes)

    def run_staged(device, args, kwargs):  # the op on staged copies, results back as its schema says
        staged = _staging.StagedArguments(device)

        def stage(name, value):
            return staged.stage(value, reads=name not in outs, writes=name in mutated)

        staged_args = [stage(name, value) for name, value in zip(names, args)]
        staged_kwargs = {name: stage(name, value) for name, value in kwargs.items()}
        with _staging.staged_call():
            result = _wait(op(*staged_args, **staged_kwargs))
        if not mutated:  # functional: a new tensor, or list of them, on the CPU
            if isinstance(result, torch.Tensor):
                return _staging.to_caller(result, torch.device("cpu"))
            return [_staging.to_caller(r, torch.device("cpu")) for r in result]
        # In-place or out=: the caller's own tensor(s) receive the result and are returned, as the schema says.
        staged.copy_back()
        return _argument(schema, mutated[0], args, kwargs)

    return kernel


def _refusing_kernel(op):
    """The ``CPU`` kernel of point-to-point ``op``: torch's kernel, or :class:`StagingError` where the group
    serves no CPU."""
    original, label, tensor_and_group = _original(op), _label(op), _tensor_and_group(op)

    def kernel(*args, **kwargs):
        tensor, group = tensor_and_group(args, kwargs)
        served = frozenset() if group is None else _devices.served_device_types(group)
        if tensor is not None and group is not None and "cpu" not in served:
            raise _devices.StagingError(
                f"offload_shim: {label} got a tensor on cpu ({tuple(tensor.shape)}, {tensor.dtype}), but process "
                f"group {_devices.group_label(group)} with backend {_devices.backend_description(group)!r} serves "
                f"device types {sorted(served)} only, and offload_shim does not stage the point-to-point ops of "
                f"torch.ops._c10d_functional (what compiled code, and funcol's isend_inplace/irecv_inplace, call). "
                f"Ways out: use torch.distributed.isend/irecv/batch_isend_irecv outside compiled code, which are "
                f"staged; or move the tensor to the accelerator before the call; or give the group a "
                f"CPU backend, e.g. init_process_group({_devices._with_cpu_backend(group, served)!r}). "
                f"The tensor was not modified."
            )
        return original(*args, **kwargs)

    return kernel


def _wait(result):
    wait = torch.ops._c10d_functional.wait_tensor
    return wait(result) if isinstance(result, torch.Tensor) else [wait(r) for r in result]


def _argument(schema, name, args, kwargs):
    index = [a.name for a in schema.arguments].index(name)
    return args[index] if index < len(args) else kwargs[name]
