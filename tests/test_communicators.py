"""register_communicator: communicators outside torch.distributed, such as vLLM's PyNcclCommunicator.

The stand-in communicator below has the method signatures of vLLM's ``PyNcclCommunicator`` and its assertion
(``tensor.device == self.device``), and makes its collectives with torch.distributed on its group: Gloo on two
CPU ranks, NCCL on two GPUs. On a CPU-only machine there is no second device to stage from, so the CPU tests run
the staging path with the project's testing switch ``configure(always_stage=True)``: every registered tensor
argument is then staged even though it is already on the communicator's device (``cpu``), so the real copies,
the real Gloo collective on the copies and the real copy back into the caller's tensor all run; the stand-in
records what it received, which shows it got copies and never the caller's tensors. Without the switch, it gets
the caller's own tensors. The decision for a tensor off the communicator's device is checked on CPU by the error
for a device this process cannot use, and run for real (CPU and the other GPU) by the GPU test.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
import torch.distributed as dist
import wrapt

import offload_shim
from observe import configured
from ranks import RankPool

THIS_MODULE = sys.modules[__name__]


# ---------------------------------------------------------------- the stand-in, and how a user registers vLLM's


# torch 2.13 renamed these (the old names warn); older torch has only the old names
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _stream(stream):
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


class StandInCommunicator:
    """vLLM's ``PyNcclCommunicator`` interface and device assertion over a torch.distributed group. Records every
    tensor argument it receives."""

    def __init__(self, device, group=None):
        self.device = torch.device(device)
        self.group = group
        self.received = []

    def _take(self, *tensors):
        for tensor in tensors:
            assert tensor.device == self.device, (
                f"this nccl communicator is created to work on {self.device}, but the input tensor is on {tensor.device}"
            )
            assert tensor.is_contiguous(), "NCCL takes contiguous tensors"
            self.received.append(tensor)

    def all_reduce(self, in_tensor, out_tensor=None, op=dist.ReduceOp.SUM, stream=None):
        self._take(in_tensor, *([] if out_tensor is None else [out_tensor]))
        if out_tensor is None:
            out_tensor = torch.empty_like(in_tensor)
        with _stream(stream):
            out_tensor.copy_(in_tensor)
            dist.all_reduce(out_tensor, op, group=self.group)
        return out_tensor

    def all_gather(self, output_tensor, input_tensor, stream=None):
        self._take(output_tensor, input_tensor)
        with _stream(stream):
            ALL_GATHER(output_tensor, input_tensor, group=self.group)

    def reduce_scatter(self, output_tensor, input_tensor, op=dist.ReduceOp.SUM, stream=None):
        self._take(output_tensor, input_tensor)
        with _stream(stream):
            REDUCE_SCATTER(output_tensor, input_tensor, op, group=self.group)

    def send(self, tensor, dst, stream=None):
        self._take(tensor)
        with _stream(stream):
            dist.send(tensor, dst, group=self.group)

    def recv(self, tensor, src, stream=None):
        self._take(tensor)
        with _stream(stream):
            dist.recv(tensor, src, group=self.group)

    def broadcast(self, tensor, src, stream=None):
        self._take(tensor)
        with _stream(stream):
            dist.broadcast(tensor, src, group=self.group)


# method: (reads, writes), as docs/reference.md registers vLLM's PyNcclCommunicator
VLLM_METHODS = {
    "all_reduce": ("in_tensor", "out_tensor"),
    "all_gather": ("input_tensor", "output_tensor"),
    "reduce_scatter": ("input_tensor", "output_tensor"),
    "send": ("tensor", ()),
    "recv": ((), "tensor"),
    "broadcast": ("tensor", "tensor"),
}


def register(cls):
    for method, (reads, writes) in VLLM_METHODS.items():
        offload_shim.register_communicator(cls, method, device="device", reads=reads, writes=writes)


FUNCTION_RECEIVED = []


def function_all_reduce(tensor, group=None):
    """A communicator as a module-level function, working on CPU tensors."""
    assert tensor.device == torch.device("cpu") and tensor.is_contiguous()
    FUNCTION_RECEIVED.append(tensor)
    dist.all_reduce(tensor, group=group)


# ---------------------------------------------------------------- helpers


@contextlib.contextmanager
def shim():
    """Installed inside; the install state as found afterwards (the rank processes serve other test modules)."""
    was = offload_shim.is_installed()
    offload_shim.install()
    try:
        yield
    finally:
        (offload_shim.install if was else offload_shim.uninstall)()


def staged_copies(received, callers):
    """Whether every received tensor is a staged copy: another object with other memory than every caller's."""
    return all(r is not c and r.data_ptr() != c.data_ptr() for r in received for c in callers)


