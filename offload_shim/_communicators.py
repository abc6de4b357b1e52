"""Communicators outside ``torch.distributed``: :func:`register_communicator`.

A communicator such as vLLM's ``PyNcclCommunicator`` is bound to one device and asserts that every tensor it is
given is on that device (``tensor.device == self.device``). A registered method is wrapped (through
``_patching``, so :func:`offload_shim.uninstall` binds the exact original back and :func:`offload_shim.install`
wraps it again) so that a tensor argument on any other device, the CPU or another GPU of the host, is staged. The
method is an entry of its own (``_table.Collective``, made here), and its calls go through the one decision
(``_plan.decide``, which picks the tensors to stage) and the one executor (``_execute._registered``):

1. each registered tensor argument not on the communicator's device is replaced by a contiguous copy on it (a
   parameter only written, not read, by an empty tensor); an object passed to several parameters is staged once;
2. the staging copies are finished (the device's current stream is synchronised), so the method may run on any
   stream of the device, its own or a ``stream`` argument;
3. the method runs; then the whole device is synchronised, so its work on whatever stream has finished;
4. each staged written argument is copied back into the caller's own tensor object, complete on return.

A method that raises leaves the caller's tensors as they were. Calls where every registered argument is already
on the communicator's device (or is not a tensor) run untouched: no copy, no synchronisation.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
from typing import Callable, Iterable

import torch

from offload_shim import _execute, _patching, _plan, _staging, _table
from offload_shim._state import state


@dataclasses.dataclass(frozen=True)
class _Spec:
    entry: _table.Collective  # its tensor parameters, in signature order, each read, written or both
    device: str | Callable  # attribute name of the instance, or callable(instance) -> torch.device

    def device_of(self, instance) -> torch.device:
        value = getattr(instance, self.device) if isinstance(self.device, str) else self.device(instance)
        return value if isinstance(value, torch.device) else torch.device(value)


_specs: dict[tuple[str, str | None, str], _Spec] = {}


def register_communicator(
    owner: type | types.ModuleType,
    method: str,
    *,
    device: str | Callable[[object], torch.device],
    reads: Iterable[str] | str = (),
    writes: Iterable[str] | str = (),
) -> None:
    """Stage the tensors a communicator's method gets through the device the communicator works on.

    After this call, ``owner.method`` is wrapped whenever offload_shim is installed (at once if it is, and at
    every later :func:`offload_shim.install`; :func:`offload_shim.uninstall` binds the original back). When a
    tensor given for a parameter in ``reads`` or ``writes`` is not on the communicator's device (it is on the CPU
    or on another accelerator of the host), the method gets a contiguous copy on that device instead, of the same
    shape and dtype: a copy of the caller's values for ``reads``, an uninitialised tensor for a parameter only in
    ``writes`` (the method must then write all of it; list a parameter it may write in part in both). After the
    method, the staged tensors of ``writes`` are copied back into the caller's own tensor objects (any strides).
    A tensor the method returns comes back to the caller: the caller's tensor object if it is a staged copy of
    one (copied back first), else, if it is on the communicator's device, a copy on the device of the first
    staged ``reads`` argument (in signature order; the first staged argument if none was read). Other return
    values are returned as they are. The call is synchronous: every copy has finished when it returns.

    Tensors already on the communicator's device, and arguments that are ``None`` or not tensors, are passed as
    they are; when no argument needs staging, the call runs untouched. With
    ``offload_shim.configure(always_stage=True)`` every tensor argument is staged, even one already on the
    device (tests, debugging). Registering the same method again replaces its settings.

    Args:
        owner: the class that defines ``method`` itself (not by inheritance), reachable from its module by its
            qualified name; or a module, for a module-level function.
        method: the name of the method (or function) in ``owner``.
        device: how to find the device the communicator works on: the name of an attribute of the instance
            (``"device"`` for vLLM's communicators), or a callable given the instance (``None`` for a
            module-level function) and returning a ``torch.device`` (or a string or index ``torch.device``
            takes).
        reads: names of the parameters whose tensors the method reads (copied to the device before the call).
        writes: names of the parameters whose tensors the method writes (copied back after the call). A
            parameter in both is copied both ways.

    Raises:
        TypeError: ``owner`` is neither a class nor a module, ``owner.method`` is not a plain function or is an
            ``async def`` one (a staged call is synchronous), or ``device`` is neither a string nor a callable.
        AttributeError: ``owner`` has no ``method`` of its own (the message names the class that defines it).
        ValueError: ``reads`` and ``writes`` are both empty or name a parameter ``method`` does not have
            (positional and keyword parameters only, the instance excluded); ``device`` is a string that is not
            an identifier, or a string given for a module-level function; ``owner`` cannot be found again from
            its module (a class defined inside a function).

    At call time, a tensor to stage to a device that this process cannot use raises
    :class:`offload_shim.StagingError` before the method is entered, with the caller's tensors unchanged.
    """
    function, target_owner = _resolve(owner, method)
    is_method = target_owner is not None
    module_name = owner.__module__ if is_method else owner.__name__
    label = ".".join(p for p in (module_name, target_owner, method) if p)
    if inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function):
        raise TypeError(
            f"offload_shim: register_communicator({label}): an async method returns before its body runs, and a "
            f"staged call copies its results back when it returns; register the synchronous method it awaits"
        )
    if isinstance(device, str):
        if not device.isidentifier():
            raise ValueError(
                f"offload_shim: register_communicator({label}): device={device!r} is not an attribute name; "
                f"for a fixed device pass a callable, e.g. device=lambda _: torch.device({device!r})"
            )
        if not is_method:
            raise ValueError(
                f"offload_shim: register_communicator({label}): a module-level function has no instance to take "
                f"attribute {device!r} from; pass a callable, e.g. device=lambda _: torch.device('cuda:0')"
            )
    elif not callable(device):
        raise TypeError(
            f"offload_shim: register_communicator({label}): device must be an attribute name or a callable "
            f"(instance) -> torch.device, not {device!r}"
        )
    reads, writes = _names(reads), _names(writes)
    if not reads and not writes:
        raise ValueError(f"offload_shim: register_communicator({label}): reads and writes are both empty")
    signature = inspect.signature(function)
    known = [
        name
        for name, p in signature.parameters.items()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ][1 if is_method else 0 :]
    unknown = sorted((set(reads) | set(writes)) - set(known))
    if unknown:
        raise ValueError(
            f"offload_shim: register_communicator({label}): no parameter {', '.join(map(repr, unknown))}; "
            f"its parameters are {known}"
        )
    args = tuple(
        _table.Arg(name, _table.BOTH if name in reads and name in writes else _table.READ if name in reads else
                   _table.WRITE, refusal=_table.AUTOGRAD_WRITTEN_FIRST if name in writes else None)
        for name in known if name in reads or name in writes)
    spec = _Spec(_table.Collective(method, label, args), device)
    key = (module_name, target_owner, method)
    with state.patching_lock:
        new = key not in _specs
        _specs[key] = spec
        if new:
            _patching.add_target(_patching.Target(module_name, method, _make_wrapper(key, is_method), target_owner))


def _names(names) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else tuple(names)


def _resolve(owner, method: str) -> tuple[Callable, str | None]:
    """The function to wrap and the owner path ``_patching.Target`` takes (``None`` for a module)."""
    if isinstance(owner, types.ModuleType):
        function = vars(owner).get(method)
        if function is None:
            raise AttributeError(f"offload_shim: module {owner.__name__!r} has no function {method!r}")
        if not callable(function):
            raise TypeError(f"offload_shim: {owner.__name__}.{method} is not callable")
        return function, None
    if not isinstance(owner, type):
        raise TypeError(f"offload_shim: register_communicator takes a class or a module, not {owner!r}")
    name = f"{owner.__module__}.{owner.__qualname__}"
    function = vars(owner).get(method)
    if function is None:
        definer = next((c for c in owner.__mro__ if method in vars(c)), None)
        where = f"; it is defined on {definer.__module__}.{definer.__qualname__}: register that class" if definer else ""
        raise AttributeError(f"offload_shim: class {name} defines no method {method!r}{where}")
    if not inspect.isfunction(function):
        raise TypeError(f"offload_shim: {name}.{method} is {type(function).__name__}, not a plain function")
    found = sys.modules.get(owner.__module__)
    for part in owner.__qualname__.split("."):
        found = getattr(found, part, None)
    if found is not owner:
        raise ValueError(f"offload_shim: class {name} cannot be found again by name in its module")
    return function, owner.__qualname__


def _make_wrapper(key, is_method: bool):
    def make(original, live):
        # Positions as the wrapper gets them: wrapt passes a method's instance apart from args.
        parameters = _patching.Parameters(functools.partial(original, None) if is_method else original)

        def wrapper(wrapped, instance, args, kwargs):
            if not live or _staging.in_staged_call():
                return wrapped(*args, **kwargs)
            spec = _specs[key]
            values = {arg.name: parameters.get(args, kwargs, arg.name) for arg in spec.entry.args}
            plan = _plan.decide(_plan.Call(spec.entry, _plan.COMMUNICATOR, None, values,
                                           device=spec.device_of(instance)))
            if plan is None:
                return wrapped(*args, **kwargs)
            return _execute.run(plan, _execute.Caller(wrapped, parameters, args, kwargs))

        return wrapper

    return make
