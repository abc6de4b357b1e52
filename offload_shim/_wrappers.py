"""The wrappers of the Python functions, made from the table (``_table``): every ``torch.distributed`` collective
(:data:`_table.C10D`), ``batch_isend_irecv`` and ``P2POp``, ``destroy_process_group``, and the functional
collectives' Python functions (:data:`_table.FUNCTIONAL`, for their accelerator inputs through the host).

Each wrapper reads top to bottom: the served path (a call that needs no staging goes to torch after a few attribute
reads), the call bound (``_plan.Call``), the one decision (``_plan.decide``), the one executor (``_execute.run``).
The ``torch.ops`` collectives that compiled code, the functional collectives and DTensor run are staged by
``_kernels``, the same way.

A ``P2POp`` keeps torch's own ``isend`` or ``irecv``, even when given the shim's wrapper of it: torch's
``batch_isend_irecv`` tells a send from a receive by identity with its module's ``isend``, so an operation holding a
wrapper would be taken for a receive once :func:`offload_shim.uninstall` has bound torch's function back.
"""

from __future__ import annotations

import dis
import functools
import logging
import math
import sys

import torch
import torch.distributed as dist
import wrapt

from offload_shim import _config, _devices, _execute, _groups, _plan, _replay, _table
from offload_shim._patching import Parameters, Target, unwrap_ours
from offload_shim._state import state

C10D_MODULE = "torch.distributed.distributed_c10d"
ALIASES = ("torch.distributed",)  # where the c10d functions are public under the same names

_log = logging.getLogger("offload_shim")
Tensor = torch.Tensor  # (read on every call: one global lookup)
_overrides = torch.overrides.has_torch_function_unary  # a tensor that torch hands to __torch_function__ (see _handed)
_any_overrides = torch.overrides.has_torch_function
EVERY_SIZE = math.inf  # a served-path answer: every call of the group's host tensors goes to torch
# Its _world.default_pg: the default group, read where torch reads it (torch's threaded tests replace _world).
_c10d = dist.distributed_c10d


def _root(entry, parameters, args, kwargs, group) -> tuple[bool | None, int | None]:
    """``(this rank is the root, the root's rank in the group)`` of a call with a root, given as a global rank
    (``src``, ``dst``) or as ``group_src``/``group_dst``; ``(None, None)`` where the arguments do not say (torch will
    raise)."""
    if entry.root is None:
        return None, None
    group_rank = parameters.get(args, kwargs, f"group_{entry.root}")
    rank = parameters.get(args, kwargs, entry.root)
    if group_rank is not None:
        return (group.rank() == group_rank, group_rank) if rank is None else (None, None)  # (both: torch raises)
    if rank is None:
        return None, None
    try:
        return dist.get_rank() == rank, dist.get_group_rank(group, rank)
    except Exception:  # not a rank of the group: torch raises its own error
        return dist.get_rank() == rank, None


def _bind(entry, parameters, args, kwargs, group) -> _plan.Call:
    root, root_rank = _root(entry, parameters, args, kwargs, group)
    return _plan.Call(
        entry, _plan.C10D, group, {a.name: parameters.get(args, kwargs, a.name) for a in entry.args},
        async_op=entry.name in ("isend", "irecv") or parameters.get(args, kwargs, "async_op", False),
        root=root, root_rank=root_rank,
        op=parameters.get(args, kwargs, "op", dist.ReduceOp.SUM) if entry.reduces else None,
    )


