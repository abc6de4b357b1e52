"""Accelerator tensors on groups that serve them only through the host (docs/reference.md): the decision, on CPU.

No machine here has an XPU, an NPU or an MPS device, and this one has no GPU: the decision is checked with torch's
fake tensors (real ``torch.Tensor`` objects that carry a device and no data), on real Gloo and ``cuda:gloo``
groups. Ascend's ``npu`` (torch's private-use backend, renamed by torch_npu) has no fake tensors here: ``mtia``
stands in for another accelerator the group has no backend for. The staging itself (the copy to pinned host memory, the collective on the host, the copy back on the
caller's stream) runs on a GPU: tests/test_one_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

import offload_shim
from observe import configured
from offload_shim import _devices, _plan, _table

C10D = "torch.distributed."


def _fake(device: str, *shape):
    """A fake tensor on ``device``, or ``None`` where this torch cannot make one (a CUDA build initialises the
    device of an ``xpu`` fake tensor, and fails without one)."""
    try:
        with FakeTensorMode():
            return torch.empty(*(shape or (4,)), device=device)
    except (AssertionError, RuntimeError, AttributeError):
        return None


def check_decision():
    """Which accelerator tensors go through the host: a Gloo group serves CUDA for most collectives and not for
    point-to-point or the functional all_gather; it serves no XPU, MTIA or MPS tensor at all, which all go through
    the host; a group without a CPU backend leaves them to torch (its own error); ``meta`` and host tensors are never
    host-staged; the setting switches it off."""
    offload_shim.install()
    gloo = dist.group.WORLD
    cuda_only = dist.new_group([0, 1], backend="cuda:gloo")
    cuda = _fake("cuda")
    tensors = {name: _fake(name) for name in ("cuda", "xpu", "mtia", "mps")}
    tensors = {name: tensor for name, tensor in tensors.items() if tensor is not None}
    tensors.update(meta=torch.empty(4, device="meta"), cpu=torch.ones(4))
    entries = {  # the table's entries, as each family's wrapper binds them
        "all_reduce": (_table.C10D["all_reduce"], _plan.C10D), "send": (_table.C10D["send"], _plan.C10D),
        "batch_isend_irecv": (_table.BATCH, _plan.C10D),
        "_functional_collectives.all_gather_tensor": (_table.FUNCTIONAL["all_gather_tensor"], _plan.FUNCTIONAL),
        "_functional_collectives.all_reduce": (_table.FUNCTIONAL["all_reduce"], _plan.FUNCTIONAL),
    }

    def through_host(collective, value, group):
        """The device type whose tensors the one decision stages through the host, or ``None``."""
        entry, family = entries[collective]
        if entry.args[0].form == _table.LIST and not isinstance(value, list):
            value = [value]  # (a batch's tensors, one a P2POp)
        plan = _plan.decide(_plan.Call(entry, family, group, {entry.args[0].name: value}, op=dist.ReduceOp.SUM))
        return plan.source if plan is not None and plan.route == "host" else None

    decided = {}
    with configured(host_staging=True):
        for group_name, group in (("gloo", gloo), ("cuda:gloo", cuda_only)):
            for device_name, tensor in tensors.items():
                if device_name == "cpu" and group is cuda_only:
                    continue  # host tensors there are staged through an accelerator, or refused: test_errors.py
                for collective in entries:
                    decided[group_name, device_name, collective] = through_host(collective, tensor, group)
        # a call mixing host and accelerator tensors: only the accelerator's are staged (the host's are served)
        mixed = through_host("batch_isend_irecv", [torch.ones(4), cuda], gloo)
    with configured(host_staging=False):
        switched_off = through_host("send", cuda, gloo)
    return decided, switched_off, mixed, sorted(tensors)


def test_decision(gloo_ranks):
    decided, switched_off, mixed, made = gloo_ranks.run(check_decision)[0]
    others = [device for device in ("xpu", "mtia", "mps") if device in made]
    assert "cuda" in made and (others or torch.cuda.is_available()), made  # (a CUDA build makes no xpu fakes)
    through_host = {key for key, kind in decided.items() if kind is not None}
    assert through_host == {
        ("gloo", "cuda", "send"),
        ("gloo", "cuda", "batch_isend_irecv"),
        ("gloo", "cuda", "_functional_collectives.all_gather_tensor"),
        *(("gloo", device, collective) for device in others for collective in (
            "all_reduce", "send", "batch_isend_irecv", "_functional_collectives.all_gather_tensor",
            "_functional_collectives.all_reduce",
        )),
    }, sorted(through_host)
    assert all(decided[key] == key[1] for key in through_host)  # the device type whose tensors are staged
    assert switched_off is None and mixed == "cuda"


def test_partly_served_names_only_wrapped_collectives():
    """The table of what Gloo serves on CUDA names collectives by the names the wrappers decide with."""
    offload_shim.install()
    import torch.distributed._functional_collectives  # noqa: F401 - its wrappers are applied on import

    wrapped = {name.replace("distributed_c10d.", "") for name in offload_shim.wrapped_functions()}
    for names in _devices.PARTLY_SERVED.values():
        # (a name this torch lacks, all_gather_single before 2.13, is not wrapped here)
        assert sorted(n for n in names if n not in wrapped and hasattr(dist, n.rpartition(".")[2])) == []


def test_host_staging_setting_reads_the_environment(monkeypatch):
    from offload_shim import _config

    monkeypatch.setenv(_config.ENV_HOST_STAGING, "0")
    assert _config.settings_from_environment().host_staging is False
    monkeypatch.setenv(_config.ENV_HOST_STAGING, "")
    assert _config.settings_from_environment().host_staging is True  # on by default
    monkeypatch.setenv(_config.ENV_HOST_STAGING, "sometimes")  # malformed: its default, and said so
    read = _config.read_environment()
    assert read.settings.host_staging is True
    assert read.malformed[0].startswith("OFFLOAD_SHIM_HOST_STAGING='sometimes' is not a boolean"), read.malformed


def test_which_collectives_wait_for_torchs_refusal():
    """The collectives that every partly-serving backend runs on its accelerator's tensors go to torch first, and
    reach the host only through torch's refusal ("No backend type associated with device type ..."); the others ask
    their group first."""
    lazy = {c for c in ("all_reduce", "broadcast", "all_gather_into_tensor", "send", "batch_isend_irecv")
            if _devices.refused_for_host(C10D + c)}
    assert lazy == {"all_reduce", "broadcast", "all_gather_into_tensor"}
    assert _devices.refused_for_host(C10D + "_functional_collectives.all_reduce")
    assert not _devices.refused_for_host(C10D + "_functional_collectives.all_gather_tensor")
    assert _devices.lacks_backend(RuntimeError("No backend type associated with device type xpu"))
    assert not _devices.lacks_backend(RuntimeError("Connection closed by peer"))


def test_torch_first_keeps_only_torchs_refusal_of_a_device_type():
    """torch's result comes back as it is; its refusal of a device type the group has no backend for is handed to
    the caller (host staging on) or raised as torch raised it (off); any other error propagates unchanged."""
    refusal = RuntimeError("No backend type associated with device type xpu")
    other = RuntimeError("Connection closed by peer")

    def raising(error):
        def call(*args, **kwargs):
            raise error
        return call

    result = object()
    assert _devices.torch_first(lambda *a, **k: (a, k), (1,), {"group": None}) == (((1,), {"group": None}), None)
    assert _devices.torch_first(lambda: result, (), {})[0] is result
    with configured(host_staging=True):
        assert _devices.torch_first(raising(refusal), (), {}) == (None, refusal)
        with pytest.raises(RuntimeError) as raised:
            _devices.torch_first(raising(other), (), {})
        assert raised.value is other
        with pytest.raises(ValueError, match="not a RuntimeError"):
            _devices.torch_first(raising(ValueError("not a RuntimeError")), (), {})
    with configured(host_staging=False):
        with pytest.raises(RuntimeError) as raised:
            _devices.torch_first(raising(refusal), (), {})
        assert raised.value is refusal


def check_served_path_of_tensor_pairs():
    """The wrapper of a collective of two tensors (``all_gather_into_tensor``), called as torch would call it (the
    shim's wrapper function with torch's function in ``wrapped``): accelerator tensors, by position or by keyword, go
    to torch once and come back as torch returned them; torch's refusal of their device type reaches the one decision
    once, torch not called again (host staging on), or is raised as torch raised it (off); any other error of torch
    propagates unchanged, after one call; host tensors go to torch at once where the group serves them, else reach
    the decision, as a host tensor beside an accelerator's does. By position (the short path) and by keyword (the
    general pass) alike. (A device type the Gloo group has no backend for, as fake tensors.)"""
    offload_shim.install()
    wrapper = dist.all_gather_into_tensor._self_wrapper
    device = next(d for d in ("mtia", "xpu") if _fake(d) is not None)  # one the Gloo group has no backend for
    out, given = _fake(device, 2 * dist.get_world_size()), _fake(device, 2)
    refusal = RuntimeError(f"No backend type associated with device type {device}")
    other = RuntimeError("peer gone")
    calls, decided = [], []

    def torch_function(raising=None):
        def call(*args, **kwargs):
            calls.append((args, kwargs))
            if raising is not None:
                raise raising
            return "torch's result"
        return call

    original_decide = _plan.decide

    def decide(call):
        decided.append(call.entry.name)
        return None  # (nothing staged here: the wrapper then raises torch's refusal)

    answers = {}
    _plan.decide = decide
    try:
        for form, args, kwargs in (("positional", (out, given), {}),
                                   ("keywords", (), {"output_tensor": out, "input_tensor": given})):
            calls.clear()
            answers[form, "served"] = (wrapper(torch_function(), None, args, kwargs), len(calls), list(decided))
            for staging in (True, False):
                calls.clear(), decided.clear()
                with configured(host_staging=staging):
                    try:
                        wrapper(torch_function(refusal), None, args, kwargs)
                    except RuntimeError as error:
                        raised = error
                answers[form, "refused", staging] = (raised is refusal, len(calls), list(decided))
            calls.clear(), decided.clear()
            try:
                wrapper(torch_function(other), None, args, kwargs)
            except RuntimeError as error:
                raised = error
            answers[form, "other error"] = (raised is other, len(calls), list(decided))
        # Host tensors (served by Gloo, or forced through the decision), and a host tensor beside an accelerator's.
        host_out, host_in = torch.zeros(2 * dist.get_world_size()), torch.ones(2)
        for case, pair, settings in (("host", (host_out, host_in), {}),
                                     ("host, always_stage", (host_out, host_in), {"always_stage": True}),
                                     ("mixed", (host_out, given), {})):
            for form, args, kwargs in (("positional", pair, {}),
                                       ("keywords", (), {"output_tensor": pair[0], "input_tensor": pair[1]})):
                calls.clear(), decided.clear()
                with configured(**settings):
                    answers[form, case] = (wrapper(torch_function(), None, args, kwargs), len(calls), list(decided))
    finally:
        _plan.decide = original_decide
    return answers


def test_served_path_of_tensor_pairs(gloo_ranks):
    for answers in gloo_ranks.run(check_served_path_of_tensor_pairs):
        for form in ("positional", "keywords"):
            assert answers[form, "served"] == ("torch's result", 1, []), answers
            assert answers[form, "refused", True] == (True, 1, ["all_gather_into_tensor"]), answers
            assert answers[form, "refused", False] == (True, 1, []), answers
            assert answers[form, "other error"] == (True, 1, []), answers
            assert answers[form, "host"] == ("torch's result", 1, []), answers
            for case in ("host, always_stage", "mixed"):  # the decision reached (it stages nothing here)
                assert answers[form, case] == ("torch's result", 1, ["all_gather_into_tensor"]), answers
