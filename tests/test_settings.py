"""Settings that fail safe: a malformed value of any variable leaves the shim installed, with that variable alone at
its default, and a warning in every process (so on every rank) naming the variable, the value given, what it takes
and the default used; sizes take the units people write, each binary."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import warnings

import pytest

import offload_shim
import offload_shim_names
from offload_shim import _config, _startup

ROOT = pathlib.Path(__file__).resolve().parents[1]


def documented_variables() -> list[str]:
    """The variables of docs/operations.md's settings list, in its order."""
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text[text.index("\n## Settings\n"):]
    section = section[: section.index("\n## ", 1)]
    return re.findall(r"^- `(OFFLOAD_SHIM\w*)`:", section, re.M)


def test_the_docs_table_is_the_one_list():
    assert sorted(documented_variables()) == sorted(offload_shim_names.VARIABLES) == sorted(_config.ENVIRONMENT)


# Each variable: malformed values (the among them), what the warning says it takes, and its default as the
# warning names it.
BOOLEAN = "is not a boolean: use one of ['1', 'on', 'true', 'yes'] to enable or ['0', 'false', 'no', 'off'] to disable"
UNITS = "units: B; k, KB, KiB = 1024 bytes; M, MB, MiB = 1024 KiB; G, GB, GiB = 1024 MiB; T, TB, TiB = 1024 GiB"
MALFORMED = {
    "OFFLOAD_SHIM": (["maybe", "2"], BOOLEAN,
                     "unset (import torch switches nothing on; import offload_shim installs)"),
    "OFFLOAD_SHIM_STAGING_DEVICE": (["gpu:zero"], "is not a device",
                                    "unset (the group's bound device, else the current accelerator device)"),
    "OFFLOAD_SHIM_ALWAYS_STAGE": (["maybe"], BOOLEAN, "false"),
    # below the floor (a unit forgotten), a fraction of a byte, garbage, zero where it means nothing
    "OFFLOAD_SHIM_CHUNK_BYTES": (["16", "1.5", "16 megs", "0"], "", "16MiB (16777216 bytes)"),
    "OFFLOAD_SHIM_ROUTE_MIN_BYTES": (["-1", "1KiB", "lots"], "", "1MiB (1048576 bytes)"),
    "OFFLOAD_SHIM_HOST_STAGING": (["sometimes"], BOOLEAN, "true"),
    "OFFLOAD_SHIM_GRAPHS": (["nah"], BOOLEAN, "true"),
    "OFFLOAD_SHIM_REGISTER_BYTES": (["4", "0.1KiB", "4 GiB please"], "", "0 (nothing registered)"),
    "OFFLOAD_SHIM_LOG": (["verbose"], "is not a log level: use one of ['debug', 'info', 'warning']",
                         "unset (nothing printed)"),
    "OFFLOAD_SHIM_SUMMARY": (["yes please"], BOOLEAN, "false (no table at exit)"),
}
SIZES = {"OFFLOAD_SHIM_CHUNK_BYTES", "OFFLOAD_SHIM_ROUTE_MIN_BYTES", "OFFLOAD_SHIM_REGISTER_BYTES"}


def start_up(monkeypatch, environ: dict):
    """The package's start-up (``activate_on_import``, what ``import offload_shim`` and every activation path run,
    once a process) in this process, under ``environ`` alone: whether it installed, the settings it put in force,
    the log level it asked for, and its warnings. This process's settings and wrappers are put back after."""
    for name in offload_shim_names.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    levels = []
    monkeypatch.setattr(_startup, "_log_to_stderr", levels.append)  # (no handler left on this process's logger)
    monkeypatch.setattr(_startup, "_activated", False)
    before, was_installed = offload_shim.settings(), offload_shim.is_installed()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            installed = _startup.activate_on_import(offload_shim.install, offload_shim.is_installed)
        return installed, offload_shim.settings(), levels, [str(w.message) for w in caught]
    finally:
        offload_shim.configure(**dataclasses.asdict(before))
        (offload_shim.install if was_installed else offload_shim.uninstall)()


