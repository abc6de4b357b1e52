"""The equality contract, checked call by call inside the ranks of a process group (CPU and GPU tests share it).

A generated case is a list of calls (one collective each, with its dtype, shape, layout, reduce op, root,
split sizes and whether it is asynchronous) and an order in which the asynchronous ones are waited. In every
rank, :func:`check_case` builds the caller's tensors on the CPU (in the case's layout, inside a larger buffer
where the layout is a view) and the same values, contiguous, on the reference device, then:

* reference: each call on the reference device, untouched by the shim (on CPU ranks, Gloo on CPU tensors; on
  GPU ranks, the backend on GPU copies: what a user would write by hand);
* staged: the same calls on the caller's CPU tensors, every one staged (on CPU ranks forced through the CPU
  with ``configure(staging_device="cpu", always_stage=True)``; on GPU ranks the group serves no CPU), the
  asynchronous ones waited late, in the case's order;

and asserts, bit for bit, that every tensor the calls touched (inputs and outputs) holds what the reference's
holds, that the rest of each view's buffer is unchanged, that results land in the caller's own objects on the
CPU, and that a call torch refuses is refused staged too, with the same exception type and nothing written
(even where torch's own path writes part of an output before it raises, as Gloo's list ``reduce_scatter`` does).
These calls are staged whole (the default chunk is far above their sizes), so bitwise equality holds at any
number of ranks. On GPU ranks a case may also keep some of a call's tensors on the accelerator (mixed devices):
only the host ones are staged, and every result lands on its own tensor's device.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import hypothesis.strategies as st
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import offload_shim
from bitwise import same_bits
from observe import recording_staging

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "int32", "int64", "uint8", "bool"]
REDUCE_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR", "PREMUL_SUM"]
FUNCTIONAL_REDUCE_OPS = ["sum", "avg", "product", "min", "max"]
LAYOUTS = ["contiguous", "offset", "stepped", "transposed", "channels_last"]
# What torch 2.11 lacks: Gloo's list all_to_all, and funcol.all_gather_tensor of a strided tensor (2.12 has both)
GLOO_ALL_TO_ALL = GATHERS_STRIDED = torch.__version__ >= (2, 12)
# The collectives, by the name a case uses. "*_async" forms are chosen through the case's async flag.
C10D = [
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_uneven", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", *(["all_to_all"] if GLOO_ALL_TO_ALL else []), "all_to_all_single",
    "gather", "scatter",
    "send_recv", "batch_isend_irecv", "all_reduce_coalesced", "all_gather_coalesced",
    *(name for name in ("all_gather_single", "reduce_scatter_single") if hasattr(dist, name)),  # torch 2.13's names
]
FUNCTIONAL = [
    "funcol.all_reduce", "funcol.broadcast", "funcol.all_gather_tensor", "funcol.reduce_scatter_tensor",
    "funcol.all_to_all_single", "funcol.permute_tensor", "funcol.all_reduce_coalesced",
    "funcol.all_gather_into_tensor_coalesced", "funcol.reduce_scatter_tensor_coalesced",
    "funcol.all_gather_tensor_autograd", "funcol.reduce_scatter_tensor_autograd", "funcol.all_to_all_single_autograd",
]
OPS = C10D + FUNCTIONAL
REDUCING = {"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
            "all_reduce_coalesced", "funcol.all_reduce", "funcol.reduce_scatter_tensor", "funcol.all_reduce_coalesced",
            "funcol.reduce_scatter_tensor_coalesced", "funcol.reduce_scatter_tensor_autograd"}
# What the cases do not call, and why: the report lists it beside the count.
NOT_IN_CONTRACT = {
    "isend, irecv": "called by send_recv with async_op (a ring of isend and irecv)",
    "funcol.all_gather_single, reduce_scatter_single and their _autograd and _coalesced forms":
        "torch 2.13's names of all_gather_tensor and reduce_scatter_tensor at dim 0, one code path in the shim",
    "PREMUL_SUM with funcol": "it needs a factor that the string form of a reduce op cannot carry",
}
# Staged through the pipeline when a case gives a chunk size (0: the default, far above these sizes: staged whole).
CHUNKED = {"all_reduce", "broadcast", "reduce"}
# 0-dim tensors allowed (torch 2.13's permute_tensor of a 0-dim tensor crashes the process, shim or not)
SHAPE_FREE = {"all_reduce", "broadcast", "reduce", "send_recv", "batch_isend_irecv", "funcol.all_reduce",
              "funcol.broadcast", "funcol.all_reduce_coalesced", "all_reduce_coalesced"}


@dataclasses.dataclass(frozen=True)
class Call:
    op: str
    dtype: str
    shape: tuple
    layout: str
    reduce: str
    root: int
    async_op: bool
    seed: int
    splits: tuple = ()  # all_to_all_single: rows rank i sends to rank j, splits[i][j]; all_gather_uneven: rows
    placement: int = 0  # bit i set: the call's i-th tensor is on the accelerator (mixed devices; GPU runs only)
    chunk: int = 0  # bytes: all_reduce, broadcast and reduce staged through the pipeline in chunks this size
    nan: bool = False  # some floating inputs are NaN (about one in five, at other positions on each rank)


def calls(world_size: int):
    """Hypothesis strategy: one :class:`Call` for ``world_size`` ranks."""

    @st.composite
    def call(draw):
        op = draw(st.sampled_from(OPS))
        if op in SHAPE_FREE:
            shape = tuple(draw(st.lists(st.integers(0, 7), max_size=4)))
        else:
            shape = (draw(st.integers(0, 5)), *draw(st.lists(st.integers(1, 4), max_size=3)))
        layout = draw(st.sampled_from(LAYOUTS))
        if layout == "transposed" and len(shape) < 2 or layout == "channels_last" and len(shape) != 4:
            layout = "offset"
        if op == "funcol.all_gather_tensor" and not GATHERS_STRIDED:
            layout = "contiguous"  # torch 2.11 asserts contiguity there, on the caller's rank only
        if op == "all_to_all_single" and layout != "contiguous":
            # torch refuses a non-contiguous input (ValueError), on the ranks whose input has two or more elements
            # only: the others would wait in the collective. test_torch_semantics_cpu checks the refusal.
            layout = "offset"
        splits = ()
        if op in ("all_to_all_single", "funcol.all_to_all_single", "funcol.all_to_all_single_autograd"):
            row = st.lists(st.integers(0, 3), min_size=world_size, max_size=world_size).map(tuple)
            splits = tuple(draw(st.lists(row, min_size=world_size, max_size=world_size)))
        elif op == "all_gather_uneven":
            splits = tuple(draw(st.lists(st.integers(0, 4), min_size=world_size, max_size=world_size)))
        functional = op.startswith("funcol.")
        dtype = draw(st.sampled_from(DTYPES))
        chunk = 0
        if op in CHUNKED and draw(st.booleans()):  # pipelined in 2 to 6 chunks (the last one may be short)
            nbytes = math.prod(shape) * getattr(torch, dtype).itemsize
            chunk = max(16, -(-nbytes // draw(st.integers(2, 6))))
        return Call(
            op=op,
            dtype=dtype,
            shape=shape,
            layout=layout,
            reduce=draw(st.sampled_from(FUNCTIONAL_REDUCE_OPS if functional else REDUCE_OPS)),
            root=draw(st.integers(0, world_size - 1)),
            async_op=not functional and draw(st.booleans()),
            seed=draw(st.integers(0, 2**20)),
            splits=splits,
            placement=draw(st.sampled_from([0, 0, draw(st.integers(0, 255))])),
            chunk=chunk,
            nan=dtype.startswith(("float", "bfloat")) and op in REDUCING and draw(st.booleans()),
        )

    return call()


def cases(world_size: int):
    """Hypothesis strategy: ``(calls, wait_order)``, one to three calls and a permutation of them."""
    return st.lists(calls(world_size), min_size=1, max_size=3).flatmap(
        lambda cs: st.tuples(st.just(cs), st.permutations(range(len(cs))))
    )


# ---------------------------------------------------------------- tensors


def _values(shape, dtype, key, nan=False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    if dtype.is_floating_point:
        values = torch.randn(shape, generator=generator, dtype=torch.float64).mul_(3)
        if nan:
            values[torch.rand(shape, generator=generator, dtype=torch.float64) < 0.2] = float("nan")
        return values.to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    low, high = (0, 8) if dtype == torch.uint8 else (-8, 8)
    return torch.randint(low, high, shape, generator=generator).to(dtype)


def _sentinel(n, dtype) -> torch.Tensor:
    return torch.full((n,), True if dtype == torch.bool else 77, dtype=dtype)


@dataclasses.dataclass
class _Host:
    tensor: torch.Tensor
    base: torch.Tensor  # the buffer the tensor is a view of
    outside: torch.Tensor  # mask of the base's elements outside the view
    pointer: int
    initial: torch.Tensor  # the values it was made with


def _host(values: torch.Tensor, layout: str) -> _Host:
    """The caller's CPU tensor holding ``values``, in ``layout``: contiguous; a view at an offset; a stepped
    (non-dense) view; transposed; channels_last."""
    n, dtype, shape = values.numel(), values.dtype, values.shape
    if layout == "offset":
        base = _sentinel(n + 5, dtype)
        tensor = base[3 : 3 + n].view(shape)
    elif layout == "stepped":
        base = _sentinel(2 * n + 1, dtype)
        tensor = base[1::2][:n].view(shape) if n else base[:0].view(shape)
    elif layout == "transposed":
        flipped = (*shape[:-2], shape[-1], shape[-2])
        base = _sentinel(n, dtype).view(flipped)
        tensor = base.transpose(-1, -2)
    elif layout == "channels_last":
        tensor = torch.empty(shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
        base = tensor
    else:
        tensor = values.clone()
        base = tensor
    tensor.copy_(values)
    outside = torch.ones(base.numel(), dtype=torch.bool)
    positions = torch.as_strided(torch.arange(base.numel()), tensor.shape, tensor.stride(), tensor.storage_offset())
    outside[positions.reshape(-1)] = False
    return _Host(tensor, base, outside, tensor.data_ptr(), values)


class _Tensors:
    """Makes a call's tensors: the caller's on the CPU (``host=True``) or contiguous ones on ``device``, with
    the same values either way (generated from the call's seed, this rank and a per-tensor key)."""

    def __init__(self, call: Call, device, host: bool):
        self.call, self.device, self.host = call, device, host
        self.dtype = getattr(torch, call.dtype)
        self.made: list = []  # in order of making: _Host or device tensor

    def __call__(self, shape, key) -> torch.Tensor:
        values = _values(tuple(shape), self.dtype, (self.call.seed, dist.get_rank(), key), self.call.nan)
        index = len(self.made)
        # On the accelerator contiguous, as the backends and the functional collectives take it: a channels_last
        # tensor of a rank whose tensor is empty passes their checks, where its peers' fail, and the ranks hang.
        on_device = values
        if self.host and self.device.type != "cpu" and self.call.placement >> index & 1:
            self.made.append(on_device.to(self.device))  # this one the caller keeps on the accelerator
            return self.made[-1]
        if self.host:
            layout = self.call.layout
            if layout == "transposed" and len(shape) < 2 or layout == "channels_last" and len(shape) != 4:
                layout = "offset"
            made = _host(values, layout)
            self.made.append(made)
            return made.tensor
        tensor = on_device.to(self.device)
        self.made.append(tensor)
        return tensor

    def tensors(self) -> list[torch.Tensor]:
        return [m.tensor if isinstance(m, _Host) else m for m in self.made]

    def hosts(self) -> list[_Host]:
        return [m for m in self.made if isinstance(m, _Host)]


# ---------------------------------------------------------------- the calls


def _reduce_op(name):
    if name == "PREMUL_SUM":  # a sum after multiplying by a factor; NCCL only
        return dist._make_nccl_premul_sum(2.0)
    return getattr(dist.ReduceOp, name)


def _launch(call: Call, make: _Tensors, async_op: bool):
    """Build ``call``'s arguments with ``make`` and start it. Returns ``(work or None, results)``: ``results`` are
    the tensors a functional collective returned (waited), else ``[]``."""
    W, rank, shape = dist.get_world_size(), dist.get_rank(), call.shape
    rest = shape[1:]
    op = call.op
    if op == "all_reduce":
        return dist.all_reduce(make(shape, 0), op=_reduce_op(call.reduce), async_op=async_op), []
    if op == "broadcast":
        return dist.broadcast(make(shape, 0), src=call.root, async_op=async_op), []
    if op == "reduce":
        return dist.reduce(make(shape, 0), dst=call.root, op=_reduce_op(call.reduce), async_op=async_op), []
    if op == "all_gather":
        return dist.all_gather([make(shape, ("out", i)) for i in range(W)], make(shape, 0), async_op=async_op), []
    if op == "all_gather_uneven":
        outputs = [make((call.splits[i], *rest), ("out", i)) for i in range(W)]
        return dist.all_gather(outputs, make((call.splits[rank], *rest), 0), None, async_op), []
    if op in ("all_gather_into_tensor", "all_gather_single"):
        out = make((W * shape[0], *rest), "out")
        return getattr(dist, op)(out, make(shape, 0), async_op=async_op), []
    if op == "reduce_scatter_single":
        out = make(shape, "out")
        return dist.reduce_scatter_single(out, make((W * shape[0], *rest), 0), _reduce_op(call.reduce), None, async_op), []
    if op == "all_reduce_coalesced":
        tensors = [make(shape, 0), make(shape[::-1], 1)]
        return dist.all_reduce_coalesced(tensors, _reduce_op(call.reduce), async_op=async_op), []
    if op == "all_gather_coalesced":
        outputs = [[make(shape, ("out", j, i)) for i in range(W)] for j in range(2)]
        return dist.all_gather_coalesced(outputs, [make(shape, 0), make(shape, 1)], async_op=async_op), []
    if op == "reduce_scatter":
        inputs = [make(shape, i) for i in range(W)]
        return dist.reduce_scatter(make(shape, "out"), inputs, op=_reduce_op(call.reduce), async_op=async_op), []
    if op == "reduce_scatter_tensor":
        out = make(shape, "out")
        return dist.reduce_scatter_tensor(out, make((W * shape[0], *rest), 0), _reduce_op(call.reduce), None, async_op), []
    if op == "all_to_all":
        outputs = [make(shape, ("out", i)) for i in range(W)]
        return dist.all_to_all(outputs, [make(shape, i) for i in range(W)], async_op=async_op), []
    if op == "all_to_all_single":
        send, receive = list(call.splits[rank]), [call.splits[i][rank] for i in range(W)]
        out = make((sum(receive), *rest), "out")
        return dist.all_to_all_single(out, make((sum(send), *rest), 0), receive, send, async_op=async_op), []
    if op == "gather":
        outputs = [make(shape, ("out", i)) for i in range(W)] if rank == call.root else None
        return dist.gather(make(shape, 0), outputs, call.root, async_op=async_op), []
    if op == "scatter":
        inputs = [make(shape, i) for i in range(W)] if rank == call.root else None
        return dist.scatter(make(shape, "out"), inputs, call.root, async_op=async_op), []
    if op == "send_recv":  # a ring: each rank sends to the next, receives from the previous
        to, frm = (rank + 1) % W, (rank - 1) % W
        send, receive = make(shape, 0), make(shape, "out")
        if async_op:
            works = [dist.isend(send, to), dist.irecv(receive, frm)]
            return _Both(works), []
        if rank == 0:
            dist.send(send, to)
            assert dist.recv(receive, frm) == frm
        else:
            assert dist.recv(receive, frm) == frm
            dist.send(send, to)
        return None, []
    if op == "batch_isend_irecv":
        to, frm = (rank + 1) % W, (rank - 1) % W
        ops = [dist.P2POp(dist.isend, make(shape, 0), to), dist.P2POp(dist.irecv, make(shape, "out"), frm)]
        works = dist.batch_isend_irecv(ops)
        if async_op:
            return _Both(works), []
        for work in works:
            work.wait()
        return None, []
    group = dist.group.WORLD
    reduce = call.reduce
    if op == "funcol.all_reduce":
        return None, [funcol.all_reduce(make(shape, 0), reduce, group)]
    if op == "funcol.broadcast":
        return None, [funcol.broadcast(make(shape, 0), call.root, group)]
    function = getattr(funcol, op.removeprefix("funcol."), None)  # a plain form and its _autograd twin alike
    if op in ("funcol.all_gather_tensor", "funcol.all_gather_tensor_autograd"):
        return None, [function(make(shape, 0), 0, group)]
    if op in ("funcol.reduce_scatter_tensor", "funcol.reduce_scatter_tensor_autograd"):
        return None, [function(make((W * shape[0], *rest), 0), reduce, 0, group)]
    if op in ("funcol.all_to_all_single", "funcol.all_to_all_single_autograd"):
        send, receive = list(call.splits[rank]), [call.splits[i][rank] for i in range(W)]
        return None, [function(make((sum(send), *rest), 0), receive, send, group)]
    if op == "funcol.permute_tensor":
        return None, [funcol.permute_tensor(make(shape, 0), [(r + 1) % W for r in range(W)], group)]
    if op == "funcol.all_reduce_coalesced":
        return None, funcol.all_reduce_coalesced([make(shape, 0), make(shape[::-1], 1)], reduce, group)
    if op == "funcol.all_gather_into_tensor_coalesced":
        return None, funcol.all_gather_into_tensor_coalesced([make(shape, 0), make(shape, 1)], group)
    if op == "funcol.reduce_scatter_tensor_coalesced":
        inputs = [make((W * shape[0], *rest), 0), make((W * shape[0], *rest), 1)]
        return None, funcol.reduce_scatter_tensor_coalesced(inputs, reduce, [0, 0], group)
    raise AssertionError(op)


class _Both:
    """Two or more work handles waited as one."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for work in self.works:
            work.wait()
        return True


def _wait(work):
    if work is not None:
        work.wait()


def _finish(results):
    return [funcol.wait_tensor(r) if isinstance(r, funcol.AsyncCollectiveTensor) else r for r in results]


# ---------------------------------------------------------------- the check


def _reference_device(reference: str) -> torch.device:
    if reference == "cpu":
        return torch.device("cpu")
    return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())


def _layout_refusal(call: Call) -> Exception | None:
    """What torch refuses of the caller's own tensors that the reference, on contiguous copies, cannot show:
    Gloo's point-to-point takes contiguous tensors only (every rank's are alike here, so every rank refuses)."""
    if call.op not in ("send_recv", "batch_isend_irecv"):
        return None
    values = torch.zeros(call.shape, dtype=getattr(torch, call.dtype))
    if _host(values, call.layout).tensor.is_contiguous():
        return None
    return RuntimeError("input tensor has to be contiguous")


def _error_of(function):
    try:
        function()
    except Exception as exc:  # torch refuses the call: the staged call must refuse it alike
        return exc
    return None


def _order_may_differ(call: Call) -> bool:
    """Whether the contract allows ``call``'s result to differ from the reference's within a bound: a pipelined
    floating reduction whose result depends on the order the backend combines the ranks' values in, which depends
    on how the buffer is split (SUM, AVG, PRODUCT and PREMUL_SUM on three ranks or more; MIN and MAX with NaN,
    where the backend's max is not symmetric in NaN)."""
    if not call.chunk or call.op not in ("all_reduce", "reduce") or not getattr(torch, call.dtype).is_floating_point:
        return False
    if call.reduce in ("MIN", "MAX"):
        return call.nan
    return dist.get_world_size() >= 3 and call.reduce in ("SUM", "AVG", "PRODUCT", "PREMUL_SUM")


def _within_reordering_bound(call: Call, got: torch.Tensor, want: torch.Tensor) -> bool:
    """The contract's bound, from every rank's inputs (regenerated here): where no input is NaN, MIN and MAX are
    bitwise equal, and a sum or product of W values differs from the reference's by at most 2 (W - 1) u times the
    sum of their magnitudes (the magnitude of the product), u the dtype's unit roundoff: both are roundings of the
    same exact value in some order. Where an input is NaN, a sum or product is NaN as the reference's, and MIN or
    MAX is one of the ranks' values there."""
    W, dtype = dist.get_world_size(), getattr(torch, call.dtype)
    inputs = torch.stack([_values(call.shape, dtype, (call.seed, r, 0), call.nan).double().reshape(-1) for r in range(W)])
    got64, want64 = got.double().reshape(-1), want.double().reshape(-1)
    has_nan = inputs.isnan().any(0)
    if call.reduce in ("MIN", "MAX"):
        member = ((inputs == got64) | (inputs.isnan() & got64.isnan())).any(0)
        return same_bits(got.reshape(-1)[~has_nan], want.reshape(-1)[~has_nan]) and bool(member[has_nan].all())
    if has_nan.any() and not (got64[has_nan].isnan() & want64[has_nan].isnan()).all():
        return False
    u = torch.finfo(dtype).eps / 2
    factor = {"AVG": 1 / W, "PREMUL_SUM": 2.0}.get(call.reduce, 1.0)
    scale = inputs.abs().prod(0) if call.reduce == "PRODUCT" else inputs.abs().sum(0) * factor
    bound = 2 * W * u * scale * 1.01 + 2 * torch.finfo(dtype).tiny  # W: one more rounding for AVG's division
    fine = ~has_nan
    return bool(((got64 - want64).abs()[fine] <= bound[fine]).all())


def check_case(case_calls: list[Call], order: list[int], reference: str) -> dict:
    """Run one case in this rank (see the module docstring). ``reference``: ``"cpu"`` (Gloo ranks; staging forced
    through the CPU) or ``"accelerator"`` (the group serves no CPU). Returns counts for the report."""
    offload_shim.install()
    device = _reference_device(reference)
    counts = {"calls": len(case_calls), "refused": [], "bounded": 0}
    # Reference: each call alone, synchronously, on contiguous copies on the reference device, shim idle.
    reference_made, reference_results, refused, reference_types = [], [], [], []
    previous = offload_shim.configure(always_stage=False)
    try:
        for call in case_calls:
            make = _Tensors(call, device, host=False)
            outcome, kinds = [], []

            def reference_call():
                results = _launch(call, make, False)[1]
                kinds.extend(map(type, results))  # torch's own result types (AsyncCollectiveTensor, say)
                outcome.extend(_finish(results))

            error = _layout_refusal(call) or _error_of(reference_call)
            reference_made.append(make)
            refused.append(error)
            reference_results.append(outcome)
            reference_types.append(kinds)
        if device.type != "cpu":
            torch.accelerator.synchronize()
        staged_settings = {"staging_device": "cpu", "always_stage": True} if reference == "cpu" else {}
        offload_shim.configure(**staged_settings)
        # Staged: every call on the caller's CPU tensors; the asynchronous ones waited late, in the case's order.
        staged_made, works, staged_results = [], [], []
        with recording_staging() as devices:
            for call, error in zip(case_calls, refused):
                offload_shim.configure(chunk_bytes=call.chunk or previous.chunk_bytes)
                make = _Tensors(call, device, host=True)
                staged_made.append(make)
                if error is not None:
                    # Where torch raises an asynchronous call's error (at the call, or in wait()), as long as
                    # it raises it.
                    staged_error = _error_of(lambda: _wait(_launch(call, make, call.async_op)[0]))
                    assert type(staged_error) is type(error), (call, error, staged_error)
                    if _layout_refusal(call) is not None:
                        assert str(staged_error) == str(error), (call, error, staged_error)
                    what = "/".join([call.op, call.dtype] + ([call.reduce] if call.op in REDUCING else []))
                    counts["refused"].append(f"{what}: {type(error).__name__}")
                    works.append(None)
                    staged_results.append([])
                    continue
                work, results = _launch(call, make, call.async_op)
                works.append(work)
                staged_results.append(results)
            for index in order:
                if isinstance(works[index], torch._C.Future):  # all_reduce_coalesced's async result
                    value = works[index].wait()  # the caller's own tensors
                    assert all(any(v is t for t in staged_made[index].tensors()) for v in value), case_calls[index]
                elif works[index] is not None:
                    assert works[index].wait() is True
        if any(m.hosts() for m, e in zip(staged_made, refused) if e is None):
            assert devices, "nothing was staged"
    finally:
        offload_shim.configure(**dataclasses.asdict(previous))
    for call, error, want_made, got_made, want_results, got_results, want_types in zip(
        case_calls, refused, reference_made, staged_made, reference_results, staged_results, reference_types
    ):
        for host in got_made.hosts():
            assert host.tensor.data_ptr() == host.pointer, (call, "the caller's tensor moved")
            assert bool((host.base.reshape(-1)[host.outside] == _sentinel(1, host.base.dtype)).all()), (
                call, "wrote outside the caller's view")
        if error is not None:  # refused: nothing written (where torch's own path may have written part)
            for host in got_made.hosts():
                assert same_bits(host.tensor, host.initial), (call, error, "the caller's tensor was written")
            continue
        bounded = _order_may_differ(call)
        counts["bounded"] += bool(bounded)
        for index, (want, got) in enumerate(zip(want_made.tensors(), got_made.tensors())):
            if call.op == "reduce" and index == 0 and dist.get_rank() != call.root:
                # Left as it was, as NCCL leaves it (Gloo's own CPU path, the CPU runs' reference, uses it as scratch).
                initial = _values(call.shape, getattr(torch, call.dtype), (call.seed, dist.get_rank(), 0), call.nan)
                assert same_bits(got.cpu(), initial), (call, got, initial)
            elif bounded and index == 0:  # the reduced tensor
                assert _within_reordering_bound(call, got.cpu(), want.cpu()), (call, got, want)
            else:
                assert same_bits(got.cpu(), want.cpu()), (call, got, want)
        assert len(got_results) == len(want_results), call
        inputs = [t.device for t in got_made.tensors()]
        for index, (want, got) in enumerate(zip(want_results, got_results)):
            # A functional result comes back to its input's device (a coalesced call's i-th input, else the first).
            home = inputs[index if len(got_results) > 1 else 0]
            if home.type == "cpu" and home == device:  # (a GPU run's reference is on the accelerator)
                assert type(got) is want_types[index], (call, type(got), want_types[index])
            assert got.device == home, (call, got.device, home)
            assert same_bits(_finish([got])[0].cpu(), want.cpu()), (call, got, want)
    return counts