def _passing_through(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


def _callers(name: str) -> frozenset:
    """The code of torch's collectives (those of the table) that call collective ``name`` by name: torch 2.13's
    ``all_gather_into_tensor`` calls ``all_gather_single``, its ``reduce_scatter_tensor`` ``reduce_scatter_single``,
    on the same tensors and group. A call of ``name`` made from that code is passed on undecided (the outer call has
    decided for it), and the outer call pays nothing for it."""
    codes = set()
    for other in _table.C10D:
        chain = _chain(getattr(dist.distributed_c10d, other, None))  # torch's own function is its chain's end
        code = getattr(chain[-1], "__code__", None) if other != name and chain else None
        if code is not None and name in code.co_names:
            codes.add(code)
    return frozenset(codes)


def _handed(name: str, seen: frozenset = frozenset()) -> frozenset:
    """The parameters of torch's collective ``name`` whose tensors make torch hand the call to
    ``__torch_function__`` (its ``relevant_args``, read from its code, or from the code of a collective of the table
    it calls by name with the same parameter), where a tensor's type overrides it or a ``TorchFunctionMode`` is
    active; empty where torch hands nothing on (torch 2.13's collectives do, with the shim's wrapper as the function:
    the override's own call of it, with plain tensors, is decided as any call). The shim passes such a call to torch
    undecided (a read of ``is_cpu`` would be handed to the override too). Every parameter of the table's entry where
    torch hands calls on but its ``relevant_args`` cannot be read."""
    chain = _chain(getattr(dist.distributed_c10d, name, None))
    code = getattr(chain[-1], "__code__", None) if chain else None
    if code is None:
        return frozenset()
    parameters = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    if "handle_torch_function" in code.co_names:
        loads = []
        for instruction in dis.get_instructions(code):
            if instruction.opname.startswith("LOAD_FAST"):
                value = instruction.argval
                loads.extend(value if isinstance(value, tuple) else [value])
            elif instruction.opname.startswith("STORE_FAST"):
                if instruction.argval == "relevant_args":
                    return frozenset(n for n in loads if n in parameters)
                loads = []
        return frozenset(a.name for a in _table.C10D[name].args)  # (name: always an entry of the table)
    seen = seen | {name}
    return frozenset(n for other in _table.C10D if other not in seen and other in code.co_names
                     for n in _handed(other, seen) if n in parameters)


def c10d_wrapper(entry: _table.Collective):
    """The wrapper factory of a ``torch.distributed`` entry of the table."""
    label = entry.label

    def make(original, live):
        parameters = Parameters(original)
        missing = [name for name in (*(a.name for a in entry.args), "group") if name not in parameters]
        if missing:  # a torch whose signature differs: leave the function alone rather than guess
            _log.warning("offload_shim: %s has no parameter(s) %s in this torch; not staged", label, missing)
            return _passing_through
        group_at = parameters.position("group")
        lazy = _devices.refused_for_host(label)  # accelerator tensors go to torch first (see _devices)
        callers = _callers(entry.name)  # torch's collectives that call this one (see _callers)
        handed = _handed(entry.name)  # where overriding tensors send the call to __torch_function__ (see _handed)

        def stage(wrapped, args, kwargs, group, refused=None):
            # (Removed by uninstall: torch's call and error, as without the shim; see _patching.Target.)
            plan = _plan.decide(_bind(entry, parameters, args, kwargs, group)) if live else None
            if plan is None:
                if refused is not None:
                    raise refused
                return wrapped(*args, **kwargs)
            return _execute.run(plan, _execute.Caller(wrapped, parameters, args, kwargs))

        if entry.wire == _table.ELEMENTWISE:  # one tensor, in place: the shortest served path
            at = parameters.position(entry.args[0].name)
            handed_on = entry.args[0].name in handed

            def in_place(wrapped, instance, args, kwargs):
                # Every call passes here: the decision for one that needs no staging is kept to a few attribute reads.
                tensor = args[at] if len(args) > at else kwargs.get("tensor")
                if not isinstance(tensor, Tensor) or handed_on and _overrides(tensor):
                    return wrapped(*args, **kwargs)
                if not tensor.is_cpu:  # an accelerator's tensor: through the host where the group has no backend
                    try:  # torch first (_devices.torch_first, inline): it refuses before any wire
                        return wrapped(*args, **kwargs)
                    except RuntimeError as error:
                        if not _devices.sends_to_host(error):
                            raise
                        refused = error
                    group = _devices.resolve_c10d_group(args[group_at] if len(args) > group_at else kwargs.get("group"))
                    if group is None:
                        raise refused
                    return stage(wrapped, args, kwargs, group, refused)
                # The group's answer (its record's): below what size its host calls go to torch untouched.
                given = args[group_at] if len(args) > group_at else kwargs.get("group")
                group = _c10d._world.default_pg if given is None else given
                record = state.groups.get(id(group))
                below = record.below if record is not None and record.ref() is group else None
                if below is None:
                    below = _plan.host_answer(given)
                try:
                    served = below is EVERY_SIZE or tensor.nbytes < below
                except RuntimeError:  # (a sparse tensor's nbytes raises: decided, and left to torch there)
                    served = False
                if served or not live:  # no group (torch raises), one that serves the call, or removed
                    return wrapped(*args, **kwargs)
                # A small call captured before, replayed without deciding again while what decided it holds (_replay).
                if state.captures and _replay.replayed(tensor, group, wrapped, args, kwargs, at):
                    return None
                settings = _config.settings()  # read before the decision: what a capture's replay is decided under
                plan = _plan.decide(_bind(entry, parameters, args, kwargs, group))
                if plan is None:
                    return wrapped(*args, **kwargs)
                return _execute.run(plan, _execute.Caller(wrapped, parameters, args, kwargs, at, settings))

            return in_place

        positions = [(a.name, parameters.position(a.name), a.name in handed) for a in entry.args]

        def wrapper(wrapped, instance, args, kwargs):
            # Every call passes here: one pass over its tensor arguments decides most calls that need no staging.
            if callers and _called_from(callers):  # by torch's call of another wrapped collective: undecided
                return wrapped(*args, **kwargs)
            host, kind, accelerator = False, None, None  # (a tensor's device type is read only where needed)
            for name, at, handed_on in positions:
                value = args[at] if len(args) > at else kwargs.get(name)
                if isinstance(value, Tensor):
                    if handed_on and _overrides(value):
                        return wrapped(*args, **kwargs)
                    if value.is_cpu:
                        host = True
                    elif accelerator is None:
                        accelerator = value
                elif isinstance(value, (list, tuple)):
                    if handed_on and _any_overrides(value):
                        return wrapped(*args, **kwargs)
                    found_host, found_kind = _devices_of(value)
                    host, kind = host or found_host, kind or found_kind
            refused = None
            if not host:
                if kind is None and accelerator is None:
                    return wrapped(*args, **kwargs)
                if lazy:  # accelerator tensors only, on a collective that needs the host only where torch refuses
                    try:  # torch first (_devices.torch_first, inline)
                        return wrapped(*args, **kwargs)
                    except RuntimeError as error:
                        if not _devices.sends_to_host(error):
                            raise
                        refused = error
                elif not _config.settings().host_staging:
                    return wrapped(*args, **kwargs)
            if accelerator is not None:  # the first tensor argument not on the host, before any list's
                kind = accelerator.device.type
            group = _devices.resolve_c10d_group(args[group_at] if len(args) > group_at else kwargs.get("group"))
            # Accelerator tensors through the host, where the group runs this collective on them only so.
            through_host = kind is not None and group is not None and not _devices.accelerator_call_served(
                group, kind, label)
            served = group is None or host and _devices.host_calls_served(group)
            if (served or not host) and not through_host:
                if refused is not None:
                    raise refused
                return wrapped(*args, **kwargs)
            return stage(wrapped, args, kwargs, group, refused)

        if not (lazy and not callers and len(entry.args) == 2 and all(a.form == _table.TENSOR for a in entry.args)):
            return wrapper
        first_at, second_at = (parameters.position(a.name) for a in entry.args)
        last = max(first_at, second_at)
        first_handed, second_handed = (a.name in handed for a in entry.args)

        def pair(wrapped, instance, args, kwargs):
            # Two tensors given by position (all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single), the
            # usual call, both on an accelerator or both on the host: the general pass's answer in fewer reads
            # (accelerator tensors go to torch at once, as in_place's do). Any other call: the general pass.
            if len(args) > last:
                first, second = args[first_at], args[second_at]
                if isinstance(first, Tensor) and isinstance(second, Tensor):
                    if first_handed and _overrides(first) or second_handed and _overrides(second):
                        return wrapped(*args, **kwargs)
                    host = first.is_cpu
                    if host is second.is_cpu:
                        refused = None
                        if not host:
                            try:  # torch first (_devices.torch_first, inline)
                                return wrapped(*args, **kwargs)
                            except RuntimeError as error:
                                if not _devices.sends_to_host(error):
                                    raise
                                refused = error
                        group = _devices.resolve_c10d_group(
                            args[group_at] if len(args) > group_at else kwargs.get("group"))
                        if group is None or (_devices.host_calls_served(group) if host else
                                             _devices.accelerator_call_served(group, first.device.type, label)):
                            if refused is not None:
                                raise refused
                            return wrapped(*args, **kwargs)
                        return stage(wrapped, args, kwargs, group, refused)
            return wrapper(wrapped, instance, args, kwargs)

        return pair

    return make


def _called_from(callers: frozenset) -> bool:
    """Whether the wrapper's caller (its wrapt ``FunctionWrapper``'s caller) runs one of ``callers``' code."""
    return sys._getframe(_CALLER).f_code in callers


def _caller_depth() -> int:
    """How many frames above :func:`_called_from` a wrapped function's caller is: 2 (``_called_from``, the wrapper)
    where wrapt's C extension calls the wrapper, which adds no frame; one more where wrapt runs in Python."""
    seen = []

    def spy(wrapped, instance, args, kwargs):
        seen.append(sys._getframe(1).f_code)
        return wrapped(*args, **kwargs)

    probe = wrapt.FunctionWrapper(lambda: None, spy)

    def caller():
        probe()

    caller()
    return 2 if seen[0] is caller.__code__ else 3


_CALLER = _caller_depth()


def _devices_of(values) -> tuple[bool, str | None]:
    """Whether ``values`` (tensors and lists of them, nested) hold a host tensor, and the device type of the first
    tensor not on the host (``None`` if none)."""
    host, kind = False, None
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.is_cpu:  # sparse ones too: refused clearly by the decision
                host = True
            elif kind is None:
                kind = value.device.type
        elif isinstance(value, (list, tuple)):
            found_host, found_kind = _devices_of(value)
            host, kind = host or found_host, kind or found_kind
    return host, kind


# ---------------------------------------------------------------- batch_isend_irecv and P2POp


def _batch_wrapper(original, live):
    entry = _table.BATCH

    def wrapper(wrapped, instance, args, kwargs):
        operations = args[0] if args else kwargs.get("p2p_op_list")
        if not live or not isinstance(operations, list) or not operations or not all(
                isinstance(o, dist.P2POp) for o in operations):
            return wrapped(*args, **kwargs)  # removed by uninstall, or torch raises its own error
        operations = [_current(operation) for operation in operations]
        tensors = [getattr(operation, "tensor", None) for operation in operations]
        group = _devices.resolve_c10d_group(getattr(operations[0], "group", None))
        if group is None or not any(isinstance(t, torch.Tensor) for t in tensors):
            return wrapped(operations)
        plan = _plan.decide(_plan.Call(entry, _plan.C10D, group, {"p2p_op_list": tensors}, async_op=True))
        if plan is None:
            return wrapped(operations)
        return _execute.run(plan, _BatchCaller(wrapped, operations))

    return wrapper


class _BatchCaller:
    """torch's ``batch_isend_irecv`` with the caller's operations (``operations``), for the executor: ``call`` runs
    it on copies of them holding the staged tensors."""

    __slots__ = ("wrapped", "operations")

    def __init__(self, wrapped, operations):
        self.wrapped, self.operations = wrapped, operations

    def call(self, tensors: list):
        staged = []
        for operation, tensor in zip(self.operations, tensors):
            copy = object.__new__(type(operation))
            copy.__dict__.update(vars(operation))
            copy.tensor = tensor
            staged.append(copy)
        return self.wrapped(staged)


def _current(operation):
    """A copy of P2POp ``operation`` whose ``op`` is torch's ``isend`` or ``irecv`` as bound now: torch tells sends
    from receives by identity with its module's ``isend``, which install and uninstall rebind, so a P2POp made
    before either would be taken for a receive. ``operation`` itself where its ``op`` is neither (torch decides)."""
    kind = _kind(operation.op)
    if kind is None:
        return operation
    copy = object.__new__(type(operation))
    copy.__dict__.update(vars(operation))
    copy.op = getattr(dist.distributed_c10d, kind)
    return copy


def _kind(op) -> str | None:
    """``"isend"`` or ``"irecv"``: which of the two ``op`` is, whoever wrapped it (torch's decorators, the shim, a
    user's patch with or without ``functools.wraps``): the two share a function on their ``__wrapped__`` chains."""
    ops = _chain(op)
    for kind in ("isend", "irecv"):
        bound = _chain(getattr(dist.distributed_c10d, kind))
        if any(a is b for a in ops for b in bound):
            return kind
    return None


def _chain(function) -> list:
    chain = []
    while function is not None and not any(function is seen for seen in chain):
        chain.append(function)
        function = getattr(function, "__wrapped__", None)
    return chain


def _p2p_op_init_wrapper(original, live):
    """``P2POp(op, ...)`` with ``op`` stripped of the shim's wrappers (see the module docstring)."""
    parameters = Parameters(functools.partial(original, None))  # wrapt passes the instance apart from args

    def wrapper(wrapped, instance, args, kwargs):
        if not live:
            return wrapped(*args, **kwargs)
        op = parameters.get(args, kwargs, "op")
        args, kwargs = parameters.replace(args, kwargs, "op", unwrap_ours(op))
        return wrapped(*args, **kwargs)

    return wrapper


# ---------------------------------------------------------------- destroy_process_group


def _releasing_buffers(original, live):
    """``destroy_process_group(group)`` first drops what the shim keeps for the group (its captured small calls,
    while its communicator still exists; then its agreement, lanes and served-path answer); of every group (``None``, or the default
    group, as torch reads it), it also frees the staging buffers (:func:`offload_shim.release_buffers`): no staged
    call can follow until a group is made again."""

    def wrapper(wrapped, instance, args, kwargs):
        if not live:
            return wrapped(*args, **kwargs)
        group = args[0] if args else kwargs.get("group")
        every = group is None or group is dist.group.WORLD  # torch destroys every group for both
        _replay.forget(None if every else group)
        result = wrapped(*args, **kwargs)
        _groups.forget(None if every else group)
        if every:
            _execute.release_buffers()
        return result

    return wrapper


# ---------------------------------------------------------------- the functional collectives' Python functions


def functional_wrapper(entry: _table.Collective):
    """The wrapper factory of a functional collective's Python function: host inputs go to torch (the ops they call
    are staged by ``_kernels``); accelerator inputs that the group serves only through the host, and the host inputs
    of a list that mixes devices, are staged whole here."""
    name = entry.args[0].name

    def make(original, live):
        parameters = Parameters(original)
        lazy = _devices.refused_for_host(entry.label)  # accelerator inputs go to torch first (see _devices)

        def wrapper(wrapped, instance, args, kwargs):
            value = parameters.get(args, kwargs, name)
            inputs = value if isinstance(value, (list, tuple)) else [value]
            host = sum(1 for t in inputs if isinstance(t, torch.Tensor) and t.is_cpu)
            if host == len(inputs):
                return wrapped(*args, **kwargs)  # the op it calls decides (_kernels), eager or compiled alike
            refused = None
            if not host:
                if lazy:  # accelerator inputs on a collective that needs the host only where torch refuses them
                    result, refused = _devices.torch_first(wrapped, args, kwargs)
                    if refused is None:
                        return result
                elif not _config.settings().host_staging:
                    return wrapped(*args, **kwargs)
            group = _devices.resolve_functional_group(
                parameters.get(args, kwargs, "group"), parameters.get(args, kwargs, "tag", "")
            )
            plan = None if group is None or not live else _plan.decide(
                _plan.Call(entry, _plan.FUNCTIONAL, group, {name: value}))
            if plan is None:
                if refused is not None:
                    raise refused
                return wrapped(*args, **kwargs)
            return _execute.run(plan, _execute.Caller(wrapped, parameters, args, kwargs))

        return wrapper

    return make


TARGETS = [
    *(Target(C10D_MODULE, name, c10d_wrapper(entry), aliases=ALIASES) for name, entry in _table.C10D.items()),
    Target(C10D_MODULE, "batch_isend_irecv", _batch_wrapper, aliases=ALIASES),
    Target(C10D_MODULE, "__init__", _p2p_op_init_wrapper, owner="P2POp"),
    Target(C10D_MODULE, "destroy_process_group", _releasing_buffers, aliases=ALIASES),
    *(Target(_table.FUNCTIONAL_MODULE, name, functional_wrapper(entry)) for name, entry in _table.FUNCTIONAL.items()),
]
