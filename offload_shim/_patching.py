"""Installing and removing wrappers: one ``wrapt.FunctionWrapper`` per object bound where a caller reaches a
wrapped function, put at every name that holds that object.

A function such as ``torch.distributed.all_reduce`` is reachable at its home (``torch.distributed.distributed_c10d.
all_reduce``), at its public aliases (``torch.distributed.all_reduce``), and under the same name in any module
that imported it by name before the shim was installed (``torch/distributed/tensor/_collective_utils.py`` binds
``broadcast`` so). Installing wraps what is bound at the home and at each alias at that moment, whoever put it
there (torch, or a user's or another tool's wrapper of it), and binds each wrapper at every module attribute of that
name holding the object it wraps; modules imported later bind the wrapper themselves. Removing binds each object back
wherever its wrapper is found, modules imported while the shim was installed included; a name that someone else
rebound after the shim (a wrapper of the shim's wrapper) is left as they left it. Each wrapper passes every call
straight through while removed, so one that someone else still holds stages nothing, and a later install never
stacks a second staging wrapper on it: it binds the same wrapper again where it finds the same object to wrap (then
one that someone holds stages again, as the installed one it is; compiled code that guards on the function it calls
is not recompiled at each install). A wrapper asks whether it is still installed only where it would act (decide,
replay, stage): a call it passes on is the same installed or not, so the calls that need no staging pay nothing for
the question. Identity, not ``__wrapped__`` (which torch's own ``functools.wraps``
decorators set), tells one object from another.

Families of patches whose module torch imports lazily (DTensor, the functional collectives) are applied by
a wrapt post-import hook when that module is first imported.

What is wrapped where (the tables below) is the process's, inherited by a forked child as it is.
"""

from __future__ import annotations

import logging
import sys
import weakref
from dataclasses import dataclass
from typing import Callable

import wrapt

from offload_shim._state import state

_log = logging.getLogger("offload_shim")

WrapperFactory = Callable[[Callable, list], Callable]


@dataclass(frozen=True)
class Target:
    """One function to wrap.

    Attributes:
        module: the module that defines it (its home), e.g. ``"torch.distributed.distributed_c10d"``.
        name: its attribute name there.
        owner: for a method, the class attribute path inside ``module`` (e.g. ``"DTensor"``); ``None`` for a
            module-level function, which is then also rebound in every other module that holds it by name.
        make_wrapper: given the original function (whose signature names the call's parameters) and ``live`` (a list,
            non-empty while the wrapper is installed), returns the wrapt wrapper ``(wrapped, instance, args, kwargs)
            -> result``, which passes every call straight to ``wrapped`` once ``live`` is empty (it asks ``live``
            where it would act, before deciding, replaying or staging anything).
        aliases: other modules where the function is public under the same name (``"torch.distributed"``); what
            is bound there at install time is wrapped even when it is not the home's object.
    """

    module: str
    name: str
    make_wrapper: WrapperFactory
    owner: str | None = None
    aliases: tuple[str, ...] = ()


@dataclass
class _Binding:
    """One wrapper, bound in place of ``original`` (torch's function, or whatever wrapped it before the shim)."""

    target: Target
    original: object
    wrapper: wrapt.FunctionWrapper
    live: list  # [True] while installed; emptied on removal: the wrapper then passes calls straight through


_installed = False
_applied: dict[tuple[str, str | None, str], list[_Binding]] = {}
_hooked_modules: set[str] = set()
_targets: list[Target] = []
_added: list[Target] = []  # targets added by add_target(), wrapped by every install() after it
# The bindings uninstall() removed, by key as _applied: install() binds the same wrappers again where it finds the
# same objects to wrap.
_removed: dict[tuple[str, str | None, str], list[_Binding]] = {}
# Every wrapper the shim made, by id (a wrapper compares and hashes equal to what it wraps, so no set of them).
_ours: dict[int, weakref.ref] = {}


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


def _is_ours(value) -> bool:
    ref = _ours.get(id(value))
    return ref is not None and ref() is value


def unwrap_ours(value):
    """``value`` without the shim's own (removed, pass-through) wrappers around it."""
    while _is_ours(value):
        value = value.__wrapped__
    return value


