"""Configuration: the environment variables offload_shim reads and the settings they fill.

Every environment variable offload_shim reads is named here, once.

``OFFLOAD_SHIM`` (:data:`ENV_ENABLE`)
    Switches the shim at start-up. True: ``1``, ``true``, ``yes``, ``on``; false: ``0``, ``false``, ``no``,
    ``off`` (any case, surrounding spaces ignored). Unset or empty: ``import torch`` leaves torch alone, and
    ``import offload_shim`` installs the wrappers. False: nothing is installed by any activation path,
    ``import offload_shim`` included. Any other value is rejected with :class:`ConfigError`.
``OFFLOAD_SHIM_STAGING_DEVICE`` (:data:`ENV_STAGING_DEVICE`)
    The device to stage through, e.g. ``cuda:1``. Unset: the device bound to the process group
    (``ProcessGroup.bound_device_id``), else the current device of ``torch.accelerator``.
``OFFLOAD_SHIM_ALWAYS_STAGE`` (:data:`ENV_ALWAYS_STAGE`)
    Stage CPU tensors even when the group serves CPU itself. For tests and debugging: together with
    ``OFFLOAD_SHIM_STAGING_DEVICE=cpu`` it runs the whole staging path (real copies, the collective on
    the staged tensor, the copy back) on a CPU-only machine over a Gloo group.

Environment variables are read when offload_shim is imported; :func:`configure` changes the settings later.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import torch

ENV_ENABLE = "OFFLOAD_SHIM"
ENV_STAGING_DEVICE = "OFFLOAD_SHIM_STAGING_DEVICE"
ENV_ALWAYS_STAGE = "OFFLOAD_SHIM_ALWAYS_STAGE"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class ConfigError(ValueError):
    """A configuration value (environment variable or :func:`configure` argument) is malformed."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """The settings in force.

    Attributes:
        staging_device: device to stage through; ``None`` picks the group's bound device, else the current
            accelerator device.
        always_stage: stage CPU tensors even where the group serves CPU (tests, debugging).
    """

    staging_device: torch.device | None = None
    always_stage: bool = False


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
    raise ConfigError(
        f"{name}={raw!r} is not a boolean: use one of {sorted(_TRUE)} to enable or "
        f"{sorted(_FALSE)} to disable (case-insensitive)"
    )


def _parse_device(value, source: str) -> torch.device | None:
    if value is None or isinstance(value, torch.device):
        return value
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{source}={value!r} is not a device: give a string such as 'cuda:0' or 'cpu'")
    try:
        return torch.device(value.strip())
    except RuntimeError as exc:
        raise ConfigError(f"{source}={value!r} is not a device: {exc}") from None


def settings_from_environment(environ=os.environ) -> Settings:
    """Settings as the environment gives them. Raises :class:`ConfigError` for a malformed value."""
    return Settings(
        staging_device=_parse_device(environ.get(ENV_STAGING_DEVICE) or None, ENV_STAGING_DEVICE),
        always_stage=bool(parse_flag(ENV_ALWAYS_STAGE, environ)),
    )


_lock = threading.Lock()
_settings = Settings()


def settings() -> Settings:
    """The settings in force (an immutable snapshot)."""
    return _settings


def configure(**changes) -> Settings:
    """Change settings; names not given keep their value.

    Args:
        staging_device (str | torch.device | None): device to stage through (see :class:`Settings`).
        always_stage (bool): stage CPU tensors even where the group serves CPU.

    Returns:
        The settings that were in force before, so that ``configure(**dataclasses.asdict(old))`` restores them.

    Raises:
        ConfigError: an unknown name or a malformed value; nothing is changed then.
    """
    global _settings
    known = {f.name for f in dataclasses.fields(Settings)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown}; known: {sorted(known)}")
    if "staging_device" in changes:
        changes["staging_device"] = _parse_device(changes["staging_device"], "staging_device")
    if "always_stage" in changes and not isinstance(changes["always_stage"], bool):
        raise ConfigError(f"always_stage={changes['always_stage']!r} is not a bool")
    with _lock:
        previous = _settings
        _settings = dataclasses.replace(previous, **changes)
    return previous


def load_environment() -> None:
    """Replace the settings with those the environment gives. Raises :class:`ConfigError`."""
    global _settings
    new = settings_from_environment()
    with _lock:
        _settings = new
