"""Every private torch name the package reads, in one table (:data:`NAMES`): the name, where the shim uses it, and
what the shim does where the running torch lacks it. A name without a fallback that keeps the shim working must
exist on the installed torch (the test names the missing one); a name with a fallback needs one of its alternatives.
The table cannot fall behind the code: the package's source is parsed, and every private torch name in it (an
attribute chain from a torch module with a part that starts with ``_``, a name looked up with ``getattr`` or
``hasattr`` on a torch module or on any object, a private attribute of an object that the package does not define,
a string that names a private torch module, namespace or attribute) must be in the table, and every row must still
be read by the source. docs/versions.md says what this guards."""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
import importlib
import pathlib
import re
from typing import Callable

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The package: offload_shim/ and the top-level modules it installs (setup.cfg's py_modules).
TOP_LEVEL = ("offload_shim_autoload", "offload_shim_boot", "offload_shim_cli", "offload_shim_names",
             "sitecustomize_template")
SOURCES = sorted((ROOT / "offload_shim").glob("*.py")) + [ROOT / f"{name}.py" for name in TOP_LEVEL]


@dataclasses.dataclass(frozen=True)
class Name:
    """``name``: dotted, as the shim reads it (an attribute of an object: under the class of the object, with
    ``instance`` giving one where the class itself lacks it). ``used``: where, and what for. ``missing``: what the
    shim does where this torch lacks it. ``alternatives``: ``None``: none keeps the shim working, the name must
    exist; else the names its fallback uses instead, one of which (or the name) must exist (``()``: the fallback
    needs nothing of torch's). ``cuda``: CUDA builds only (the path that reads it runs only there). ``relied``: not
    read by the code but relied on (torch calls the shim through it), named in the source's docstrings."""

    name: str
    used: str
    missing: str
    alternatives: tuple[str, ...] | None = None
    cuda: bool = False
    instance: Callable[[], object] | None = None
    relied: bool = False


def _op():
    return torch.ops.aten.add.Tensor


def _options():
    return torch._C._distributed_c10d.AllreduceOptions()


C10D = "torch.distributed.distributed_c10d"
OWN = ()  # (alternatives of a fallback that is the shim's own: nothing of torch's needed)

NAMES = [
    # torch runs the package's torch.backends entry point (setup.cfg) at the end of import torch
    Name("torch._import_device_backends", "OFFLOAD_SHIM=1: torch runs the torch.backends entry points at import torch",
         "OFFLOAD_SHIM=1 switches nothing on (import offload_shim and the drop-in still do)", relied=True),
    Name("torch._is_device_backend_autoload_enabled", "offload_shim_cli.autoload_enabled: its test, copied",
         "nothing: the copy is the shim's own", OWN, relied=True),
    # torch._C: the dispatcher and futures
    Name("torch._C.DispatchKey.CPU", "_kernels.install: is an op's CPU kernel torch's own", "none: no kernels"),
    Name("torch._C.DispatchKey.CompositeExplicitAutograd", "_kernels._original: torch's kernel past the shim's",
         "none: no kernels"),
    Name("torch._C._dispatch_get_all_op_names", "_kernels._collective_ops: the collective ops of this torch",
         "none: no kernels"),
    Name("torch._C._dispatch_has_kernel_for_dispatch_key", "_kernels.install", "none: no kernels"),
    Name("torch._ops.OpOverload", "_kernels._collective_ops: an annotation only (never evaluated)",
         "nothing: annotations are not evaluated", OWN),
    Name("torch._ops.OpOverload._schema", "_kernels: each op's arguments", "none: no kernels", instance=_op),
    Name("torch._ops.OpOverload._opname", "_kernels: each op's name", "none: no kernels", instance=_op),
    Name("torch._ops.OpOverload._namespace", "_kernels: each op's namespace", "none: no kernels", instance=_op),
    Name("torch._ops.OpOverload._op_dk", "_kernels._original: call torch's kernel by dispatch key",
         "none: no kernels", instance=_op),
    Name("torch.library.Library._destroy", "_kernels.uninstall: remove the shim's kernels", "none: no uninstall"),
    Name("torch._C.Future", "_execute, _staging: a work's future, unwrapped", "none"),
    Name("torch._C._storage_Use_Count", "_registration: is a registered storage still used",
         "none: OFFLOAD_SHIM_REGISTER_BYTES fails"),
    Name("torch.UntypedStorage._cdata", "_registration: the storage's handle for _storage_Use_Count",
         "none: OFFLOAD_SHIM_REGISTER_BYTES fails"),
    Name("torch.Tensor._base", "_table.inplace_refusal: a view's base (is it a leaf)", "none"),
    Name("torch.Tensor.is_leaf", "_table.inplace_refusal: getattr on a view's base (None for a non-view)",
         "0: not a leaf", OWN),
    Name("torch._debug_has_internal_overlap", "_table.overlapping: outputs whose elements share memory",
         "such outputs are not refused before the call (torch's own check then)", OWN),
    # torch._C._distributed_c10d: the process group's own methods and their options
    Name("torch._C._distributed_c10d", "_execute: imported as _c10d", "none"),
    Name("torch._C._distributed_c10d.AllgatherOptions", "_execute: a chunked gather's calls", "none"),
    Name("torch._C._distributed_c10d.AllreduceOptions", "_execute: chunked all_reduce, the agreement", "none"),
    Name("torch._C._distributed_c10d.BroadcastOptions", "_execute: a chunked broadcast's calls", "none"),
    Name("torch._C._distributed_c10d.ReduceOptions", "_execute: a chunked reduce's calls", "none"),
    Name("torch._C._distributed_c10d.WorkResult", "_staging: get_future_result of a staged call's handle", "none"),
    Name("torch._C._distributed_c10d.WorkResult.SUCCESS", "_staging: get_future_result", "none"),
    Name("torch._C._distributed_c10d.WorkResult.COMM_ERROR", "_staging: get_future_result", "none"),
    Name("torch.distributed.AllreduceOptions.asyncOp", "_plan._takes_async_op: does async_op take this value",
         "any value is taken as a truth value", OWN, instance=_options),
    Name("torch.distributed.ProcessGroup.all_gather_single", "_execute.GATHER_METHOD: a chunked gather",
         "ProcessGroup._allgather_base (torch 2.11)", ("torch.distributed.ProcessGroup._allgather_base",)),
    Name("torch.distributed.ProcessGroup._get_backend", "_devices.group_timeout, _replay._timeout",
         "the store's timeout, else 30 min; a replay: torch's NCCL default, else 10 min", OWN),
    Name("torch._C._distributed_c10d.Backend.Options._timeout", "_devices.group_timeout, _replay._timeout: a "
         "backend's timeout", "as for _get_backend", OWN),
    Name("torch.distributed.ProcessGroup._device_types", "_devices: the device types a group serves",
         "what torch recorded for its backends (Backend.backend_capability)",
         ("torch.distributed.Backend.backend_capability",)),
    Name("torch.distributed.ProcessGroup.bound_device_id", "_devices, doctor: the group's bound device",
         "the current device", OWN),
    Name("torch.distributed.ProcessGroup.group_name", "_devices.group_label, _replay: messages", "'?' or None",
         OWN),
    Name("torch.distributed.ProcessGroup.group_desc", "_devices.group_label: messages", "left out", OWN),
    Name("torch.distributed.constants.default_pg_nccl_timeout", "_replay._timeout", "10 min", OWN),
    Name("torch.distributed.P2POp.group", "_wrappers: batch_isend_irecv's group",
         "none: the default group's would be taken", instance=lambda: _set_in_init(torch.distributed.P2POp)),
    Name("torch.distributed.P2POp.tensor", "_wrappers: batch_isend_irecv's tensors", "none: not staged",
         instance=lambda: _set_in_init(torch.distributed.P2POp)),
    Name("torch.distributed.device_mesh.DeviceMesh.get_group", "_devices.resolve_functional_group: a mesh",
         "none: a mesh is then not recognised", None),
    Name("torch.distributed.device_mesh.DeviceMesh.ndim", "_devices.resolve_functional_group: a 1-D mesh",
         "none: a mesh is then not recognised", None),
    # torch.distributed.distributed_c10d's private state
    Name(f"{C10D}._world", "_replay, _wrappers, _plan, _devices: torch's record of its groups", "none"),
    Name(f"{C10D}._world.default_pg", "_wrappers: the default group of a call without one", "none"),
    Name(f"{C10D}._world.pg_map", "_devices: a group's store (the ranks' agreement); _replay.prune",
         "no store: the ranks' settings are not compared", None),
    Name(f"{C10D}._world.pg_coalesce_state", "_plan, _replay: a call inside torch's _coalescing_manager",
         "none: such a call is no longer refused", None),
    Name(f"{C10D}._resolve_process_group", "_devices, _kernels: the group of a group name",
         "none: functional collectives and ops go to torch unstaged", None),
    Name(f"{C10D}._get_default_store", "doctor: the job's store", "none: doctor fails"),
    # the functional collectives, their ops, DTensor's op, Dynamo
    Name("torch.distributed._functional_collectives", "_table.FUNCTIONAL: the wrapped functions (those that exist)",
         "nothing to wrap there; the ops below them are staged by the kernels",
         ("torch.ops._c10d_functional.all_reduce",)),
    Name("torch.distributed._functional_collectives.all_reduce", "_devices.PARTLY_SERVED: a label",
         "nothing: a label", OWN),
    Name("torch.distributed._functional_collectives._resolve_group_name", "_devices.resolve_functional_group",
         "none: functional collectives go to torch unstaged", None),
    Name("torch.ops._c10d_functional", "_table.OPS, _kernels: the ops the kernels stage", "none: no kernels"),
    Name("torch.ops._c10d_functional.wait_tensor", "_execute._completed", "none"),
    Name("torch.ops._dtensor", "_table.OPS_NAMESPACES: DTensor's ops", "nothing to stage there", OWN),
    Name("torch.ops._dtensor.shard_dim_alltoall", "_table.OPS: DTensor's Shard(i) to Shard(j)",
         "nothing to stage: an op this torch lacks has no kernel", OWN),
    Name("torch._dynamo.trace_rules.add", "_kernels._keep_out_of_dynamo: the shim's frames never compiled",
         "a warning; compiled code that graph-breaks on a wrapper may fail to compile it", OWN),
    # torch._C's CUDA functions under the public ones (a replay's path)
    Name("torch._C._cuda_getDevice", "_replay", "torch.cuda.current_device", ("torch.cuda.current_device",)),
    Name("torch._C._cuda_isCurrentStreamCapturing", "_replay", "torch.cuda.is_current_stream_capturing",
         ("torch.cuda.is_current_stream_capturing",)),
    Name("torch._C._CudaStreamBase.query", "_replay", "torch.cuda.Stream.query", ("torch.cuda.Stream.query",)),
    Name("torch._C._CUDAGraph.replay", "_replay", "torch.cuda.CUDAGraph.replay", ("torch.cuda.CUDAGraph.replay",)),
    Name("torch._C._CudaEventBase.query", "_replay", "torch.cuda.Event.query", ("torch.cuda.Event.query",)),
    Name("torch._C._cuda_getCurrentRawStream", "_replay: the current stream's key", "none: a replay fails",
         None, cuda=True),
]

# Names looked up on objects (getattr, hasattr, a private attribute) that are not torch's, and whose they are.
NOT_TORCH = {
    "_getframe": "sys", "orig_argv": "sys", "register_at_fork": "os", "sched_getaffinity": "os",
    "exec_module": "an import loader", "_initializing": "a module's __spec__ (importlib)",
    "_frozen_importlib": "sys.modules", "_frozen_importlib_external": "sys.modules",
    "_post_import_hooks_lock": "wrapt", "is_installed": "offload_shim (the package, seen from the boot module)",
    "timeout": "a c10d Store (getattr, default 30 min)", "wait": "an AsyncCollectiveTensor (duck-typed)",
}


def _set_in_init(cls):
    """An object with the attributes ``cls.__init__`` sets on ``self`` (``P2POp``'s need a process group to make)."""
    import inspect
    import textwrap
    import types

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    return types.SimpleNamespace(**{node.attr: None for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                                    and isinstance(node.ctx, ast.Store) and getattr(node.value, "id", "") == "self"})


# ---------------------------------------------------------------- the installed torch has them


def resolve(name: str, instance: Callable[[], object] | None = None) -> bool:
    """Whether ``name`` exists on the installed torch: each part an attribute (or, under a module, a submodule
    imported); an op namespace exists where the dispatcher has an op of it; the last part may be looked up on
    ``instance()`` instead."""
    parts = name.split(".")
    if parts[:2] == ["torch", "ops"] and len(parts) == 3:
        return any(op.startswith(parts[2] + "::") for op in torch._C._dispatch_get_all_op_names())
    obj = torch
    for at, part in enumerate(parts[1:], start=2):
        if at == len(parts) and instance is not None and not hasattr(obj, part):
            obj = instance()
        try:
            obj = getattr(obj, part)
            continue
        except AttributeError:
            pass
        except Exception:  # noqa: BLE001  (a lazy attribute that fails: missing for the shim too)
            return False
        if not isinstance(obj, type(torch)):
            return False
        try:
            obj = importlib.import_module(".".join(parts[:at]))
        except ImportError:
            return False
    return True


def _missing(rows) -> list[str]:
    import torch.distributed.tensor  # noqa: F401  (registers DTensor's ops: the shim finds them once imported)

    missing = []
    cuda_build = torch.backends.cuda.is_built()
    for row in rows:
        if row.cuda and not cuda_build:
            continue
        if row.alternatives is None:
            if not resolve(row.name, row.instance):
                missing.append(f"{row.name} (used in {row.used}; without it: {row.missing})")
        elif row.alternatives and not any(resolve(n, row.instance) for n in (row.name, *row.alternatives)):
            missing.append(f"{row.name} and its fallback {', '.join(row.alternatives)} (used in {row.used})")
    return missing


def test_the_installed_torch_has_every_name_the_shim_needs():
    missing = _missing(NAMES)
    assert not missing, (f"torch {torch.__version__} lacks names offload_shim reads (tests/test_torch_names.py, "
                         "docs/versions.md):\n  " + "\n  ".join(missing))


def test_a_missing_name_is_named():
    """The check fails, naming it, for a name this torch lacks, and for a fallback none of whose names exist."""
    made_up = [Name("torch._C._offload_shim_no_such_name", "here", "none"),
               Name("torch.distributed._offload_shim_gone", "here", "x", ("torch.distributed._offload_shim_too",)),
               Name("torch.ops._offload_shim_no_namespace", "here", "none")]
    assert [line.split(" ")[0] for line in _missing(made_up)] == [row.name for row in made_up]
    assert resolve("torch._dynamo.trace_rules.add") and resolve("torch.ops._c10d_functional.all_reduce")
    assert not resolve("torch.ops._c10d_functional.offload_shim_no_such_op")


def test_cuda_only_names_are_checked_on_cuda_builds():
    if not torch.backends.cuda.is_built():
        pytest.skip("a CPU build of torch: the names only its CUDA builds have are checked on those (docs/versions.md)")
    assert not _missing([row for row in NAMES if row.cuda])


# ---------------------------------------------------------------- the table covers the source


def _private(part: str) -> bool:
    return len(part) > 1 and part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _lookup(node) -> bool:
    """``getattr(obj, "name", ...)`` or ``hasattr(obj, "name")``."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str))


# A dict's own methods, after a lookup that falls back to a dict (getattr(_world, "pg_map", {}).get): not torch's.
_DICT_METHODS = {"get", "items", "keys", "values"}
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


@dataclasses.dataclass
class Found:
    """What source reads of torch, each with where (``file:line``): ``chains``, dotted names from a torch module
    with a private part or a part looked up by getattr/hasattr; ``attributes``, private attributes of objects and
    names looked up on objects, that the package does not define; ``strings``, string constants that name a private
    torch module or attribute (``"torch._dynamo.trace_rules"``) or are a private name (``"_allgather_base"``)."""

    chains: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(set))
    attributes: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(set))
    strings: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(set))
    read: set = dataclasses.field(default_factory=set)  # every attribute name and string read, the package's too


def _walk_scope(body):
    """The nodes of a scope's statements, functions, lambdas and classes it defines yielded but not entered (their
    decorators, defaults and bases are entered: they belong to this scope)."""
    pending = list(reversed(body))
    while pending:
        node = pending.pop()
        yield node
        if isinstance(node, _SCOPES):
            outer = [*getattr(node, "decorator_list", []), *getattr(node, "bases", [])]
            if not isinstance(node, ast.ClassDef):
                arguments = (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg,
                             node.args.kwarg)
                outer += [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None),
                          *(a.annotation for a in arguments if a is not None and a.annotation is not None),
                          *([node.returns] if getattr(node, "returns", None) else [])]
            pending.extend(reversed(outer))
        else:
            pending.extend(reversed(list(ast.iter_child_nodes(node))))


def _own_names(trees) -> tuple[set, set, set]:
    """What the package defines: attribute names (its classes' members and slots, attributes it sets on ``self``,
    ``cls`` or its own modules and objects), names it may give as strings (those, and its private functions), and
    the names its own modules and objects are imported under."""
    attributes, functions, roots = set(), set(), set(TOP_LEVEL) | {"offload_shim"}
    for tree in trees:  # (first the roots: the attributes set on them are the package's)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in roots:
                roots.update(alias.asname or alias.name for alias in node.names)
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        attributes.add(item.name)
                    targets = item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
                    attributes.update(t.id for t in targets if isinstance(t, ast.Name))
                    if isinstance(item, ast.Assign) and any(getattr(t, "id", "") == "__slots__" for t in targets):
                        attributes.update(e.value for e in getattr(item.value, "elts", []) if isinstance(e, ast.Constant))
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)) and isinstance(
                    node.value, ast.Name) and node.value.id in (*roots, "self", "cls"):
                attributes.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
                functions.add(node.name)
    return attributes, attributes | functions, roots


def scan(sources: dict[str, str]) -> Found:
    """Parse ``sources`` (a file's label -> its Python source) and collect what they read of torch (:class:`Found`).

    Names bound to torch: ``import torch...`` and ``from torch... import ...`` anywhere in a file; a name assigned
    a torch name and nothing else in its scope (at module level, any torch name; in a function, one with a private
    part). What the package defines itself (:func:`_own_names`) is not reported."""
    found = Found()
    trees = {label: ast.parse(text) for label, text in sources.items()}
    own_attributes, own_strings, own_roots = _own_names(trees.values())

    for label, tree in trees.items():
        imported = {}
        for node in ast.walk(tree):
            modules = []
            if isinstance(node, ast.Import):
                modules = [(alias.asname or "torch", alias.name if alias.asname else "torch", alias.name)
                           for alias in node.names if alias.name.split(".")[0] == "torch"]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
                modules = [(alias.asname or alias.name, f"{node.module}.{alias.name}", f"{node.module}.{alias.name}")
                           for alias in node.names]
            for bound, value, name in modules:
                imported[bound] = value
                if any(_private(part) for part in name.split(".")):
                    found.chains[name].add(f"{label}:{node.lineno}")

        def dotted(node, names):
            parts = []
            while True:
                if isinstance(node, ast.Attribute) and node.attr in _DICT_METHODS and _lookup(node.value) and len(
                        node.value.args) > 2 and isinstance(node.value.args[2], ast.Dict):
                    return None  # (a dict's method, on what a lookup gave or its default {}: not torch's)
                if isinstance(node, ast.Attribute):
                    parts.append(node.attr)
                    node = node.value
                elif _lookup(node):
                    parts.append(node.args[1].value)
                    node = node.args[0]
                elif isinstance(node, ast.Name) and node.id in names:
                    return ".".join([names[node.id], *reversed(parts)])
                else:
                    return None

        def visit(body, outer, module_level=False, parameters=()):
            names = {name: chain for name, chain in outer.items() if name not in parameters}
            stores, chains = collections.Counter(), collections.defaultdict(set)
            nodes = list(_walk_scope(body))
            for node in nodes:
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    stores[node.id] += 1
                elif isinstance(node, _SCOPES) and not isinstance(node, ast.Lambda):
                    stores[node.name] += 1
                if isinstance(node, ast.Assign) and len(node.targets) == 1:
                    target, value = node.targets[0], node.value
                    pairs = zip(target.elts, value.elts) if isinstance(target, ast.Tuple) and isinstance(
                        value, ast.Tuple) else [(target, value)]
                    for each, given in pairs:
                        chain = dotted(given, names) if isinstance(each, ast.Name) else None
                        if chain and (module_level or any(_private(p) for p in chain.split(".")[1:])):
                            chains[each.id].add(chain)
            for name, count in stores.items():
                names.pop(name, None)  # (bound here: whatever the enclosing scope bound it to is not what it is)
                if len(chains.get(name, ())) == 1 and count == 1:
                    names[name] = next(iter(chains[name]))
            parents = {child: node for node in nodes for child in ast.iter_child_nodes(node)}
            for node in nodes:
                if isinstance(node, _SCOPES):
                    arguments = [] if isinstance(node, ast.ClassDef) else [
                        a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs,
                                        node.args.vararg, node.args.kwarg) if a is not None]
                    visit(node.body if isinstance(node.body, list) else [ast.Expr(node.body)], names,
                          parameters=arguments)
                    continue
                where = f"{label}:{getattr(node, 'lineno', '?')}"
                if isinstance(node, ast.Attribute):
                    found.read.add(node.attr)
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"[\w.]+", node.value):
                    value = node.value.rstrip(".")  # ("torch.ops._c10d_functional." + name)
                    found.read.add(value)
                    parts = value.split(".")
                    if (parts[0] == "torch" and any(_private(p) for p in parts)) or (
                            len(parts) == 1 and _private(value) and value not in own_strings):
                        found.strings[value].add(where)
                if isinstance(node, (ast.Attribute, ast.Call)):
                    chain = dotted(node, names)
                    if chain is not None:
                        parent = parents.get(node)
                        longer = dotted(parent, names) if isinstance(parent, ast.Attribute) or (
                            _lookup(parent) and parent.args[0] is node) else None
                        if longer:
                            continue  # (the longer chain is the one read)
                        if any(_private(p) for p in chain.split(".")[1:]) or _lookup(node) or (
                                isinstance(node, ast.Attribute) and _lookup(node.value)):
                            found.chains[chain].add(where)
                        continue
                owner = node.args[0] if _lookup(node) else getattr(node, "value", None)
                if isinstance(owner, ast.Name) and owner.id in (*own_roots, "self", "cls"):
                    continue
                if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own_attributes:
                    found.attributes[node.attr].add(where)
                elif _lookup(node):
                    looked = node.args[1].value
                    if not (looked.startswith("__") and looked.endswith("__")) and looked not in own_strings:
                        found.attributes[looked].add(where)

        visit(tree.body, imported, module_level=True)
    return found


@functools.lru_cache(maxsize=None)
def _source_found() -> Found:
    return scan({path.relative_to(ROOT).as_posix(): path.read_text() for path in SOURCES})


def _lacking(found: Found, rows) -> list[str]:
    """What ``found`` reads that the table ``rows`` (with :data:`NOT_TORCH`) lacks, each with where."""
    names = {row.name for row in rows} | {name for row in rows for name in (row.alternatives or ())}
    last_parts = {name.rsplit(".", 1)[-1] for name in names}
    parts = {part for name in names for part in name.split(".")}
    lacking = [f"{chain} at {', '.join(sorted(where))}" for chain, where in sorted(found.chains.items())
               if chain not in names]
    lacking += [f".{attribute} (of an object) at {', '.join(sorted(where))}"
                for attribute, where in sorted(found.attributes.items())
                if attribute not in last_parts and attribute not in NOT_TORCH]
    for string, where in sorted(found.strings.items()):
        if string.startswith("torch."):
            covered = any(name == string or name.startswith(string + ".") for name in names)
        else:
            covered = string in parts or string in NOT_TORCH
        if not covered:
            lacking.append(f"{string!r} (a string) at {', '.join(sorted(where))}")
    return lacking


def test_every_private_torch_name_in_the_source_is_in_the_table():
    lacking = _lacking(_source_found(), NAMES)
    assert not lacking, ("names the package reads that tests/test_torch_names.py's NAMES lacks; add each, with "
                         "where it is used and the shim's fallback (or, if not torch's, to NOT_TORCH):\n  "
                         + "\n  ".join(lacking))


def test_every_row_is_still_read_by_the_source():
    """No stale rows: each name of the table is read somewhere in the package (a row for a name no longer read
    would check a torch for nothing)."""
    found = _source_found()
    read = set(found.chains) | {s for s in found.strings if s.startswith("torch.")}
    text = "\n".join(path.read_text() for path in SOURCES)
    stale = [row.name for row in NAMES if not row.relied
             and row.name not in read and not any(r.startswith(row.name + ".") for r in read)
             and row.name.rsplit(".", 1)[-1] not in found.read]
    stale += [row.name for row in NAMES if row.relied and f"``{row.name}``" not in text]
    assert not stale, f"rows of NAMES that no source of the package reads (or, relied on, names) any more: {stale}"
    unused = sorted(set(NOT_TORCH) - found.read)
    assert not unused, f"NOT_TORCH names no source reads any more: {unused}"


MADE_UP = '''
import torch
import torch.distributed as dist
import torch._C._made_up_module as made
from torch.distributed import _made_up_from
from offload_shim import _state

_world = dist.distributed_c10d._made_up_world


class Own:
    __slots__ = ("_slot",)

    def _method(self):
        self._set_by_the_package = 1
        return self._slot, self._other


def f(group, x, dist=None):
    local = torch._C._made_up_local
    local.member
    torch._C._made_up_chain.attribute
    getattr(torch._C, "_made_up_getattr", None)
    hasattr(torch.distributed.ProcessGroup, "made_up_public")
    getattr(getattr(torch._C, "_MadeUpOuter", None), "inner", None)
    getattr(_world, "made_up_map", {}).get(group)
    group._made_up_private_attribute
    getattr(group, "made_up_looked_up", None)
    hook("torch._made_up.module")
    names = ("_made_up_namespace",)
    dist._not_torch_here  # (a parameter: not torch.distributed)
    torch.distributed.all_reduce(x)  # public: not reported
    return x._set_by_the_package, _state._own_module, Own()._method, x._slot, names
'''


def test_the_scan_finds_each_kind_of_name():
    """The scan is not blind: each kind of name in a made-up module is found (and what the module defines itself,
    a parameter that shadows a torch name and public names are not), and the table lacks each of them."""
    found = scan({"made_up.py": MADE_UP})
    assert set(found.chains) == {
        "torch._C._made_up_module", "torch.distributed._made_up_from", "torch.distributed.distributed_c10d._made_up_world",
        "torch._C._made_up_local", "torch._C._made_up_local.member", "torch._C._made_up_chain.attribute",
        "torch._C._made_up_getattr", "torch.distributed.ProcessGroup.made_up_public", "torch._C._MadeUpOuter.inner",
        "torch.distributed.distributed_c10d._made_up_world.made_up_map",
    }, sorted(found.chains)
    assert set(found.attributes) == {"_made_up_private_attribute", "made_up_looked_up", "_not_torch_here"}, \
        sorted(found.attributes)
    assert set(found.strings) == {"torch._made_up.module", "_made_up_namespace", "_made_up_getattr",
                                  "_MadeUpOuter"}, sorted(found.strings)
    lacking = _lacking(found, NAMES)
    assert len(lacking) == len(found.chains) + len(found.attributes) + len(found.strings), lacking