def arange(n, offset=0.0, device="cpu"):
    return torch.arange(n, dtype=torch.float32, device=device) + offset


# ---------------------------------------------------------------- checks run inside the ranks


def check_staged_on_cpu():
    register(StandInCommunicator)
    offload_shim.register_communicator(
        THIS_MODULE, "function_all_reduce", device=lambda _: torch.device("cpu"), reads="tensor", writes="tensor"
    )
    rank = dist.get_rank()
    comm = StandInCommunicator("cpu")
    with shim(), configured(always_stage=True):
        # all_reduce returning a new tensor: the method got a copy; the caller's input is unchanged
        x = arange(6, 10 * rank)
        out = comm.all_reduce(x)
        assert torch.equal(out, arange(6) * 2 + 10) and out.device == torch.device("cpu")
        assert torch.equal(x, arange(6, 10 * rank))
        assert len(comm.received) == 1 and staged_copies(comm.received, [x])

        # into a non-contiguous out_tensor, op given by position: the caller's object is returned, written
        comm.received.clear()
        x = arange(6, rank).reshape(2, 3)
        out_base = torch.full((3, 2), -1.0)
        out = out_base.t()
        assert comm.all_reduce(x, out, dist.ReduceOp.MAX) is out
        assert torch.equal(out, arange(6, 1).reshape(2, 3)) and torch.equal(out_base, arange(6, 1).reshape(2, 3).t())
        assert len(comm.received) == 2 and staged_copies(comm.received, [x, out])

        # one object for two parameters: staged once, the method sees one tensor for both
        comm.received.clear()
        t = arange(4, rank)
        assert comm.all_reduce(t, out_tensor=t) is t
        assert torch.equal(t, arange(4) * 2 + 1)
        first, second = comm.received
        assert first is second and staged_copies([first], [t])

        # all_gather by keyword: only the output is written back
        comm.received.clear()
        inp, output = torch.full((3,), float(rank + 1)), torch.full((6,), -1.0)
        assert comm.all_gather(input_tensor=inp, output_tensor=output) is None
        assert torch.equal(output, torch.tensor([1.0, 1, 1, 2, 2, 2])) and torch.equal(inp, torch.full((3,), float(rank + 1)))
        assert staged_copies(comm.received, [inp, output])

        # reduce_scatter from a non-contiguous input
        inp = arange(16, 100 * rank)[::2]
        output = torch.zeros(4)
        comm.reduce_scatter(output, inp)
        assert torch.equal(output, (arange(16)[::2] * 2 + 100)[4 * rank : 4 * rank + 4])

        # broadcast of a strided tensor, called through the class
        t = arange(12, rank).reshape(3, 4)[:, ::2]
        StandInCommunicator.broadcast(comm, t, 0)
        assert torch.equal(t, arange(12).reshape(3, 4)[:, ::2])

        # send / recv into a non-contiguous tensor
        comm.received.clear()
        if rank == 0:
            sent = arange(6, 7)
            comm.send(sent, 1)
            assert torch.equal(sent, arange(6, 7)) and staged_copies(comm.received, [sent])
        else:
            base = torch.zeros(3, 2)
            comm.recv(base.t(), 0)
            assert torch.equal(base.t(), arange(6, 7).reshape(2, 3))
            assert staged_copies(comm.received, [base])

        # a module-level function
        FUNCTION_RECEIVED.clear()
        t = arange(5, rank)
        assert function_all_reduce(t) is None
        assert torch.equal(t, arange(5) * 2 + 1) and staged_copies(FUNCTION_RECEIVED, [t])


def check_untouched_on_the_device():
    register(StandInCommunicator)
    rank = dist.get_rank()
    comm = StandInCommunicator("cpu")
    with shim():
        x, out = arange(4, rank), torch.zeros(4)
        assert comm.all_reduce(x, out_tensor=out) is out
        assert torch.equal(out, arange(4) * 2 + 1)
        inp, output = torch.full((2,), float(rank)), torch.zeros(4)
        comm.all_gather(output, inp)
        assert torch.equal(output, torch.tensor([0.0, 0, 1, 1]))
        t = arange(3, rank)
        comm.broadcast(t, 1)
        assert torch.equal(t, arange(3, 1))
        received = [x, out, output, inp, t]
        assert len(comm.received) == len(received) and all(r is c for r, c in zip(comm.received, received))


