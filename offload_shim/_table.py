"""The collectives as data: one entry per collective offload_shim stages, read by the one decision (``_plan``) and
the one executor (``_execute``).

An entry (:class:`Collective`) says what torch requires of a call and what the shim needs to stage it:

* its tensor arguments (:class:`Arg`): their parameter names, their roles on this rank (read, written, both, or
  none), on the root where that differs (a broadcast's source only reads; a gather's list exists on the root
  only), whether each holds a tensor, a list or a list of lists, and what torch refuses of them;
* its wire (:data:`ELEMENTWISE`, :data:`GATHER`, :data:`WHOLE`): whether the collective may be split into chunks,
  because torch requires the sizes it depends on to be equal on every rank and each chunk is a collective of its
  own (elementwise: each position of the tensor independently; gather: each rank's equal-size input into a
  rank-major output), or is always staged as one collective, as torch calls it (sizes that may differ per rank:
  uneven lists, split sizes, lists on the root only);
* whether it reduces (its dtype and reduce op are then shared by every rank, and chunks are cut in whole elements;
  a collective that does not reduce moves bytes, and its chunks are cut in bytes);
* its root parameter (``src`` or ``dst``, as a global rank, or ``group_src``/``group_dst``), and whether it is a
  point-to-point call (each side staged on its own);
* how it is called on staged tensors: the family it belongs to (:data:`C10D`, torch's ``torch.distributed``
  function called with the staged tensors in place of the caller's; :data:`OPS`, the ``torch.ops`` collective ops
  of compiled code, the functional collectives and DTensor, called with staged arguments as their schema says;
  :data:`FUNCTIONAL`, the functional collectives' Python functions, wrapped only for accelerator tensors that go
  through the host).

Adding a collective is one entry here and its tests: the decision, the executor, the wrappers and the docs' tables
read it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

# Roles of a tensor argument on this rank.
READ, WRITE, BOTH, NONE = "read", "write", "both", "none"
# What an argument holds.
TENSOR, LIST, LISTS = "tensor", "list", "lists"
# Wires: how a staged call may be split into collectives. Decided only from what torch requires every rank to share.
ELEMENTWISE = "elementwise"  # one tensor, equal size on every rank, each position independent: chunks of it
GATHER = "gather"  # each rank's input of one size into a rank-major output (all_gather_into_tensor): chunks of each
WHOLE = "whole"  # one collective, as torch's call: the sizes it moves may differ per rank


# ---------------------------------------------------------------- what torch refuses of a tensor argument
# Refused the same way by the staged call before anything is copied: staged, the tensors are contiguous copies,
# written through ``.data``, and nothing would refuse. Measured with torch 2.13 on Gloo; the messages are torch's.


def inplace_refusal(tensor: torch.Tensor) -> Exception | None:
    """The error autograd raises for an in-place write into ``tensor`` in the calling thread's modes, or ``None``
    where it allows one: a leaf that requires grad (or a view of one) in grad mode, an inference tensor outside
    inference mode. It is torch's own exception, raised by the same write into an empty tensor of the same kind,
    where a backend that writes results with an autograd-visible copy (Gloo's gathers) raises it too."""
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        with torch.inference_mode():
            probe = torch.empty(0)
    elif tensor.requires_grad and torch.is_grad_enabled() and (tensor.is_leaf or getattr(tensor._base, "is_leaf", 0)):
        probe = torch.empty(1, requires_grad=True)  # a leaf, or for a view of one a view of it
        probe = probe if tensor.is_leaf else probe[:0]
    else:
        return None
    try:
        probe.zero_()
    except RuntimeError as error:
        return error
    return None


def _contiguous_only(error: type, message: str) -> Callable[[torch.Tensor], Exception | None]:
    def refusal(tensor: torch.Tensor) -> Exception | None:
        return None if tensor.is_contiguous() else error(message)

    return refusal


def _inplace_refusal_first(tensor: torch.Tensor) -> Exception | None:
    return inplace_refusal(tensor)


# Outputs that a backend serving the host (Gloo) writes with copies autograd checks, so that it raises on the rank
# that holds them: after the collective has communicated (it moves the data, then its copy into the outputs raises
# on that rank alone, the outputs unchanged, and its peers return), or for the list reduce_scatter before (it
# writes its output before it sends). NCCL writes them from C++ and refuses none. Every other refusal is torch's on
# every backend, before anything is sent.
AUTOGRAD_WRITTEN = inplace_refusal
AUTOGRAD_WRITTEN_FIRST = _inplace_refusal_first
AUTOGRAD = frozenset({AUTOGRAD_WRITTEN, AUTOGRAD_WRITTEN_FIRST})
AFTER_THE_WIRE = frozenset({AUTOGRAD_WRITTEN})
CONTIGUOUS = _contiguous_only(ValueError, "Tensors must be contiguous")  # Gloo's and NCCL's all-to-all input
CONTIGUOUS_P2P = _contiguous_only(RuntimeError, "input tensor has to be contiguous")  # Gloo's send and recv
_has_internal_overlap = getattr(torch, "_debug_has_internal_overlap", None)  # 0 no, 1 yes, 2 too hard to tell


def overlapping(tensor: torch.Tensor) -> Exception | None:
    """torch's refusal of an in-place write into ``tensor`` where elements share memory (an ``expand``ed view), for
    every tensor a staged call writes, before the wire: its copy back would raise it after the collective (NCCL
    refuses every non-contiguous tensor before it; Gloo writes through the view)."""
    if _has_internal_overlap is None or tensor.is_contiguous() or _has_internal_overlap(tensor) != 1:
        return None
    return RuntimeError("unsupported operation: more than one element of the written-to tensor refers to a single "
                        "memory location. Please clone() the tensor before performing the operation.")


# ---------------------------------------------------------------- entries


@dataclasses.dataclass(frozen=True)
class Arg:
    """A tensor argument of a collective.

    Attributes:
        name: its parameter name (in the function's signature, or the op's schema).
        role: what the call does with it on a rank that is not the root (every rank, for a call without a root):
            :data:`READ`, :data:`WRITE`, :data:`BOTH`, or :data:`NONE` (torch ignores it there).
        form: :data:`TENSOR`, :data:`LIST` or :data:`LISTS` (a list of lists).
        root_role: its role on the root, where that differs.
        refusal: what torch refuses of one of its tensors (a function returning torch's exception, or ``None``).
    """

    name: str
    role: str
    form: str = TENSOR
    root_role: str | None = None
    refusal: Callable[[torch.Tensor], Exception | None] | None = None

    def role_on(self, root: bool | None) -> str:
        """The role on this rank: ``root`` says whether it is the call's root (``None``: the arguments do not say,
        and torch will raise; both roles then, so that nothing is left unstaged)."""
        if self.root_role is None or root is False:
            return self.role
        if root:
            return self.root_role
        return self.role if self.role == self.root_role else BOTH


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective (see the module docstring).

    Attributes:
        name: torch's name for it (``"all_reduce"``; an op's name without its overload).
        label: how the counters, logs and errors name it (``"torch.distributed.all_reduce"``).
        args: its tensor arguments.
        wire: :data:`ELEMENTWISE`, :data:`GATHER` or :data:`WHOLE`.
        reduces: whether it combines the ranks' values (dtype and reduce op shared by every rank).
        root: the name of its root parameter (``"src"``, ``"dst"``), if it has one.
        point_to_point: a send or receive: each side is staged on its own, whatever its peer does.
        returns_new: it returns new tensors (the functional ops) instead of writing the caller's.
    """

    name: str
    label: str
    args: tuple[Arg, ...]
    wire: str = WHOLE
    reduces: bool = False
    root: str | None = None
    point_to_point: bool = False
    returns_new: bool = False

    @property
    def chunkable(self) -> bool:
        return self.wire != WHOLE


def _entries(prefix: str, *collectives: tuple) -> dict[str, Collective]:
    """``{name: Collective}`` from ``(name, args, options)`` rows, each labelled ``prefix + name``."""
    table = {}
    for name, args, *options in collectives:
        table[name] = Collective(name, prefix + name, tuple(args), **(options[0] if options else {}))
    return table


# The torch.distributed functions, called by name with the staged tensors in place of the caller's
# (torch.distributed.distributed_c10d, public also as torch.distributed). Whichever the running torch has are wrapped.
C10D = _entries(
    "torch.distributed.",
    ("all_reduce", [Arg("tensor", BOTH)], {"wire": ELEMENTWISE, "reduces": True}),
    # The source only reads; every other rank only writes.
    ("broadcast", [Arg("tensor", WRITE, root_role=READ)], {"wire": ELEMENTWISE, "root": "src"}),
    # Written on the destination only: the other ranks' tensors stay as they were, as NCCL leaves them (Gloo's
    # own CPU path uses them as scratch).
    ("reduce", [Arg("tensor", READ, root_role=BOTH)], {"wire": ELEMENTWISE, "reduces": True, "root": "dst"}),
    ("all_gather", [Arg("tensor_list", WRITE, LIST, refusal=AUTOGRAD_WRITTEN), Arg("tensor", READ)]),
    ("all_gather_into_tensor", [Arg("output_tensor", WRITE, refusal=AUTOGRAD_WRITTEN), Arg("input_tensor", READ)],
     {"wire": GATHER}),
    ("all_gather_single", [Arg("output_tensor", WRITE, refusal=AUTOGRAD_WRITTEN), Arg("input_tensor", READ)],
     {"wire": GATHER}),
    ("all_gather_coalesced",
     [Arg("output_tensor_lists", WRITE, LISTS, refusal=AUTOGRAD_WRITTEN), Arg("input_tensor_list", READ, LIST)]),
    ("reduce_scatter", [Arg("output", WRITE, refusal=AUTOGRAD_WRITTEN_FIRST), Arg("input_list", READ, LIST)],
     {"reduces": True}),
    ("reduce_scatter_tensor", [Arg("output", WRITE, refusal=AUTOGRAD_WRITTEN), Arg("input", READ)], {"reduces": True}),
    ("reduce_scatter_single", [Arg("output", WRITE, refusal=AUTOGRAD_WRITTEN), Arg("input", READ)], {"reduces": True}),
    ("all_reduce_coalesced", [Arg("tensors", BOTH, LIST, refusal=AUTOGRAD_WRITTEN)], {"reduces": True}),
    ("all_to_all",
     [Arg("output_tensor_list", WRITE, LIST, refusal=AUTOGRAD_WRITTEN), Arg("input_tensor_list", READ, LIST)]),
    ("all_to_all_single", [Arg("output", WRITE), Arg("input", READ, refusal=CONTIGUOUS)]),
    ("gather", [Arg("tensor", READ), Arg("gather_list", NONE, LIST, root_role=WRITE, refusal=AUTOGRAD_WRITTEN)],
     {"root": "dst"}),
    # torch 2.14: each rank's tensor into one tensor on the root (NCCL's ncclGather; Gloo has none), and its
    # deprecated alias. The non-root ranks' gather_tensor is ignored (torch passes an empty tensor there).
    *((name, [Arg("tensor", READ), Arg("gather_tensor", NONE, root_role=WRITE, refusal=AUTOGRAD_WRITTEN)],
       {"root": "dst"}) for name in ("gather_single", "gather_into_tensor")),
    ("scatter", [Arg("tensor", WRITE), Arg("scatter_list", NONE, LIST, root_role=READ)], {"root": "src"}),
    ("send", [Arg("tensor", READ, refusal=CONTIGUOUS_P2P)], {"point_to_point": True}),
    ("isend", [Arg("tensor", READ, refusal=CONTIGUOUS_P2P)], {"point_to_point": True}),
    ("recv", [Arg("tensor", WRITE, refusal=CONTIGUOUS_P2P)], {"point_to_point": True}),
    ("irecv", [Arg("tensor", WRITE, refusal=CONTIGUOUS_P2P)], {"point_to_point": True}),
)
# batch_isend_irecv: its tensors are those of its P2POps, each a send or a receive (torch.distributed.P2POp).
BATCH = Collective("batch_isend_irecv", "torch.distributed.batch_isend_irecv",
                   (Arg("p2p_op_list", BOTH, LIST, refusal=CONTIGUOUS_P2P),), point_to_point=True)

# The collective ops compiled code runs, and the functional collectives and DTensor call, eager or compiled
# (namespace ``_c10d_functional``; DTensor's Shard(i) to Shard(j) all-to-all in ``_dtensor``), by name without the
# overload: called on staged arguments as their schema says. Ops a torch adds are staged whole by their schema (its
# written arguments are the ones it marks mutable).
OPS_NAMESPACES = ("_c10d_functional", "_dtensor")
OPS = _entries(
    "torch.ops._c10d_functional.",
    ("all_reduce", [Arg("input", READ)], {"wire": ELEMENTWISE, "reduces": True, "returns_new": True}),
    ("all_reduce_", [Arg("input", BOTH)], {"wire": ELEMENTWISE, "reduces": True}),
    # The functional broadcast's ``src`` is the source's rank in the group.
    ("broadcast", [Arg("input", READ)], {"wire": ELEMENTWISE, "root": "src", "returns_new": True}),
    ("broadcast_", [Arg("input", WRITE, root_role=READ)], {"wire": ELEMENTWISE, "root": "src"}),
    ("all_gather_into_tensor", [Arg("input", READ)], {"wire": GATHER, "returns_new": True}),
    ("all_gather_into_tensor_out", [Arg("input", READ), Arg("out", WRITE)], {"wire": GATHER}),
    ("reduce_scatter_tensor", [Arg("input", READ)], {"reduces": True, "returns_new": True}),
    ("reduce_scatter_tensor_out", [Arg("input", READ), Arg("out", WRITE)], {"reduces": True}),
    ("all_to_all_single", [Arg("input", READ)], {"returns_new": True}),
    ("all_reduce_coalesced", [Arg("inputs", READ, LIST)], {"reduces": True, "returns_new": True}),
    ("all_reduce_coalesced_", [Arg("inputs", BOTH, LIST)], {"reduces": True}),
    ("all_gather_into_tensor_coalesced", [Arg("inputs", READ, LIST)], {"returns_new": True}),
    ("reduce_scatter_tensor_coalesced", [Arg("inputs", READ, LIST)], {"reduces": True, "returns_new": True}),
    # Point-to-point in compiled code: not staged (a staged receive would wait inside the graph for its send).
    ("isend", [Arg("input", READ)], {"point_to_point": True}),
    ("irecv", [Arg("output", WRITE)], {"point_to_point": True}),
    ("batch_p2p_ops", [Arg("tensors", BOTH, LIST)], {"point_to_point": True}),
)
OPS["shard_dim_alltoall"] = Collective("shard_dim_alltoall", "torch.ops._dtensor.shard_dim_alltoall",
                                       (Arg("input", READ),), returns_new=True)

# The functional collectives' Python functions (torch.distributed._functional_collectives), by the parameter that
# holds their input (a list for the coalesced forms). Their host tensors reach OPS above; these wrappers only stage
# accelerator inputs that the group serves through the host, and the host ones of a list that mixes devices.
FUNCTIONAL_MODULE = "torch.distributed._functional_collectives"
FUNCTIONAL = {
    name: Collective(name, f"{FUNCTIONAL_MODULE}.{name}", (Arg(param, READ, LIST if param == "inputs" else TENSOR),),
                     returns_new=True)
    for name, param in {
        "all_reduce": "self", "broadcast": "self", "all_gather_single": "self", "all_gather_tensor": "self",
        "reduce_scatter_single": "self", "reduce_scatter_tensor": "self", "all_to_all_single": "self",
        "permute_tensor": "self", "all_gather_tensor_autograd": "self", "all_gather_single_autograd": "self",
        "reduce_scatter_tensor_autograd": "self", "reduce_scatter_single_autograd": "self",
        "all_to_all_single_autograd": "self", "all_reduce_coalesced": "self",
        "all_gather_into_tensor_coalesced": "self", "all_gather_single_coalesced": "self",
        "reduce_scatter_tensor_coalesced": "inputs", "reduce_scatter_single_coalesced": "inputs",
    }.items()
}


def op_entry(namespace: str, name: str, schema) -> Collective:
    """The entry of op ``namespace::name``: :data:`OPS`'s, or for an op this table does not know, one staged whole
    from its schema (tensor arguments read; those the schema marks mutable, or an ``out=``, written)."""
    known = OPS.get(name)
    if known is not None:
        return known
    args = []
    for argument in schema.arguments:
        kind = argument.type
        is_list = isinstance(kind, torch.ListType) and isinstance(kind.getElementType(), torch.TensorType)
        if not (isinstance(kind, torch.TensorType) or is_list):
            continue
        written = argument.alias_info is not None and argument.alias_info.is_write
        role = (WRITE if argument.kwarg_only else BOTH) if written else READ
        args.append(Arg(argument.name, role, LIST if is_list else TENSOR))
    return Collective(name, f"torch.ops.{namespace}.{name}", tuple(args),
                      returns_new=not any(a.role != READ for a in args))
