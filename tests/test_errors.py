"""Case 06: where staging is impossible, say so plainly, on every rank, before any rank blocks.

The group serves only ``cuda`` (``init_process_group("cuda:gloo")``) on a machine without CUDA."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import offload_shim
import versions

CALLS = {
    "all_reduce": lambda t: dist.all_reduce(t),
    "all_reduce_async": lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True),
    "broadcast": lambda t: dist.broadcast(t, src=0),
    "functional_all_reduce": lambda t: funcol.all_reduce(t, "sum", dist.group.WORLD),
    "functional_all_gather_single": lambda t: versions.all_gather_single(t, 0, dist.group.WORLD),
}


def raise_staging_error(call_name, staging_device):
    offload_shim.install()
    previous = offload_shim.configure(staging_device=staging_device)
    tensor = torch.arange(4.0) + dist.get_rank()
    before = tensor.clone()
    try:
        CALLS[call_name](tensor)
    except offload_shim.StagingError:
        assert torch.equal(tensor, before), "the caller's tensor was modified"
        raise
    finally:
        offload_shim.configure(**dataclasses.asdict(previous))


def torch_error_without_shim():
    offload_shim.uninstall()
    try:
        with pytest.raises(RuntimeError, match="^No backend type associated with device type cpu$"):
            dist.all_reduce(torch.ones(4))
    finally:
        offload_shim.install()


def test_torch_fails_there_without_the_shim(accelerator_only_ranks):
    accelerator_only_ranks.run(torch_error_without_shim)


@pytest.mark.parametrize("call_name", sorted(CALLS))
def test_actionable_error_on_every_rank(accelerator_only_ranks, call_name):
    # Every rank answers (the pool fails on a rank that does not, within its timeout): none blocks.
    errors = accelerator_only_ranks.run_expecting_errors(raise_staging_error, call_name, None)
    for rank, text in enumerate(errors):
        message = text.split("\n")[0]
        assert message.startswith(f"{rank}: StagingError: offload_shim: "), message
        # The functional collectives are staged as the ops they call (compiled code calls the same).
        collective = {"functional_all_reduce": "torch.ops._c10d_functional.all_reduce",
                      "functional_all_gather_single": "torch.ops._c10d_functional.all_gather_into_tensor",
                      }.get(call_name, "torch.distributed." + call_name.replace("_async", ""))
        assert f"offload_shim: {collective} got a tensor on cpu ((4,), torch.float32)" in message
        assert "backend 'cuda:gloo' serves device types ['cuda'] only" in message
        # No accelerator: on a CPU build of torch none; on a CUDA build, CUDA but no device
        assert ("this process has no accelerator" in message
                or "this process's accelerator 'cuda' is not available" in message), message
        assert "init_process_group('cpu:gloo,cuda:gloo')" in message
        assert "move the tensor to the accelerator" in message and "The tensor was not modified" in message


def test_configured_staging_device_of_unserved_type(accelerator_only_ranks):
    errors = accelerator_only_ranks.run_expecting_errors(raise_staging_error, "all_reduce", "cpu")
    for text in errors:
        assert "the configured staging device 'cpu' (configure(staging_device=...) or OFFLOAD_SHIM_STAGING_DEVICE)" in text
        assert "is of type 'cpu', which the group does not serve" in text and "such as plain 'gloo'" in text


def test_configured_accelerator_that_is_absent(accelerator_only_ranks):
    """A staging device of a served type that this process cannot use: a StagingError, not a failure of
    torch's pinned-memory allocator half way."""
    errors = accelerator_only_ranks.run_expecting_errors(raise_staging_error, "all_reduce", "cuda:0")
    for rank, text in enumerate(errors):
        assert text.startswith(f"{rank}: StagingError: offload_shim: torch.distributed.all_reduce got a tensor on cpu")
        assert "the configured staging device 'cuda:0'" in text and "is not usable from this process" in text


def test_public_exceptions_have_public_paths():
    import pickle
    import traceback

    import offload_shim

    for error_type in (offload_shim.StagingError, offload_shim.ConfigError):
        assert error_type.__module__ == "offload_shim"
        error = pickle.loads(pickle.dumps(error_type("message")))
        assert type(error) is error_type and str(error) == "message"
        assert f"offload_shim.{error_type.__name__}: message" in "".join(traceback.format_exception_only(error))


