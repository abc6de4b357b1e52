"""Configuration: the environment variables offload_shim reads and the settings they fill.

Every environment variable offload_shim reads is named here, once.

``OFFLOAD_SHIM`` (:data:`ENV_ENABLE`)
    Switches the shim at start-up. True: ``1``, ``true``, ``yes``, ``on``; false: ``0``, ``false``, ``no``,
    ``off`` (any case, surrounding spaces ignored). Unset or empty: ``import torch`` leaves torch alone, and
    ``import offload_shim`` installs the wrappers. False: nothing is installed by any activation path,
    ``import offload_shim`` included. Any other value is malformed: read as unset (the rule below).
``OFFLOAD_SHIM_STAGING_DEVICE`` (:data:`ENV_STAGING_DEVICE`)
    The device to stage through, e.g. ``cuda:1``. Unset: the device bound to the process group
    (``ProcessGroup.bound_device_id``), else the current device of ``torch.accelerator``.
``OFFLOAD_SHIM_CHUNK_BYTES`` (:data:`ENV_CHUNK_BYTES`)
    Chunk size of the staging pipeline, in bytes or with a unit (:data:`UNITS`: ``16MiB``, ``16MB``, ``16M``,
    ``64k``, ``1.5MiB``, all binary), at least :data:`MIN_SIZE_BYTES` (64 KiB), as every size variable (besides
    ``0`` where ``0`` has a meaning): a smaller number is malformed, as a size whose unit was forgotten;
    :func:`configure` takes any.
    Elementwise collectives (all_reduce, broadcast, reduce) and ``DTensor.full_tensor`` of a ``Shard(0)`` DTensor of
    at least two chunks are staged chunk by chunk; the staging footprint is two chunks on the accelerator (for
    ``full_tensor``, two slots of one row per rank where a row is larger than a chunk over the ranks), and two
    more of pinned host memory for each direction with pageable tensors in an all_reduce, broadcast or reduce.
    Default :data:`DEFAULT_CHUNK_BYTES`.
``OFFLOAD_SHIM_ROUTE_MIN_BYTES`` (:data:`ENV_ROUTE_MIN_BYTES`)
    On a group that serves CPU through one backend (Gloo) and an accelerator through another (``cpu:gloo,
    cuda:nccl``), CPU tensors of at least this many bytes are staged through the accelerator's backend instead
    of going over Gloo. ``off`` disables routing. Default :data:`DEFAULT_ROUTE_MIN_BYTES`.
``OFFLOAD_SHIM_ALWAYS_STAGE`` (:data:`ENV_ALWAYS_STAGE`)
    Stage CPU tensors even when the group serves CPU itself. For tests and debugging: together with
    ``OFFLOAD_SHIM_STAGING_DEVICE=cpu`` it runs the whole staging path (real copies, the collective on
    the staged tensor, the copy back) on a CPU-only machine over a Gloo group.

``OFFLOAD_SHIM_HOST_STAGING`` (:data:`ENV_HOST_STAGING`)
    A boolean, spelled as for ``OFFLOAD_SHIM``; default true. True: accelerator tensors that a group's backends do
    not serve for a collective (any collective of an XPU tensor on a Gloo-only group; a CUDA ``send`` on a Gloo
    group) are staged through pinned host memory. False: they go to torch, which raises (or, for Gloo's CUDA
    point-to-point, ends the process), and calls on accelerator tensors skip the decision altogether.

``OFFLOAD_SHIM_GRAPHS`` (:data:`ENV_GRAPHS`)
    A boolean, spelled as for ``OFFLOAD_SHIM``; default true. True: a small synchronous ``all_reduce``,
    ``broadcast`` or ``reduce`` of a contiguous host tensor (at most 64 KiB) on a NCCL group is captured in a CUDA
    graph at its second call with the same group, shape, dtype and arguments, and replayed from then on
    (``offload_shim._replay``). False: every such call is staged through a slot.
``OFFLOAD_SHIM_REGISTER_BYTES`` (:data:`ENV_REGISTER_BYTES`)
    Opt-in: the most bytes of the caller's own pageable host memory that staging may register with the accelerator
    (page-lock in place, ``cudaHostRegister``) at once, as a size (``4GiB``). A pageable storage staged by a
    pipelined call for the second time is registered if it fits, the least recently staged ones making room (a
    storage unregistered for room is registered again only into free room), and stays registered until room is
    needed, no tensor uses it any more (its memory is then kept until the next pipelined call unregisters it: never
    freed while registered), or ``uninstall()``; its later calls copy at pinned memory's speed. While registered,
    the caller's storage is pinned memory to everyone: ``is_pinned()`` is true, ``Tensor.pin_memory()`` returns the
    tensor itself instead of a copy, and the process's own ``non_blocking=True`` copies into or out of it no longer
    wait for the copy (a read right after one may see the old values). Unset, empty or ``0``: never (the
    default: the shim changes no tensor of the caller's).

``OFFLOAD_SHIM_LOG`` (:data:`ENV_LOG`)
    ``warning``, ``info`` or ``debug`` (any case): offload_shim's log records (logger ``offload_shim``) go to
    standard error from that level, each line naming the process's rank (``RANK``, which torchrun sets): at
    ``warning`` its warnings alone (a registration that failed, a group passed through, a function not wrapped),
    at ``info`` also one line when the wrappers are installed and one line the first time a call from each line of
    code is staged (where, which collective, bytes, route, mode and why: ``offload_shim._counters``), at ``debug``
    also one line for every staging decision. Unset or empty: nothing is printed (the logger has a ``NullHandler``
    only, for the application's own logging configuration). Any other value is malformed.
``OFFLOAD_SHIM_SUMMARY`` (:data:`ENV_SUMMARY`)
    A boolean, spelled as for ``OFFLOAD_SHIM``. True: when the interpreter exits, the process of rank 0 (``RANK`` 0,
    or no ``RANK`` at all) prints one table of its staged calls to standard error: calls, bytes and seconds by
    collective, route and mode (``offload_shim.staging_counters()``), or one line saying that no call was staged
    (not where ``RANK`` is unset: torchrun's own process imports the shim too, and stages nothing). Other ranks
    print nothing. Unset, empty or false: nothing is printed. Any other value is malformed.

Environment variables are read when offload_shim is imported (:func:`read_environment`); :func:`configure` changes
the settings later. A malformed value of any of them never switches the shim off: that variable alone takes its
default (:data:`DEFAULTS` says which, in words), and start-up warns, in every process (so on every rank), naming the
variable, the value given, the default used and what it takes. ``OFFLOAD_SHIM``'s default is unset, so a malformed
switch switches nothing on at ``import torch`` (its warning says so) and ``import offload_shim`` installs.
:func:`configure`, called by code, raises :class:`ConfigError` for a malformed argument instead.
"""

