"""One plan per call, the same on every rank, whatever each rank chooses alone: property-based, at 2 and 3 ranks.

A case (one to three calls, each of a table entry, with the sizes, dtype, reduce op and root every rank shares) is
drawn once, in the test process, and handed to every rank; each call also carries each rank's own choices, which
torch lets differ: the entry point (``torch.distributed``, the functional collectives, compiled code, DTensor's
``full_tensor`` with or without ``grad_placements``, ``src`` or ``group_src``), ``async_op``, contiguity,
``requires_grad``, the order its handles are waited in, and the sizes torch lets differ (an uneven list gather's,
all-to-all splits). Every rank stages every call (forced through the CPU, ``always_stage``) on a group of a
recording backend (tests/recording.py: Gloo underneath, recording what reaches it, below the shim and below
torch's Python functions), at a chunk size drawn for the case, so that some calls are chunked. Then:

* every rank recorded the same sequence of collectives: kind, order, and every size torch requires equal;
* every result equals torch's own call on the same group (unstaged), bit for bit: the values are small integers,
  so that a sum is exact in any order and any chunking.

Every ``torch.distributed`` entry of the table is drawn, and the ``torch.ops`` collectives the functional
collectives, DTensor and compiled code reach (their in-place forms too); not the ops only compiled code of in-place
calls reaches (``all_reduce_``, ``broadcast_``, the ``_out`` forms), nor DTensor's all-to-all op. The number of
cases run is printed at the end of the run. Compiled entry points are compiled once per entry and
rank process (dynamic shapes) and reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import zlib

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import contracts
import offload_shim
import recording
from bitwise import same_bits
from observe import configured

# Entry points each collective can be reached by: what one rank may use while its peers use another.
ENTRIES = {
    "all_reduce": ["eager", "eager_async", "funcol", "funcol_inplace", "compiled"],
    "broadcast": ["eager_src", "eager_group_src", "eager_async", "funcol"],
    "reduce": ["eager", "eager_group_dst", "eager_async"],
    "all_gather_into_tensor": ["eager", "eager_single", "eager_async", "funcol", "funcol_inplace", "compiled",
                               "full_tensor", "full_tensor_grad_placements"],
    "reduce_scatter_tensor": ["eager", "eager_single", "eager_async", "funcol", "funcol_inplace"],  # (see below)
    "reduce_scatter": ["eager", "eager_async"],
    "all_reduce_coalesced": ["eager", "eager_async", "funcol"],
    "all_gather_coalesced": ["eager", "eager_async"],
    # The functional coalesced forms are collectives of their own (Gloo runs all_gather_coalesced as one gather of
    # the flattened list, all_gather_into_tensor_coalesced as one per tensor): their ranks all call them.
    "all_gather_into_tensor_coalesced": ["funcol"],
    "reduce_scatter_tensor_coalesced": ["funcol"],
    "all_gather": ["eager", "eager_async"],
    "all_to_all_single": ["eager", "eager_async", "funcol", "funcol_inplace"],  # splits per rank
    "all_to_all": ["eager", "eager_async"],  # lists (of one size: Gloo's list all-to-all takes one)
    "gather": ["eager", "eager_async"],
    "gather_single": ["eager", "eager_async", "eager_alias"],  # torch 2.14 (the alias: gather_into_tensor)
    "scatter": ["eager", "eager_async"],
    "send_recv": ["blocking", "isend_irecv", "batch"],
}
# torch 2.11 has neither all_gather_single nor reduce_scatter_single.
for _name, _function in (("all_gather_into_tensor", "all_gather_single"), ("reduce_scatter_tensor", "reduce_scatter_single")):
    if not hasattr(dist, _function):
        ENTRIES[_name].remove("eager_single")
if not hasattr(dist, "gather_single"):  # before torch 2.14
    del ENTRIES["gather_single"]
if not contracts.GLOO_ALL_TO_ALL:  # torch 2.11's Gloo has no list all_to_all
    del ENTRIES["all_to_all"]
# Where torch takes any strides and a tensor that requires grad (an input only read, or written in place from C++).
STRIDED = {"all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather",
           "gather", "scatter"}
GRAD = {"all_reduce", "broadcast", "all_gather_into_tensor", "all_gather"}
DTYPES = ["float32", "bfloat16", "int32", "int64", "uint8"]
OPS = ["SUM", "MAX", "MIN"]
CHUNKS = [16, 64, 1 << 20]  # bytes: 16 and 64 chunk most calls here, 1 MiB none
EXAMPLES = {2: 420, 3: 130}  # at least 500 in every CI run; the run prints the total


@dataclasses.dataclass(frozen=True)
class Choice:
    """What one rank chooses alone for a call."""

    entry: str
    contiguous: bool = True
    requires_grad: bool = False


@dataclasses.dataclass(frozen=True)
class Call:
    collective: str
    dtype: str
    numel: int  # every rank's size, where torch requires one size
    op: str
    root: int
    seed: int
    choices: tuple  # one Choice per rank
    sizes: tuple = ()  # all_to_all_single: splits[i][j], what rank i sends to rank j (Gloo's list gathers take one size)


def calls(world: int):
    @st.composite
    def call(draw):
        collective = draw(st.sampled_from(sorted(ENTRIES)))
        choices = []
        for _ in range(world):
            entry = draw(st.sampled_from(ENTRIES[collective]))
            contiguous = collective not in STRIDED or draw(st.booleans())
            if (collective == "all_gather_into_tensor" and entry in ("funcol", "funcol_inplace", "compiled")
                    and not contracts.GATHERS_STRIDED):
                contiguous = True  # torch 2.11's funcol.all_gather_tensor (the in-place form too) asserts contiguity
            grad = collective in GRAD and not entry.startswith("funcol") and entry != "compiled" and draw(st.booleans())
            choices.append(Choice(entry, contiguous, grad))
        sizes = ()
        if collective == "all_to_all_single":
            row = st.lists(st.integers(0, 4), min_size=world, max_size=world).map(tuple)
            sizes = tuple(draw(st.lists(row, min_size=world, max_size=world)))
        return Call(collective, draw(st.sampled_from(DTYPES)), draw(st.integers(0, 40)), draw(st.sampled_from(OPS)),
                    draw(st.integers(0, world - 1)), draw(st.integers(0, 2**16)), tuple(choices), sizes)

    return call()


def cases(world: int):
    """``(calls, chunk_bytes, wait orders)``: one to three calls, the chunk size every rank sets, and each rank's
    order of waiting for its handles."""
    return st.lists(calls(world), min_size=1, max_size=3).flatmap(lambda cs: st.tuples(
        st.just(cs), st.sampled_from(CHUNKS),
        st.lists(st.permutations(range(len(cs))), min_size=world, max_size=world)))


# ---------------------------------------------------------------- inside the ranks

_group: list = []  # this rank process's recording group
_compiled: dict = {}  # entry -> compiled function, made once


def _recording_group():
    if not _group:
        _group.append(recording.new_group())
    return _group[0]


def _values(call: Call, shape, key) -> torch.Tensor:
    """Small integers (exact sums in any order), the same on every rank for one key and rank."""
    generator = torch.Generator().manual_seed(zlib.crc32(repr((call.seed, key)).encode()))
    low = 0 if call.dtype == "uint8" else -4
    return torch.randint(low, 5, shape, generator=generator).to(getattr(torch, call.dtype))


def _tensor(values: torch.Tensor, choice: Choice) -> torch.Tensor:
    """``values`` as this rank holds them: contiguous or a stepped view of a larger buffer; a leaf that requires
    grad where the rank chose one (floating dtypes only)."""
    tensor = values.clone()
    if not choice.contiguous:
        base = torch.zeros(2 * values.numel() + 1, dtype=values.dtype)
        tensor = base[1::2][: values.numel()].view(values.shape)
        tensor.copy_(values)
    if choice.requires_grad and values.dtype.is_floating_point:
        tensor.requires_grad_()
    return tensor


def _compile(name, function):
    if name not in _compiled:
        # One compiled function per entry, called with every dtype and layout the cases draw: each a recompile (its
        # guards hold dtype and strides), past Dynamo's default limit of 8 in a long run, where fullgraph=True raises.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _compiled[name] = torch.compile(function, backend="eager", dynamic=True, fullgraph=True)
    return _compiled[name]


def _reduce_op(call: Call):
    return getattr(dist.ReduceOp, call.op)


def _launch(call: Call, choice: Choice, group, reference: bool):
    """Run ``call`` as this rank chose (``reference``: torch's plain synchronous call instead). Returns
    ``(handle or None, results)``: the tensors to compare once waited (outputs, or a functional call's result)."""
    rank, world = group.rank(), group.size()
    entry = "eager" if reference else choice.entry
    asynchronous = entry == "eager_async"
    make = (lambda values: values.clone()) if reference else (lambda values: _tensor(values, choice))
    shape = (call.numel,)
    op = _reduce_op(call)
    name = call.collective
    mine = _values(call, shape, ("input", rank))
    if name == "all_reduce":
        tensor = make(mine)
        if entry == "funcol":
            return None, [funcol.all_reduce(tensor, call.op.lower(), group)]
        if entry == "funcol_inplace":
            with torch.no_grad() if tensor.requires_grad else contextlib.nullcontext():
                return None, [funcol.all_reduce_inplace(tensor, call.op.lower(), group)]
        if entry == "compiled":
            return None, [_compile("all_reduce_" + call.op, lambda t, g, o=call.op.lower(): funcol.all_reduce(t, o, g))(
                tensor, group)]
        with torch.no_grad() if tensor.requires_grad else contextlib.nullcontext():
            return dist.all_reduce(tensor, op=op, group=group, async_op=asynchronous), [tensor]
    if name == "broadcast":
        tensor = make(mine)
        global_root = dist.get_global_rank(group, call.root)
        if entry == "funcol":
            return None, [funcol.broadcast(tensor, call.root, group)]
        if entry == "eager_group_src":
            return dist.broadcast(tensor, group_src=call.root, group=group), [tensor]
        return dist.broadcast(tensor, src=global_root, group=group, async_op=asynchronous), [tensor]
    if name == "reduce":
        tensor = make(mine)
        if entry == "eager_group_dst":
            work = dist.reduce(tensor, group_dst=call.root, op=op, group=group)
        else:
            work = dist.reduce(tensor, dst=dist.get_global_rank(group, call.root), op=op, group=group,
                               async_op=asynchronous)
        return work, [tensor] if rank == call.root else []  # (the others' tensors are the backend's scratch)
    if name == "all_gather_into_tensor":
        tensor = make(mine)
        if entry == "funcol":
            return None, [funcol.all_gather_tensor(tensor, 0, group)]
        if entry == "compiled":
            return None, [_compile("all_gather", lambda t, g: funcol.all_gather_tensor(t, 0, g))(tensor, group)]
        if entry.startswith("full_tensor"):
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.tensor import DTensor, Replicate, Shard

            mesh = DeviceMesh.from_group(group, "cpu")
            sharded = DTensor.from_local(tensor, mesh, [Shard(0)], run_check=False)
            kwargs = {"grad_placements": [Replicate()]} if entry.endswith("grad_placements") else {}
            return None, [sharded.full_tensor(**kwargs)]
        out = torch.empty(world * call.numel, dtype=mine.dtype)
        if entry == "funcol_inplace":
            return None, [funcol.all_gather_tensor_inplace(out, tensor, group)]
        function = dist.all_gather_single if entry == "eager_single" else dist.all_gather_into_tensor
        return function(out, tensor, group=group, async_op=asynchronous), [out]
    if name == "reduce_scatter_tensor":
        tensor = make(_values(call, (world * call.numel,), ("input", rank)))
        if entry == "funcol":
            return None, [funcol.reduce_scatter_tensor(tensor, call.op.lower(), 0, group)]
        out = torch.empty(call.numel, dtype=mine.dtype)
        if entry == "funcol_inplace":
            return None, [funcol.reduce_scatter_tensor_inplace(out, tensor, call.op.lower(), group)]
        function = dist.reduce_scatter_single if entry == "eager_single" else dist.reduce_scatter_tensor
        return function(out, tensor, op=op, group=group, async_op=asynchronous), [out]
    if name == "reduce_scatter":
        ins = [make(_values(call, shape, ("input", rank, r))) for r in range(world)]
        out = torch.empty(call.numel, dtype=mine.dtype)
        return dist.reduce_scatter(out, ins, op=op, group=group, async_op=asynchronous), [out]
    if name == "all_gather_into_tensor_coalesced":
        return None, funcol.all_gather_into_tensor_coalesced([make(mine), make(_values(call, (3,), ("second", rank)))],
                                                             group)
    if name == "all_gather_coalesced":
        ins = [make(mine), make(_values(call, (3,), ("second", rank)))]
        outs = [[torch.empty(t.shape, dtype=t.dtype) for t in ins] for _ in range(world)]  # [rank][input]
        work = dist.all_gather_coalesced(outs, ins, group=group, async_op=asynchronous)
        return work, [t for each in outs for t in each]
    if name == "reduce_scatter_tensor_coalesced":
        ins = [make(_values(call, (world * call.numel,), ("input", rank))), make(_values(call, (world * 2,), ("second", rank)))]
        return None, funcol.reduce_scatter_tensor_coalesced(ins, call.op.lower(), [0, 0], group)
    if name == "all_reduce_coalesced":
        tensors = [make(mine), make(_values(call, (3,), ("second", rank)))]
        if entry == "funcol":
            return None, funcol.all_reduce_coalesced(tensors, call.op.lower(), group)
        return dist.all_reduce_coalesced(tensors, op=op, group=group, async_op=asynchronous), tensors
    if name == "all_gather":
        tensor = make(mine)
        outs = [torch.empty(call.numel, dtype=mine.dtype) for _ in range(world)]
        return dist.all_gather(outs, tensor, group=group, async_op=asynchronous), outs
    if name == "all_to_all_single":
        send, receive = list(call.sizes[rank]), [call.sizes[r][rank] for r in range(world)]
        tensor = make(_values(call, (sum(send),), ("input", rank)))
        if entry == "funcol":
            return None, [funcol.all_to_all_single(tensor, receive, send, group)]
        out = torch.empty(sum(receive), dtype=mine.dtype)
        if entry == "funcol_inplace":
            return None, [funcol.all_to_all_inplace(out, tensor, receive, send, group)]
        return dist.all_to_all_single(out, tensor, receive, send, group=group, async_op=asynchronous), [out]
    if name == "all_to_all":
        ins = [make(_values(call, shape, ("input", rank, r))) for r in range(world)]
        outs = [torch.empty(call.numel, dtype=mine.dtype) for _ in range(world)]
        return dist.all_to_all(outs, ins, group=group, async_op=asynchronous), outs
    if name == "gather":
        tensor = make(mine)
        outs = [torch.empty(call.numel, dtype=mine.dtype) for _ in range(world)] if rank == call.root else None
        work = dist.gather(tensor, outs, group_dst=call.root, group=group, async_op=asynchronous)
        return work, outs or []
    if name == "gather_single":
        tensor = make(mine)
        out = torch.empty(world * call.numel, dtype=mine.dtype) if rank == call.root else None
        gather = dist.gather_single
        if entry == "eager_alias":
            gather = dist.gather_into_tensor
            warnings.filterwarnings("ignore", "`torch.distributed.gather_into_tensor` is deprecated", FutureWarning)
        work = gather(tensor, out, group_dst=call.root, group=group, async_op=asynchronous)
        return work, [out] if out is not None else []
    if name == "scatter":
        ins = [make(_values(call, shape, ("input", r))) for r in range(world)] if rank == call.root else None
        out = torch.empty(call.numel, dtype=mine.dtype)
        return dist.scatter(out, ins, group_src=call.root, group=group, async_op=asynchronous), [out]
    # send_recv: a ring, each rank sending to the next and receiving from the previous
    to, frm = (rank + 1) % world, (rank - 1) % world
    send, receive = make(mine), torch.empty(call.numel, dtype=mine.dtype)
    if entry == "batch":
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, group_peer=to, group=group),
                                        dist.P2POp(dist.irecv, receive, group_peer=frm, group=group)])
        return contracts._Both(works), [receive]
    if entry == "isend_irecv":
        return contracts._Both([dist.isend(send, group_dst=to, group=group), dist.irecv(receive, group_src=frm, group=group)]), [receive]
    if rank % 2 == 0:
        dist.send(send, group_dst=to, group=group)
        dist.recv(receive, group_src=frm, group=group)
    else:
        dist.recv(receive, group_src=frm, group=group)
        dist.send(send, group_dst=to, group=group)
    return None, [receive]