def test_configure_and_the_environment_name_the_setting_and_its_values_alike():
    """A malformed value names the setting as it was given (the variable, or configure()'s argument) and what it
    takes: configure() raises it and changes nothing; the environment gives the variable's default, and says so."""
    import offload_shim
    from offload_shim import _config

    before = offload_shim.settings()
    for changes, environ, message in (
        ({"always_stage": "yes"}, {"OFFLOAD_SHIM_ALWAYS_STAGE": "maybe"}, "is not a boolean: use"),
        ({"summary_at_exit": 1}, {"OFFLOAD_SHIM_SUMMARY": "sometimes"}, "is not a boolean: use"),
        ({"chunk_bytes": "abc"}, {"OFFLOAD_SHIM_CHUNK_BYTES": "abc"}, "is not a size: give bytes"),
        # (Digits of other scripts are not sizes: int() would read these as 16.)
        ({"chunk_bytes": "\u0661\u0666"}, {"OFFLOAD_SHIM_CHUNK_BYTES": "\uff11\uff16"}, "is not a size: give bytes"),
        ({"route_min_bytes": "-1"}, {"OFFLOAD_SHIM_ROUTE_MIN_BYTES": "-1"}, "is not a size: give bytes"),
        ({"staging_device": "nonsense"}, {"OFFLOAD_SHIM_STAGING_DEVICE": "nonsense"}, "is not a device"),
    ):
        (name, value), (variable, raw) = next(iter(changes.items())), next(iter(environ.items()))
        with pytest.raises(offload_shim.ConfigError, match=f"^{name}={value!r} {message}"):
            offload_shim.configure(**changes)
        read = _config.read_environment(environ)
        (sentence,) = read.malformed
        assert read.settings == _config.Settings() and sentence.startswith(f"{variable}={raw!r} {message}"), sentence
        assert sentence.endswith(f"; {variable} takes its default instead: {_config.DEFAULTS[variable]}"), sentence
    assert offload_shim.settings() == before


def test_a_size_variable_below_the_least_size_is_malformed():
    """A size variable under 64 KiB (besides 0 where 0 has a meaning) is malformed, named with the least size, and
    takes its default: it is almost always a number whose unit was forgotten (``OFFLOAD_SHIM_CHUNK_BYTES=16`` once
    split a 256 KiB call into 16,384 collectives). ``configure()`` takes any size its setting takes."""
    import offload_shim
    from offload_shim import _config

    for variable, small in ((_config.ENV_CHUNK_BYTES, "16"), (_config.ENV_CHUNK_BYTES, "65535"),
                            (_config.ENV_CHUNK_BYTES, "1KiB"), (_config.ENV_ROUTE_MIN_BYTES, "1"),
                            (_config.ENV_REGISTER_BYTES, "4")):
        read = _config.read_environment({variable: small})
        assert read.settings == _config.Settings(), (variable, small)
        assert re.match(f"^{variable}={small!r} is below the least size .* 65536 bytes \\(64KiB\\).*a number "
                        "without its unit", read.malformed[0]), read.malformed
    given = _config.settings_from_environment({_config.ENV_CHUNK_BYTES: "64KiB", _config.ENV_ROUTE_MIN_BYTES: "0",
                                               _config.ENV_REGISTER_BYTES: "0"})
    assert (given.chunk_bytes, given.route_min_bytes, given.register_bytes) == (65536, 0, 0)
    assert _config.settings_from_environment({_config.ENV_ROUTE_MIN_BYTES: "off"}).route_min_bytes is None
    assert "must be positive" in _config.read_environment({_config.ENV_CHUNK_BYTES: "0"}).malformed[0]
    before = offload_shim.configure(chunk_bytes=16)
    try:
        assert offload_shim.settings().chunk_bytes == 16
    finally:
        offload_shim.configure(**dataclasses.asdict(before))


def test_a_blank_variable_is_unset():
    """A variable that is empty or only blanks reads as unset, whichever setting it is, as ``OFFLOAD_SHIM`` does."""
    from offload_shim import _config

    names = [_config.ENV_STAGING_DEVICE, _config.ENV_CHUNK_BYTES, _config.ENV_ROUTE_MIN_BYTES,
             _config.ENV_REGISTER_BYTES, _config.ENV_ALWAYS_STAGE, _config.ENV_SUMMARY, _config.ENV_HOST_STAGING,
             _config.ENV_GRAPHS]
    for blank in ("", " ", "\t "):
        assert _config.settings_from_environment({name: blank for name in names}) == _config.Settings(), repr(blank)