from __future__ import annotations

import dataclasses
import fractions
import os
import re

import torch

import offload_shim_names
from offload_shim._state import state

# The variables, named once: the list start-up reads without importing the package (offload_shim_names.VARIABLES),
# one constant per name, in its order.
ENVIRONMENT = offload_shim_names.VARIABLES
(ENV_ENABLE, ENV_STAGING_DEVICE, ENV_ALWAYS_STAGE, ENV_CHUNK_BYTES, ENV_ROUTE_MIN_BYTES, ENV_HOST_STAGING, ENV_GRAPHS,
 ENV_REGISTER_BYTES, ENV_LOG, ENV_SUMMARY) = ENVIRONMENT
LOG_LEVELS = {"warning": 30, "info": 20, "debug": 10}  # logging.WARNING, logging.INFO, logging.DEBUG

# measured: results/gpu/2026-12-01-two-h200-gpu-tests-and-benchmark/bench.log, chunk sweep
DEFAULT_CHUNK_BYTES = 16 << 20
DEFAULT_ROUTE_MIN_BYTES = 1 << 20  # measured: Gloo beats NCCL staging below about 1 MiB
# The least a size variable of the environment takes, besides 0 where 0 has a meaning: below it, a number is almost
# always a size whose unit was forgotten (OFFLOAD_SHIM_CHUNK_BYTES=16 for 16 MiB splits a 256 KiB call into 16,384
# collectives).
MIN_SIZE_BYTES = 64 << 10

_TRUE = frozenset(offload_shim_names.TRUE)
_FALSE = frozenset(offload_shim_names.FALSE)