@pytest.mark.parametrize("variable", documented_variables())
def test_a_malformed_value_keeps_the_shim_on_with_that_variables_default(monkeypatch, variable):
    """For every variable of the docs' table, each malformed value: the shim installs all the same, that variable
    alone takes its default (another variable's valid value beside it is kept), and one warning names the variable,
    the value given, what it takes and the default used."""
    values, takes, default = MALFORMED[variable]
    other, other_value, kept = (("OFFLOAD_SHIM_ROUTE_MIN_BYTES", "2MiB", {"route_min_bytes": 2 << 20})
                                if variable == "OFFLOAD_SHIM_CHUNK_BYTES"
                                else ("OFFLOAD_SHIM_CHUNK_BYTES", "32MiB", {"chunk_bytes": 32 << 20}))
    for value in values:
        installed, settings, levels, messages = start_up(monkeypatch, {variable: value, other: other_value})
        assert installed, (variable, value, messages)
        assert settings == dataclasses.replace(_config.Settings(), **kept), (variable, value)
        assert levels == [None], levels  # OFFLOAD_SHIM_LOG malformed: nothing printed, its default
        (message,) = [m for m in messages if variable + "=" in m]
        assert message.startswith(f"offload_shim: {variable}={value!r} "), message
        assert takes in message and (variable not in SIZES or UNITS in message), message
        assert message.endswith(f"; {variable} takes its default instead: {default}"), message


def test_a_malformed_value_with_the_shim_switched_off_warns_the_same(monkeypatch):
    """``OFFLOAD_SHIM=0``: nothing installs, and a malformed other variable warns as it does switched on (its
    default kept for a later ``install()``), the valid ones kept."""
    installed, settings, _, messages = start_up(
        monkeypatch, {"OFFLOAD_SHIM": "0", "OFFLOAD_SHIM_CHUNK_BYTES": "lots", "OFFLOAD_SHIM_REGISTER_BYTES": "1GB"})
    assert not installed and settings == dataclasses.replace(_config.Settings(), register_bytes=1 << 30)
    assert messages == ["offload_shim: OFFLOAD_SHIM_CHUNK_BYTES='lots' is not a size: give bytes, e.g. 1048576, or a "
                        "number and a unit, e.g. 16MiB, 64k, 1.5GiB (" + UNITS + "; any case); OFFLOAD_SHIM_CHUNK_BYTES "
                        "takes its default instead: 16MiB (16777216 bytes)"], messages


def test_the_units_people_write_are_taken_at_start_up(monkeypatch):
    """The issue's spellings, each a size now, no warning."""
    installed, settings, _, messages = start_up(monkeypatch, {
        "OFFLOAD_SHIM": "1", "OFFLOAD_SHIM_CHUNK_BYTES": "1.5MiB", "OFFLOAD_SHIM_ROUTE_MIN_BYTES": "64k",
        "OFFLOAD_SHIM_REGISTER_BYTES": "16MB"})
    assert installed and not [m for m in messages if "OFFLOAD_SHIM_" in m], messages
    assert (settings.chunk_bytes, settings.route_min_bytes, settings.register_bytes) == (1572864, 65536, 16 << 20)


# Every spelling of a size, and its exact bytes: plain bytes, and a number (a fraction too) with a unit, binary
# whatever its spelling, in any case, with blanks around or between.
SPELLINGS = {
    "1048576": 1048576, "0": 0, "65536B": 65536, "100 b": 100,
    "64k": 64 << 10, "64K": 64 << 10, "64KB": 64 << 10, "64kb": 64 << 10, "64KiB": 64 << 10, "64kib": 64 << 10,
    "16M": 16 << 20, "16m": 16 << 20, "16MB": 16 << 20, "16MiB": 16 << 20, "16 MiB": 16 << 20, " 16mib ": 16 << 20,
    "1G": 1 << 30, "1GB": 1 << 30, "1GiB": 1 << 30, "1gib": 1 << 30, "2T": 2 << 40, "2TB": 2 << 40, "2TiB": 2 << 40,
    "1.5MiB": 1572864, "1.5M": 1572864, "0.5GiB": 512 << 20, "1.5k": 1536, "2.25KiB": 2304, "1.0": 1,
}


@pytest.mark.parametrize("text", sorted(SPELLINGS))
def test_each_spelling_of_a_size_is_its_exact_bytes(text):
    assert _config.parse_size(text) == SPELLINGS[text]
    assert type(_config.parse_size(text)) is int


