"""Installing and removing wrappers: one ``wrapt.FunctionWrapper`` per wrapped function, bound at every
name a caller can reach it by.

A function such as ``torch.distributed.all_reduce`` is reachable as ``torch.distributed.all_reduce``, as
``torch.distributed.distributed_c10d.all_reduce``, and under the same name in any module that imported it by
name before the shim was installed (``torch/distributed/tensor/_collective_utils.py`` binds ``broadcast``
so). Installing binds the one wrapper at each module attribute of that name that holds the original object;
modules imported later bind the wrapper themselves. Removing binds the original back wherever the wrapper is
found, including modules imported while the shim was installed. Identity, not ``__wrapped__`` (which torch's
own ``functools.wraps`` decorators set), tells original from wrapper.

Families of patches whose module torch imports lazily (DTensor, the functional collectives) are applied by
a wrapt post-import hook when that module is first imported.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass
from typing import Callable

import wrapt

_log = logging.getLogger("offload_shim")

WrapperFactory = Callable[[Callable], Callable]


@dataclass(frozen=True)
class Target:
    """One function to wrap.

    Attributes:
        module: the module that defines it (its home), e.g. ``"torch.distributed.distributed_c10d"``.
        name: its attribute name there.
        owner: for a method, the class attribute path inside ``module`` (e.g. ``"DTensor"``); ``None`` for a
            module-level function, which is then also rebound in every other module that holds it by name.
        make_wrapper: given the original function, returns the wrapt wrapper ``(wrapped, instance, args,
            kwargs) -> result``.
    """

    module: str
    name: str
    make_wrapper: WrapperFactory
    owner: str | None = None


@dataclass
class _Applied:
    target: Target
    original: object
    wrapper: wrapt.FunctionWrapper


_lock = threading.RLock()
_installed = False
_applied: dict[tuple[str, str | None, str], _Applied] = {}
_hooked_modules: set[str] = set()
_targets: list[Target] = []
_added: list[Target] = []  # targets added by add_target(), wrapped by every install() after it


def is_installed() -> bool:
    """Whether the wrappers are installed (wrappers still referenced after :func:`uninstall` pass through)."""
    return _installed


def _owner_object(target: Target):
    owner = sys.modules[target.module]
    if target.owner is not None:
        for part in target.owner.split("."):
            owner = getattr(owner, part)
    return owner


def _rebind(name: str, old: object, new: object) -> int:
    """Bind ``new`` at every module attribute ``name`` that holds ``old`` (by identity)."""
    count = 0
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        try:
            if isinstance(namespace, dict) and namespace.get(name) is old:
                setattr(module, name, new)
                count += 1
        except Exception:  # an odd object in sys.modules; it is not ours to fix
            continue
    return count


def _apply(target: Target) -> None:
    key = (target.module, target.owner, target.name)
    if key in _applied:
        return
    owner = _owner_object(target)
    original = vars(owner).get(target.name)
    if original is None:
        _log.debug("offload_shim: %s.%s not present in this torch; not wrapped", target.module, target.name)
        return
    wrapper = wrapt.FunctionWrapper(original, _guarded(target.make_wrapper(original)))
    if target.owner is None:
        _rebind(target.name, original, wrapper)
    else:
        setattr(owner, target.name, wrapper)
    _applied[key] = _Applied(target, original, wrapper)


def _guarded(wrapper_fn):
    """Pass straight through once the shim is uninstalled (a caller may still hold the wrapper)."""

    def guarded(wrapped, instance, args, kwargs):
        if not _installed:
            return wrapped(*args, **kwargs)
        return wrapper_fn(wrapped, instance, args, kwargs)

    return guarded


def _remove(applied: _Applied) -> None:
    target = applied.target
    if target.owner is None:
        _rebind(target.name, applied.wrapper, applied.original)
        return
    owner = _owner_object(target)
    if vars(owner).get(target.name) is applied.wrapper:
        setattr(owner, target.name, applied.original)
    else:
        _log.warning(
            "offload_shim: %s.%s.%s was replaced by someone else after offload_shim wrapped it; left as found",
            target.module, target.owner, target.name,
        )


def _on_import(module) -> None:
    with _lock:
        if not _installed:
            return
        for target in _targets:
            if target.module == module.__name__:
                _apply(target)


def install(targets: list[Target]) -> None:
    """Wrap ``targets`` and those of :func:`add_target`: now where their module is imported, else when it is.
    Installing twice changes nothing."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        _targets[:] = [*targets, *_added]
        for module_name in dict.fromkeys(t.module for t in _targets):
            _hook(module_name)


def _hook(module_name: str) -> None:
    """Apply the targets of ``module_name`` now if it is imported, else when it is."""
    if module_name in _hooked_modules:
        if module_name in sys.modules:
            _on_import(sys.modules[module_name])
    else:
        _hooked_modules.add(module_name)
        # Runs _on_import at once if the module is imported already, else after its import.
        wrapt.register_post_import_hook(_on_import, module_name)


def add_target(target: Target) -> None:
    """Wrap ``target`` from now on: at once if installed (when its module is imported, if it is not yet), and
    at every later :func:`install`. :func:`uninstall` removes it like any other."""
    with _lock:
        _added.append(target)
        if _installed:
            _targets.append(target)
            _hook(target.module)


def uninstall() -> None:
    """Restore the original objects at every name where a wrapper is bound. Removing twice changes nothing."""
    global _installed
    with _lock:
        _installed = False
        for key in list(_applied):
            _remove(_applied.pop(key))


def applied_wrappers() -> dict[str, wrapt.FunctionWrapper]:
    """The wrappers in place, by dotted name of the function they wrap."""
    with _lock:
        return {
            ".".join(p for p in (a.target.module, a.target.owner, a.target.name) if p): a.wrapper
            for a in _applied.values()
        }


class Parameters:
    """Reads and replaces a call's arguments by parameter name, positions taken from the wrapped function's
    own signature (so a torch that reorders or adds parameters is followed, not guessed)."""

    def __init__(self, function: Callable):
        import inspect

        names = list(inspect.signature(function).parameters)
        self._position = {name: i for i, name in enumerate(names)}

    def __contains__(self, name: str) -> bool:
        return name in self._position

    def get(self, args: tuple, kwargs: dict, name: str, default=None):
        position = self._position.get(name)
        if position is not None and position < len(args):
            return args[position]
        return kwargs.get(name, default)

    def replace(self, args: tuple, kwargs: dict, name: str, value) -> tuple[tuple, dict]:
        position = self._position.get(name)
        if position is not None and position < len(args):
            args = args[:position] + (value,) + args[position + 1 :]
        else:
            kwargs = {**kwargs, name: value}
        return args, kwargs
