"""Staging below Python: a ``CPU`` kernel for each collective op of ``torch.ops._c10d_functional`` and
``torch.ops._dtensor``, the ops that compiled code runs, and that the functional collectives and DTensor call.

``torch.distributed._functional_collectives`` calls these ops (``all_reduce``, ``all_gather_into_tensor``, ...),
eagerly or from a compiled graph: Dynamo rewrites ``torch.distributed.X`` and the functional collectives into them
before any Python wrapper runs, and DTensor's redistribution (``full_tensor()``, ``clip_grad_norm_``'s reduction of a
``Partial`` norm) reaches them through the functional collectives, eager or compiled (DTensor's Shard(i) to Shard(j)
all-to-all is ``torch.ops._dtensor.shard_dim_alltoall``). torch registers those ops only as
``CompositeExplicitAutograd`` kernels (``torch._C._dispatch_dump("_c10d_functional::all_reduce")``, torch 2.13),
which serve every backend key, CPU included. A kernel registered for the ``CPU`` key takes precedence over them for
CPU tensors, wherever the op is called from. So every host tensor of a functional collective, eager or compiled,
reaches the one decision (``_plan.decide``) and the one executor (``_execute.run``) here, through the op's entry of
the table (``_table.OPS``), as the ``torch.distributed`` functions do through theirs: the same plan, and the same
collectives on the wire, whichever entry point a rank uses.

* no staging (a group that serves CPU, or a call made from inside a staged call): torch's own
  ``CompositeExplicitAutograd`` kernel runs, on the caller's tensors, untouched;
* staging: the op runs on staged copies (or, chunked, as ``torch.distributed``'s own collectives on the chunks), its
  result is waited for (``wait_tensor``), and it comes back to the CPU: a new CPU tensor (or list) for the
  functional ops, complete (the functional collective wraps it in an ``AsyncCollectiveTensor``, as torch's); for the
  in-place and ``out=`` ops the caller's own tensor is written and returned, as the op's schema says;
* no usable staging device: :class:`offload_shim.StagingError`, before the collective is entered.

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

import torch
import torch.distributed as dist
import wrapt

from offload_shim import _devices, _execute, _plan, _table
from offload_shim._state import state

NAMESPACES = _table.OPS_NAMESPACES
POINT_TO_POINT = frozenset(name for name, entry in _table.OPS.items() if entry.point_to_point)

_log = logging.getLogger("offload_shim")
_libraries: list = []  # the torch.library.Library objects holding the registrations while installed


_hooked = False  # the post-import hook above registered


def install() -> None:
    """Register the ``CPU`` kernels (see the module docstring), and keep the shim's own code out of Dynamo from
    when it is imported (:func:`_keep_out_of_dynamo`). Installing twice changes nothing; does nothing where
    ``torch.distributed`` is unavailable."""
    with state.kernels_lock:
        if _libraries or not dist.is_available():
            return
        # When Dynamo is first imported, not now: importing it costs about a second, and most programs never compile.
        # Once per process: a hook registered again after an uninstall would add the rule again.
        global _hooked
        if not _hooked:
            _hooked = True
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
    with state.kernels_lock:
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


def _label(op) -> str:
    overload = op._schema.overload_name
    return f"torch.ops.{op._namespace}.{op._opname}" + (f".{overload}" if overload else "")


def _original(op):
    """torch's own kernel of ``op`` (the C++ ``CompositeExplicitAutograd`` one), called past our ``CPU`` kernel."""
    key = torch._C.DispatchKey.CompositeExplicitAutograd
    return lambda *args, **kwargs: op._op_dk(key, *args, **kwargs)


class _OpCaller:
    """The op with the caller's arguments, some replaced by staged ones (``call``), for the executor."""

    __slots__ = ("op", "names", "args", "kwargs")

    def __init__(self, op, names, args, kwargs):
        self.op, self.names, self.args, self.kwargs = op, names, args, kwargs

    def call(self, replaced: dict):
        args = [replaced.get(name, value) for name, value in zip(self.names, self.args)]
        kwargs = {name: replaced.get(name, value) for name, value in self.kwargs.items()}
        return self.op(*args, **kwargs)


def _staging_kernel(op):
    """The ``CPU`` kernel of collective ``op``: same arguments and results as ``op`` (see the module docstring).

    Raises:
        StagingError: the group serves no CPU and no staging device is usable; nothing was written.
    """
    original, schema = _original(op), op._schema
    entry = _table.op_entry(op._namespace, op._opname, schema)
    names = [a.name for a in schema.arguments]
    group_at = names.index("group_name")
    root_at = names.index("src") if "src" in names and entry.root else None

    def kernel(*args, **kwargs):
        group = _group(args[group_at] if group_at < len(args) else kwargs.get("group_name"))
        if group is None:
            return original(*args, **kwargs)
        bound = dict(zip(names, args))
        bound.update(kwargs)
        root_rank = None if root_at is None else bound.get("src")
        call = _plan.Call(
            entry, _plan.OPS, group, {a.name: bound[a.name] for a in entry.args if a.name in bound},
            root=None if root_rank is None else group.rank() == root_rank, root_rank=root_rank,
            op=_execute.reduce_op(bound.get("reduce_op")) if entry.reduces else None,
        )
        plan = _plan.decide(call)
        if plan is None:
            return original(*args, **kwargs)
        return _execute.run(plan, _OpCaller(op, names, args, kwargs))

    return kernel


def _refusing_kernel(op):
    """The ``CPU`` kernel of point-to-point ``op``: torch's kernel, or :class:`StagingError` where the group
    serves no CPU."""
    original, label = _original(op), _label(op)
    names = [a.name for a in op._schema.arguments]
    tensor_at = next(i for i, a in enumerate(op._schema.arguments) if _is_tensor_type(a.type))
    group_at = names.index("group_name")

    def kernel(*args, **kwargs):
        def get(index):
            return args[index] if index < len(args) else kwargs.get(names[index])

        tensor, group = get(tensor_at), _group(get(group_at))
        if isinstance(tensor, (list, tuple)):
            tensor = tensor[0] if tensor else None
        served = frozenset() if group is None else _devices.record(group).served
        if tensor is not None and group is not None and "cpu" not in served and not _devices.unreadable(group):
            raise _devices.StagingError(
                f"offload_shim: {label} got a tensor on cpu ({tuple(tensor.shape)}, {tensor.dtype}), but process "
                f"group {_devices.group_label(group)} with backend {_devices.backend_description(group)!r} serves "
                f"device types {sorted(served)} only, and offload_shim does not stage the point-to-point ops of "
                f"torch.ops._c10d_functional (what compiled code, and funcol's isend_inplace/irecv_inplace, call). "
                f"Ways out: use torch.distributed.isend/irecv/batch_isend_irecv outside compiled code, which are "
                f"staged; or move the tensor to the accelerator before the call; or give the group a "
                f"CPU backend, e.g. init_process_group({_devices.with_cpu_backend(group, served)!r}). "
                f"The tensor was not modified."
            )
        return original(*args, **kwargs)

    return kernel