def test_sizes_from_code_take_the_same_units():
    before = offload_shim.configure(chunk_bytes="16MB", register_bytes="1.5GiB", route_min_bytes="64k")
    try:
        now = offload_shim.settings()
        assert (now.chunk_bytes, now.register_bytes, now.route_min_bytes) == (16 << 20, 3 << 29, 64 << 10)
    finally:
        offload_shim.configure(**dataclasses.asdict(before))


@pytest.mark.parametrize("text", [
    "", " ", "lots", "16 megs", "MiB", "-1", "+16MiB", "0x100", "1e6", "16MiB/s", "16 M B", "16MiBs", "16Mbit",
    "1,048,576", "1_048_576", "1,5MiB", ".5MiB", "16.", "16..5M", "16 MiB MiB", "16P", "16EiB", "\uff11\uff16",
    "\u0661\u0666MiB",  # (digits of other scripts: int() reads them, a size does not)
])
def test_garbage_and_ambiguous_sizes_are_refused_naming_the_units(text):
    with pytest.raises(ValueError, match=r"^is not a size: give bytes, e.g. 1048576, or a number and a unit, e.g. "
                                         r"16MiB, 64k, 1\.5GiB \(units: B; k, KB, KiB = 1024 bytes; M, MB, MiB = 1024 "
                                         r"KiB; G, GB, GiB = 1024 MiB; T, TB, TiB = 1024 GiB; any case\)$"):
        _config.parse_size(text)


@pytest.mark.parametrize("text, exact", [("1.5", "1.5"), ("0.1KiB", "102.4"), ("1.0000001MiB", "1048576.105")])
def test_a_fraction_of_a_byte_is_refused_clearly(text, exact):
    with pytest.raises(ValueError, match=rf"^is {re.escape(exact)} bytes, not a whole number of bytes: give one, e.g. "
                                         r"1572864 or 1\.5MiB \(units: "):
        _config.parse_size(text)


def test_configure_keeps_raising_for_a_malformed_argument():
    """Code's own mistake, raised to the caller (nothing changed), as the same words the environment's warning
    gives."""
    before = offload_shim.settings()
    for changes, message in (({"chunk_bytes": "16 megs"}, "chunk_bytes='16 megs' is not a size: give bytes"),
                             ({"chunk_bytes": "0.1KiB"}, "chunk_bytes='0.1KiB' is 102.4 bytes, not a whole number"),
                             ({"always_stage": "maybe"}, "always_stage='maybe' is not a boolean: use True or False")):
        with pytest.raises(offload_shim.ConfigError, match="^" + re.escape(message)):
            offload_shim.configure(**changes)
    assert offload_shim.settings() == before


# Each rank reports whether the shim is installed, and whether every setting is its default (all malformed).
RANKS = """\
import os, torch, torch.distributed as dist
import offload_shim
dist.init_process_group("gloo")
tensor = torch.ones(2)
dist.all_reduce(tensor)
os.write(1, f"rank {dist.get_rank()} installed {offload_shim.is_installed()} defaults "
            f"{offload_shim.settings() == offload_shim.Settings()} sum {tensor.tolist()}\\n".encode())
dist.destroy_process_group()
"""


def test_every_rank_warns_of_every_malformed_variable_and_keeps_the_shim(tmp_path):
    """Two ranks under torchrun, every variable but the switch malformed at once: both ranks have the shim
    installed, every setting its default, and each rank warns once of each variable, at the script's import torch
    line (torchrun's own process none)."""
    from test_activation import torchrun

    environ = {name: values[0] for name, (values, _, _) in MALFORMED.items() if name != "OFFLOAD_SHIM"}
    lines, stderr = torchrun(tmp_path, {"OFFLOAD_SHIM": "1", **environ}, RANKS)
    assert lines == [f"rank {rank} installed True defaults True sum [2.0, 2.0]" for rank in range(2)], (lines, stderr)
    for variable, value in environ.items():
        warned = re.findall(rf"^{re.escape(str(tmp_path / 'train.py'))}:1: RuntimeWarning: offload_shim: "
                            rf"{variable}={re.escape(repr(value))} .*; {variable} takes its default instead: "
                            rf"{re.escape(MALFORMED[variable][2])}$", stderr, re.M)
        assert len(warned) == 2, (variable, stderr)