def _apply(target: Target) -> None:
    key = (target.module, target.owner, target.name)
    if key in _applied:
        return
    home = _owner_object(target)
    reference = unwrap_ours(vars(home).get(target.name))
    if reference is None:
        _log.debug("offload_shim: %s.%s not present in this torch; not wrapped", target.module, target.name)
        return
    sites = [home] + [sys.modules[alias] for alias in target.aliases if alias in sys.modules]
    reference = _named_parameters(reference, [unwrap_ours(vars(site).get(target.name)) for site in sites], target)
    bindings: list[_Binding] = []
    for site in sites:
        value = unwrap_ours(vars(site).get(target.name))
        if value is None or any(b.original is value for b in bindings):
            continue
        before = next((b for b in _removed.get(key, ()) if b.original is value and b.target is target), None)
        if before is not None:  # the wrapper an earlier install made of it, live again: compiled code's guards on
            wrapper, live = before.wrapper, before.live  # the function it calls hold across install cycles
            live.append(True)
        else:
            live = [True]
            # (Not wrapt's ``enabled=live``: wrapt would read it before every call, served ones included.)
            wrapper = wrapt.FunctionWrapper(value, target.make_wrapper(reference, live))
            _ours[id(wrapper)] = weakref.ref(wrapper, lambda _, key=id(wrapper): _ours.pop(key, None))
        setattr(site, target.name, wrapper)
        if target.owner is None:
            _rebind(target.name, value, wrapper)
        bindings.append(_Binding(target, value, wrapper, live))
    _applied[key] = bindings


def _named_parameters(reference, values, target: Target):
    """The function whose signature names the call's parameters, for the wrappers to find them by name: the first,
    along each bound object's chain (``__wrapped__``, else a closure cell holding a function of the same name, as a
    patch without ``functools.wraps`` holds what it calls), that takes more than ``*args, **kwargs``."""
    import inspect

    for value in values:
        seen = []
        while callable(value) and not any(value is s for s in seen):
            seen.append(value)
            try:
                parameters = inspect.signature(value, follow_wrapped=False).parameters.values()
            except (TypeError, ValueError):
                parameters = ()
            if any(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
                return value
            inner = getattr(value, "__wrapped__", None)
            if inner is None:
                cells = getattr(value, "__closure__", None) or ()
                inner = next((c.cell_contents for c in cells if getattr(c.cell_contents, "__name__", None) == target.name), None)
            value = inner
    _log.warning(
        "offload_shim: %s.%s is bound to a wrapper that hides its parameters (no functools.wraps); calls that pass "
        "tensors by position may not be staged", target.module, target.name,
    )
    return reference


def _remove(binding: _Binding) -> None:
    binding.live.clear()
    target = binding.target
    if target.owner is None:
        _rebind(target.name, binding.wrapper, binding.original)
        return
    owner = _owner_object(target)
    if vars(owner).get(target.name) is binding.wrapper:
        setattr(owner, target.name, binding.original)
    else:
        _log.debug(
            "offload_shim: %s.%s.%s was replaced after offload_shim wrapped it; left as found (the shim's wrapper "
            "inside it passes calls through)", target.module, target.owner, target.name,
        )


def _on_import(module) -> None:
    with state.patching_lock:
        if not _installed:
            return
        for target in _targets:
            if target.module == module.__name__:
                _apply(target)


def install(targets: list[Target]) -> None:
    """Wrap ``targets`` and those of :func:`add_target`: now where their module is imported, else when it is.
    Installing twice changes nothing."""
    global _installed
    with state.patching_lock:
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
    with state.patching_lock:
        _added.append(target)
        if _installed:
            _targets.append(target)
            _hook(target.module)


def uninstall() -> None:
    """Bind the objects the wrappers replaced back at every name where a wrapper is bound. Removing twice changes
    nothing."""
    global _installed
    with state.patching_lock:
        _installed = False
        for key in list(_applied):
            bindings = _removed[key] = _applied.pop(key)
            for binding in bindings:
                _remove(binding)


def applied_wrappers() -> dict[str, wrapt.FunctionWrapper]:
    """The wrappers in place, by dotted name of the function they wrap (the home's wrapper)."""
    with state.patching_lock:
        return {
            ".".join(p for p in (key[0], key[1], key[2]) if p): bindings[0].wrapper
            for key, bindings in _applied.items()
            if bindings
        }


class Parameters:
    """Reads and replaces a call's arguments by parameter name, positions taken from the wrapped function's
    own signature (so a torch that reorders or adds parameters is followed, not guessed). A keyword-only parameter
    (one after ``*`` or ``*args``) is read from the keywords alone."""

    KEYWORD_ONLY = sys.maxsize  # the position of a keyword-only parameter: past any call's positional arguments

    def __init__(self, function: Callable):
        import inspect

        self._position = {}
        for name, parameter in inspect.signature(function).parameters.items():
            if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
                self._position[name] = len(self._position)
            elif parameter.kind == parameter.KEYWORD_ONLY:
                self._position[name] = self.KEYWORD_ONLY

    def __contains__(self, name: str) -> bool:
        return name in self._position

    def position(self, name: str) -> int:
        """The position of parameter ``name`` (:attr:`KEYWORD_ONLY` for a keyword-only one; ``KeyError`` if the
        function has none)."""
        return self._position[name]

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