def _plain(result) -> torch.Tensor:
    if isinstance(result, funcol.AsyncCollectiveTensor):
        result = funcol.wait_tensor(result)
    return result.detach()


def check_wire(case_calls, chunk_bytes, orders):
    """Run one case in this rank (see the module docstring); returns what the recording group recorded of the
    staged calls, for the test to compare across ranks."""
    offload_shim.install()
    group = _recording_group()
    rank = group.rank()
    with configured(always_stage=False):
        references = []
        for call in case_calls:
            work, results = _launch(call, call.choices[rank], group, reference=True)
            if work is not None:
                work.wait()
            references.append([_plain(r).clone() for r in results])
    recording.take(group)
    with configured(staging_device="cpu", always_stage=True, chunk_bytes=chunk_bytes):
        launched = [_launch(call, call.choices[rank], group, reference=False) for call in case_calls]
        for index in orders[rank]:
            work = launched[index][0]
            if work is not None:
                work.wait()
    records = recording.take(group)
    for call, want, (_, got) in zip(case_calls, references, launched):
        assert len(got) == len(want), call
        for g, w in zip(got, want):
            assert same_bits(_plain(g), w), (call, rank, _plain(g), w)
    return records


# ---------------------------------------------------------------- the tests


def _run(pool, case, record_property):
    case_calls, chunk_bytes, orders = case
    records = pool.run(check_wire, case_calls, chunk_bytes, [list(order) for order in orders])
    assert all(r == records[0] for r in records), "\n".join(f"rank {i}: {r}" for i, r in enumerate(records))
    record_property("wire_case", (pool.world_size, len(records[0])))


SETTINGS = dict(deadline=None, database=None, suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])


@hypothesis.seed(20261202)
@hypothesis.settings(max_examples=EXAMPLES[2], **SETTINGS)
@hypothesis.given(case=cases(2))
def test_every_rank_sends_the_same_collectives_two_ranks(gloo_ranks, record_property, case):
    _run(gloo_ranks, case, record_property)


@hypothesis.seed(20261202)
@hypothesis.settings(max_examples=EXAMPLES[3], **SETTINGS)
@hypothesis.given(case=cases(3))
def test_every_rank_sends_the_same_collectives_three_ranks(three_gloo_ranks, record_property, case):
    _run(three_gloo_ranks, case, record_property)