# ---------------------------------------------------------------- CPU tests


def test_staged_collectives_on_gloo_ranks(gloo_ranks):
    gloo_ranks.run(check_staged_on_cpu)


def test_tensors_on_the_communicator_device_are_untouched(gloo_ranks):
    gloo_ranks.run(check_untouched_on_the_device)


def test_a_device_this_process_cannot_use_raises_before_the_call():
    register(StandInCommunicator)
    comm = StandInCommunicator(torch.device("cuda", 64))  # never usable here: no such device index
    t = arange(4)
    with shim(), pytest.raises(offload_shim.StagingError, match=r"works on cuda:64.*not modified") as error:
        comm.broadcast(t, 0)
    assert "'tensor'" in str(error.value) and "tensor on cpu" in str(error.value)
    assert comm.received == [] and torch.equal(t, arange(4))


class FailingCommunicator:
    def __init__(self):
        self.device = torch.device("cpu")

    def fill_then_fail(self, out):
        out.fill_(7.0)
        raise ValueError("communicator failed")


def test_a_method_that_raises_leaves_the_callers_tensor_unchanged():
    offload_shim.register_communicator(FailingCommunicator, "fill_then_fail", device="device", writes="out")
    out = arange(3)
    with shim(), configured(always_stage=True), pytest.raises(ValueError, match="communicator failed"):
        FailingCommunicator().fill_then_fail(out)
    assert torch.equal(out, arange(3))


class ReinstalledCommunicator:
    def __init__(self):
        self.device = torch.device("cpu")
        self.received = []

    def double(self, tensor):
        self.received.append(tensor)
        tensor.mul_(2)


class RegisteredWhileUninstalled(ReinstalledCommunicator):
    def double(self, tensor):
        super().double(tensor)


def test_uninstall_restores_the_original_and_install_wraps_again():
    C, L = ReinstalledCommunicator, RegisteredWhileUninstalled
    original, late_original = vars(C)["double"], vars(L)["double"]
    assert not isinstance(original, wrapt.FunctionWrapper) and not isinstance(late_original, wrapt.FunctionWrapper)

    def staged_call_works(cls):
        comm, t = cls(), arange(3, 1)
        with configured(always_stage=True):
            comm.double(t)
        return torch.equal(t, arange(3, 1) * 2) and staged_copies(comm.received, [t])

    with shim():
        offload_shim.register_communicator(C, "double", device=lambda c: c.device, reads="tensor", writes="tensor")
        wrapper = vars(C)["double"]
        assert isinstance(wrapper, wrapt.FunctionWrapper) and wrapper.__wrapped__ is original
        assert offload_shim.wrapped_functions()[f"{__name__}.ReinstalledCommunicator.double"] is wrapper
        assert staged_call_works(C)

        offload_shim.uninstall()
        assert vars(C)["double"] is original
        assert f"{__name__}.ReinstalledCommunicator.double" not in offload_shim.wrapped_functions()
        comm, t = C(), arange(3)
        with configured(always_stage=True):
            comm.double(t)
            wrapper.__get__(comm, C)(t)  # the wrapper, kept by a caller across uninstall: the original's call alone
        assert comm.received[0] is t and comm.received[1] is t  # the original, unstaged
        assert torch.equal(t, arange(3) * 4)

        offload_shim.register_communicator(L, "double", device="device", reads="tensor", writes="tensor")
        assert vars(L)["double"] is late_original  # registered while uninstalled: wrapped at install

        offload_shim.install()
        for cls, function in ((C, original), (L, late_original)):
            assert isinstance(vars(cls)["double"], wrapt.FunctionWrapper) and vars(cls)["double"].__wrapped__ is function
            assert staged_call_works(cls)
        offload_shim.uninstall()
        assert vars(C)["double"] is original and vars(L)["double"] is late_original


class KeywordOnlyOutput:
    """A communicator whose output comes after ``*args``: given by keyword only, whatever the positional count."""

    def __init__(self):
        self.device = torch.device("cpu")
        self.received = []

    def double(self, tensor, *options, out):
        self.received.append(out)
        out.copy_(tensor * 2)