class ConfigError(ValueError):
    """A configuration value (environment variable or :func:`configure` argument) is malformed."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """The settings in force.

    Attributes:
        staging_device: device to stage through; ``None`` picks the group's bound device, else the current
            accelerator device.
        always_stage: stage CPU tensors even where the group serves CPU (tests, debugging).
        chunk_bytes: chunk size of the staging pipeline, in bytes.
        route_min_bytes: smallest CPU tensor, in bytes, routed off a group's CPU backend through its accelerator
            backend; ``None``: never routed.
        summary_at_exit: print the table of staged calls to standard error at exit, on rank 0.
        host_staging: stage accelerator tensors that a group's backends do not serve for a collective through
            the host.
        graphs: replay small synchronous in-place calls on NCCL groups from captured CUDA graphs.
        register_bytes: the most bytes of the caller's pageable host memory registered with the accelerator at
            once (0, the default: none; see ``OFFLOAD_SHIM_REGISTER_BYTES`` for what registration changes).
    """

    staging_device: torch.device | None = None
    always_stage: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    route_min_bytes: int | None = DEFAULT_ROUTE_MIN_BYTES
    summary_at_exit: bool = False
    host_staging: bool = True
    graphs: bool = True
    register_bytes: int = 0


def parse_flag(name: str, environ=os.environ) -> bool | None:
    """Read a boolean environment variable.

    Returns:
        ``True`` or ``False`` for a recognised value, ``None`` when the variable is unset or empty.

    Raises:
        ConfigError: the value is neither true nor false.
    """
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return None
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(offload_shim_names.not_a_boolean(name, raw))


def _parse_device(value, source: str) -> torch.device | None:
    if value is None or isinstance(value, torch.device):
        return value
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{source}={value!r} is not a device: give a string such as 'cuda:0' or 'cpu'")
    try:
        return torch.device(value.strip())
    except RuntimeError as exc:
        raise ConfigError(f"{source}={value!r} is not a device: {exc}") from None


# A number (digits 0-9 only, not other scripts'; a fraction with a dot) and a unit, spaces allowed between them.
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$", re.ASCII)
# Every unit binary, in any case: sizes of memory (chunks, pinned buffers), as torch's max_split_size_mb, dd's and
# systemd's K, M and G mean them. The least surprising reading of "16MB" for a chunk is 16 MiB, the default.
_UNIT = {"": 1, "b": 1}
for _power, _letter in enumerate("kmgt", 1):
    _UNIT.update({_letter: 1 << 10 * _power, _letter + "b": 1 << 10 * _power, _letter + "ib": 1 << 10 * _power})
del _power, _letter
UNITS = "B; k, KB, KiB = 1024 bytes; M, MB, MiB = 1024 KiB; G, GB, GiB = 1024 MiB; T, TB, TiB = 1024 GiB; any case"


def parse_size(text: str) -> int:
    """The bytes ``text`` gives: a whole number of bytes, or a number (a fraction too, with a dot) and a unit of
    :data:`UNITS`, e.g. ``"1048576"``, ``"16MiB"``, ``"16 MB"``, ``"64k"``, ``"1.5MiB"`` (1572864).

    Raises:
        ValueError: ``text`` is no size (the message says why, without naming a variable), or a fraction of a byte.
    """
    match = _SIZE.match(text) if isinstance(text, str) else None
    if match is None or match.group(2).lower() not in _UNIT:
        raise ValueError(f"is not a size: give bytes, e.g. 1048576, or a number and a unit, e.g. 16MiB, 64k, "
                         f"1.5GiB (units: {UNITS})")
    exact = fractions.Fraction(match.group(1)) * _UNIT[match.group(2).lower()]
    if exact.denominator != 1:
        raise ValueError(f"is {float(exact):.10g} bytes, not a whole number of bytes: give one, e.g. 1572864 or "
                         f"1.5MiB (units: {UNITS})")
    return int(exact)


def _parse_bytes(value, source: str, allow_off: bool = False, allow_zero: bool = False, least: int = 1) -> int | None:
    """``value`` (an int, or a string :func:`parse_size` reads) in bytes; ``None`` for ``off`` where ``allow_off``.
    Raises :class:`ConfigError` for a malformed size, a negative one, 0 unless allowed, and one below ``least``
    besides 0."""
    if allow_off and (value is None or (isinstance(value, str) and value.strip().lower() == "off")):
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        try:
            number = parse_size(value)
        except ValueError as exc:
            off = "; or 'off'" if allow_off else ""
            raise ConfigError(f"{source}={value!r} {exc}{off}") from None
    if number < (0 if allow_off or allow_zero else 1):
        raise ConfigError(f"{source}={value!r} must be {'at least 0' if allow_off or allow_zero else 'positive'}: give "
                          f"a size, e.g. '16MiB' (units: {UNITS})")
    if 0 < number < least:
        zero = " (or 0)" if allow_off or allow_zero else ""
        raise ConfigError(
            f"{source}={value!r} is below the least size offload_shim takes from the environment, {least} bytes "
            f"({least >> 10}KiB){zero}: a number without its unit? Give the unit, e.g. '16MiB' (units: {UNITS})"
        )
    return number


def _log_level(raw: str) -> int:
    level = LOG_LEVELS.get(raw.strip().lower())
    if level is None:
        raise ConfigError(f"{ENV_LOG}={raw!r} is not a log level: use one of {sorted(LOG_LEVELS)} (case-insensitive)")
    return level


def _size_reader(name: str, **kinds):
    return lambda raw: _parse_bytes(raw, name, least=MIN_SIZE_BYTES, **kinds)


def _flag_reader(name: str):
    return lambda raw: parse_flag(name, {name: raw})


# Each variable: how its value is read (raising ConfigError for a malformed one), and its default, in words, as
# the warning for a malformed value names it.
_READERS = {
    ENV_ENABLE: (_flag_reader(ENV_ENABLE), offload_shim_names.SWITCH_DEFAULT),
    ENV_STAGING_DEVICE: (lambda raw: _parse_device(raw, ENV_STAGING_DEVICE),
                         "unset (the group's bound device, else the current accelerator device)"),
    ENV_ALWAYS_STAGE: (_flag_reader(ENV_ALWAYS_STAGE), "false"),
    ENV_CHUNK_BYTES: (_size_reader(ENV_CHUNK_BYTES), f"{DEFAULT_CHUNK_BYTES >> 20}MiB ({DEFAULT_CHUNK_BYTES} bytes)"),
    ENV_ROUTE_MIN_BYTES: (_size_reader(ENV_ROUTE_MIN_BYTES, allow_off=True), f"{DEFAULT_ROUTE_MIN_BYTES >> 20}MiB ({DEFAULT_ROUTE_MIN_BYTES} bytes)"),
    ENV_HOST_STAGING: (_flag_reader(ENV_HOST_STAGING), "true"),
    ENV_GRAPHS: (_flag_reader(ENV_GRAPHS), "true"),
    ENV_REGISTER_BYTES: (_size_reader(ENV_REGISTER_BYTES, allow_zero=True), "0 (nothing registered)"),
    ENV_LOG: (_log_level, "unset (nothing printed)"),
    ENV_SUMMARY: (_flag_reader(ENV_SUMMARY), "false (no table at exit)"),
}
assert tuple(_READERS) == ENVIRONMENT
DEFAULTS = {name: default for name, (_, default) in _READERS.items()}  # each variable's default, in words


@dataclasses.dataclass(frozen=True)
class Environment:
    """What the environment gives: each variable's value, or its default where it is unset, empty, blank or
    malformed.

    Attributes:
        enabled: ``OFFLOAD_SHIM``: ``True``, ``False``, or ``None`` (unset, empty or malformed).
        settings: the settings the other variables give.
        log_level: the ``logging`` level ``OFFLOAD_SHIM_LOG`` asks for; ``None``: nothing printed.
        malformed: one sentence per malformed variable, in the order of :data:`ENVIRONMENT`: the variable, the value
            given, what it takes, and the default used instead.
    """

    enabled: bool | None
    settings: Settings
    log_level: int | None
    malformed: tuple[str, ...]


def read_environment(environ=os.environ) -> Environment:
    """Read every variable of :data:`ENVIRONMENT`. Never raises: a malformed value leaves that variable at its
    default, and :attr:`Environment.malformed` says so."""
    values, malformed = {}, []
    for name, (read, default) in _READERS.items():
        raw = environ.get(name)
        if raw is None or not raw.strip():
            continue
        try:
            values[name] = read(raw)
        except ConfigError as exc:
            malformed.append(offload_shim_names.malformed(name, str(exc), default))
    chosen = Settings(
        staging_device=values.get(ENV_STAGING_DEVICE),
        always_stage=values.get(ENV_ALWAYS_STAGE, False),
        chunk_bytes=values.get(ENV_CHUNK_BYTES, DEFAULT_CHUNK_BYTES),
        route_min_bytes=values.get(ENV_ROUTE_MIN_BYTES, DEFAULT_ROUTE_MIN_BYTES),
        summary_at_exit=values.get(ENV_SUMMARY, False),
        host_staging=values.get(ENV_HOST_STAGING, True),
        graphs=values.get(ENV_GRAPHS, True),
        register_bytes=values.get(ENV_REGISTER_BYTES, 0),
    )
    return Environment(values.get(ENV_ENABLE), chosen, values.get(ENV_LOG), tuple(malformed))


def settings_from_environment(environ=os.environ) -> Settings:
    """Settings as the environment gives them (:func:`read_environment`: a variable unset, empty, blank or
    malformed gives its default)."""
    return read_environment(environ).settings


_settings = Settings()
_forgetting: list = []  # (on_change)


def settings() -> Settings:
    """The settings in force (an immutable snapshot)."""
    return _settings


def configure(**changes) -> Settings:
    """Change settings; names not given keep their value.

    Args:
        staging_device (str | torch.device | None): device to stage through (see :class:`Settings`).
        always_stage (bool): stage CPU tensors even where the group serves CPU.
        chunk_bytes (int | str): chunk size of the staging pipeline, e.g. ``32 << 20`` or ``"32MiB"``.
        route_min_bytes (int | str | None): smallest CPU tensor routed off Gloo; ``None`` or ``"off"``: never.
        summary_at_exit (bool): print the table of staged calls at exit, on rank 0.
        host_staging (bool): stage accelerator tensors a group does not serve for a collective through the host.
        graphs (bool): replay small synchronous in-place calls on NCCL groups from captured CUDA graphs.
        register_bytes (int | str): the most of the caller's pageable host memory registered with the accelerator,
            e.g. ``"4GiB"``; ``0``: none, the default (see ``OFFLOAD_SHIM_REGISTER_BYTES``).

    Returns:
        The settings that were in force before, so that ``configure(**dataclasses.asdict(old))`` restores them.

    Raises:
        ConfigError: an unknown name or a malformed value; nothing is changed then.
    """
    known = {f.name for f in dataclasses.fields(Settings)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown}; known: {sorted(known)}")
    if "staging_device" in changes:
        changes["staging_device"] = _parse_device(changes["staging_device"], "staging_device")
    if "chunk_bytes" in changes:
        changes["chunk_bytes"] = _parse_bytes(changes["chunk_bytes"], "chunk_bytes")
    if "register_bytes" in changes:
        changes["register_bytes"] = _parse_bytes(changes["register_bytes"], "register_bytes", allow_zero=True)
    if "route_min_bytes" in changes:
        changes["route_min_bytes"] = _parse_bytes(changes["route_min_bytes"], "route_min_bytes", allow_off=True)
    for name, variable in (
        ("always_stage", ENV_ALWAYS_STAGE), ("summary_at_exit", ENV_SUMMARY), ("host_staging", ENV_HOST_STAGING),
        ("graphs", ENV_GRAPHS),
    ):
        if name in changes and not isinstance(changes[name], bool):
            raise ConfigError(
                f"{name}={changes[name]!r} is not a boolean: use True or False "
                f"({variable} in the environment takes {sorted(_TRUE)} or {sorted(_FALSE)})"
            )
    return _replace(lambda previous: dataclasses.replace(previous, **changes))


def _replace(make) -> Settings:
    """Put ``make(settings in force)`` in force, and tell the caches of :func:`on_change`; the settings before."""
    global _settings
    with state.config_lock:
        previous = _settings
        _settings = make(previous)
    for forget in _forgetting:
        forget()
    return previous


def on_change(forget) -> None:
    """Have :func:`configure` and :func:`load_environment` call ``forget()`` after every change: a cache of answers
    decided under the settings then in force (the served path's), which then needs no settings read of its own."""
    _forgetting.append(forget)


def unknown_variables(environ=os.environ) -> list[str]:
    """Sentences naming each variable of the environment that looks like one of :data:`ENVIRONMENT` but is none of
    them (a misspelt name is otherwise ignored without a word), with the nearest known name
    (``offload_shim_names.look_alikes``, which the start-up module also runs while the shim is off)."""
    return offload_shim_names.look_alikes(environ)


def inert_settings(current: Settings, accelerator_available: bool) -> list[str]:
    """Settings in ``current`` that cannot act on collectives in a process whose accelerator is (not) available,
    each as a sentence naming the setting as the environment and :func:`configure` spell it, and the fix."""
    if current.always_stage and current.staging_device is None and not accelerator_available:
        return [
            f"{ENV_ALWAYS_STAGE} (always_stage) has no effect on collectives here: there is no device to stage "
            f"through (no accelerator is available and {ENV_STAGING_DEVICE}, staging_device, is unset); set "
            f"{ENV_STAGING_DEVICE}=cpu to run the staging path through host copies (registered communicators "
            f"stage through their own device either way)"
        ]
    return []


def load_environment() -> Environment:
    """Replace the settings with those the environment gives (:func:`read_environment`, which it returns: its
    ``malformed`` sentences are for start-up to warn of). Never raises."""
    read = read_environment()
    _replace(lambda _: read.settings)
    return read