def test_a_keyword_only_parameter_is_read_from_the_keywords():
    with shim():
        offload_shim.register_communicator(KeywordOnlyOutput, "double", device="device", reads="tensor", writes="out")
        comm, t, options, out = KeywordOnlyOutput(), arange(4), [torch.full((4,), 9.0)] * 2, torch.zeros(4)
        with configured(always_stage=True):
            comm.double(t, *options, out=out)
        assert torch.equal(out, arange(4) * 2) and staged_copies(comm.received, [out, *options])
        assert all(torch.equal(o, torch.full((4,), 9.0)) for o in options)  # (read as `out` before: overwritten)


class Base:
    def inherited(self, tensor):
        pass


class BadRegistrations(Base):
    device = torch.device("cpu")

    def collective(self, tensor, out=None, *rest, **options):
        pass

    @staticmethod
    def static(tensor):
        pass

    async def coroutine(self, tensor):
        pass


def module_function(tensor):
    pass


def local_class():
    class Local:
        def collective(self, tensor):
            pass

    return Local


@pytest.mark.parametrize(
    ("owner", "method", "options", "error", "match"),
    [
        (BadRegistrations, "missing", {}, AttributeError, "defines no method 'missing'"),
        (BadRegistrations, "inherited", {}, AttributeError, r"defined on test_communicators\.Base: register that"),
        (BadRegistrations, "static", {}, TypeError, "staticmethod, not a plain function"),
        (BadRegistrations, "coroutine", {}, TypeError, "an async method returns before its body runs"),
        (THIS_MODULE, "missing", {}, AttributeError, "has no function 'missing'"),
        (BadRegistrations(), "collective", {}, TypeError, "takes a class or a module"),
        (local_class(), "collective", {}, ValueError, "cannot be found again by name"),
        (BadRegistrations, "collective", {"reads": "tensr"}, ValueError, r"no parameter 'tensr'; its parameters are \['tensor', 'out'\]"),
        (BadRegistrations, "collective", {"writes": ("self",)}, ValueError, "no parameter 'self'"),
        (BadRegistrations, "collective", {"reads": "rest"}, ValueError, "no parameter 'rest'"),
        (BadRegistrations, "collective", {"reads": (), "writes": ()}, ValueError, "reads and writes are both empty"),
        (BadRegistrations, "collective", {"device": "cuda:0"}, ValueError, r"not an attribute name.*lambda _: torch\.device"),
        (BadRegistrations, "collective", {"device": torch.device("cpu")}, TypeError, "device must be an attribute name or a callable"),
        (BadRegistrations, "collective", {"device": 0}, TypeError, "device must be an attribute name or a callable"),
        (THIS_MODULE, "module_function", {"device": "device"}, ValueError, "module-level function has no instance"),
    ],
)
def test_bad_registration_raises_and_wraps_nothing(owner, method, options, error, match):
    options = {"device": "device", "reads": "tensor", **options}
    holder = owner if isinstance(owner, (type, type(sys))) else type(owner)
    before = dict(vars(holder))
    with shim(), pytest.raises(error, match=match):
        offload_shim.register_communicator(owner, method, **options)
    assert dict(vars(holder)) == before


# ---------------------------------------------------------------- GPU: vLLM's assertion on a real NCCL group


def check_gpu_staging():
    register(StandInCommunicator)
    rank = dist.get_rank()
    own, other = torch.device("cuda", rank), torch.device("cuda", 1 - rank)
    comm = StandInCommunicator(own)
    n = 1 << 20
    with shim():
        for pinned in (False, True):  # a CPU tensor: the new output comes back to the CPU
            x = arange(n, rank)
            x = x.pin_memory() if pinned else x
            out = comm.all_reduce(x)
            assert out.device == torch.device("cpu") and torch.equal(out, arange(n) * 2 + 1)
            assert torch.equal(x, arange(n, rank))

        # a tensor on the other GPU of the host: staged through this rank's GPU, the result back on the other
        y = arange(n, 10 * rank, other)
        out = comm.all_reduce(y)
        assert out.device == other and torch.equal(out.cpu(), arange(n) * 2 + 10)

        # CPU input, out_tensor on the other GPU: the caller's object is returned, written
        out = torch.zeros(n, device=other)
        assert comm.all_reduce(arange(n, rank), out_tensor=out) is out
        assert torch.equal(out.cpu(), arange(n) * 2 + 1)

        # broadcast of a strided CPU tensor, the collective on a side stream
        t = arange(4 * n, rank).reshape(n, 4)[:, 1::2]
        comm.broadcast(t, 1, stream=torch.cuda.Stream(own))
        assert torch.equal(t, arange(4 * n, 1).reshape(n, 4)[:, 1::2])

        # all_gather: the input on this rank's GPU is passed as it is, the CPU output is staged
        comm.received.clear()
        inp, output = torch.full((n,), float(rank + 1), device=own), torch.zeros(2 * n)
        comm.all_gather(output, inp)
        assert comm.received[1] is inp and comm.received[0] is not output
        assert torch.equal(output, torch.cat([torch.full((n,), 1.0), torch.full((n,), 2.0)]))

        # reduce_scatter from the other GPU into a CPU output
        output = torch.zeros(n)
        comm.reduce_scatter(output, arange(2 * n, rank, other))
        assert torch.equal(output, (arange(2 * n) * 2 + 1)[rank * n : (rank + 1) * n])

        # send / recv: from the other GPU, into a CPU tensor
        if rank == 0:
            comm.send(arange(n, 5, other), 1)
        else:
            got = torch.zeros(n)
            comm.recv(got, 0)
            assert torch.equal(got, arange(n, 5))

        # vLLM's own failure without the shim
        offload_shim.uninstall()
        with pytest.raises(AssertionError, match=f"created to work on cuda:{rank}, but the input tensor is on cpu"):
            comm.all_reduce(torch.ones(2))


def check_one_gpu_staging():
    """One rank of a NCCL group on the one GPU: every CPU tensor a registered method gets is staged through the GPU
    for real (the stand-in asserts its tensors are on it, and NCCL runs on the copies); the caller's tensors come
    back written, the GPU ones passed as they are."""
    register(StandInCommunicator)
    own = torch.device("cuda", torch.cuda.current_device())
    comm = StandInCommunicator(own)
    n = 1 << 20
    with shim():
        before = sum(count.calls for count in offload_shim.staging_counters().values())
        for pinned in (False, True):  # a CPU input: the new output comes back to the CPU
            x = arange(n, 3)
            x = x.pin_memory() if pinned else x
            out = comm.all_reduce(x)
            assert out.device == torch.device("cpu") and torch.equal(out, arange(n, 3)) and out is not x
            assert torch.equal(x, arange(n, 3))
        # CPU input, CPU out_tensor: the caller's object is returned, written
        out = torch.zeros(n)
        assert comm.all_reduce(arange(n, 1), out_tensor=out) is out and torch.equal(out, arange(n, 1))
        # a strided CPU tensor broadcast on a side stream of the GPU: written in place, complete on return
        t = torch.zeros(4 * n).reshape(n, 4)[:, 1::2]
        t.copy_(arange(2 * n).reshape(n, 2))
        comm.broadcast(t, 0, stream=torch.cuda.Stream(own))
        assert torch.equal(t, arange(2 * n).reshape(n, 2))
        # all_gather: the input on the GPU passed as it is, the CPU output staged (written only)
        comm.received.clear()
        inp, output = torch.full((n,), 5.0, device=own), torch.zeros(n)
        comm.all_gather(output, inp)
        assert comm.received[1] is inp and comm.received[0] is not output and comm.received[0].device == own
        assert torch.equal(output, torch.full((n,), 5.0))
        # reduce_scatter from a CPU input into a CPU output
        output = torch.zeros(n)
        comm.reduce_scatter(output, arange(n, 7))
        assert torch.equal(output, arange(n, 7))
        staged = sum(count.calls for count in offload_shim.staging_counters().values()) - before
        assert staged == 6, staged  # (every call above staged something; none went untouched)
        # vLLM's own failure without the shim
        offload_shim.uninstall()
        with pytest.raises(AssertionError, match=f"created to work on {own}, but the input tensor is on cpu"):
            comm.all_reduce(torch.ones(2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_gpu_vllm_style_communicator_with_cpu_tensors():
    on_nccl_ranks(1, check_one_gpu_staging)


@pytest.mark.gpu
@pytest.mark.skipif(torch.accelerator.device_count() < 2, reason="needs two accelerators")
def test_gpu_vllm_style_communicator_with_cpu_and_other_gpu_tensors():
    on_nccl_ranks(2, check_gpu_staging)


def on_nccl_ranks(world_size, check):
    pool = RankPool(world_size=world_size, backend="nccl", timeout=300)
    try:
        pool.run(check)
    finally:
        pool.close()
