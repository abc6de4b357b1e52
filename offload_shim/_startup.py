"""Start-up activation: the three ways the shim switches itself on.

* ``import offload_shim``: :func:`activate_on_import` installs the wrappers unless ``OFFLOAD_SHIM`` is false.
* ``OFFLOAD_SHIM=1`` with the package installed: torch runs the ``torch.backends`` entry points at the end of
  ``import torch`` (``torch._import_device_backends``, the hook Ascend's torch_npu uses), in every fresh
  interpreter, so every rank torchrun starts. The entry point, ``offload_shim_autoload.autoload``, is a
  top-level module that imports nothing of offload_shim while ``OFFLOAD_SHIM`` is unset, and that stays beside
  the metadata in every install layout so that ``import torch`` never breaks (see that module).
* ``sitecustomize_template.py``: imports offload_shim once torch is imported, unless ``OFFLOAD_SHIM`` is false.
"""

from __future__ import annotations

import logging
import sys
import warnings

from offload_shim import _config

_log = logging.getLogger("offload_shim")
# Whether activate_on_import() ran in this process: importlib.reload(offload_shim) runs the package's code again,
# and must not reread the environment over configure()'s settings or install what uninstall() removed.
_activated = False


def activate_on_import(install, is_installed) -> bool:
    """Read the environment and ``install()`` the wrappers unless ``OFFLOAD_SHIM`` is false (the package's own
    ``install`` and ``is_installed``, handed in by its ``__init__``: this module imports nothing of it).

    Runs once per process: later calls (``importlib.reload(offload_shim)``) change nothing. Never raises for the
    environment: a malformed variable takes its default, and this process warns of it
    (``offload_shim._config.read_environment``).

    Returns:
        Whether the wrappers are installed.
    """
    global _activated
    if _activated:
        return is_installed()
    _activated = True
    try:
        return _activate(install)
    finally:  # at the line that imported the package: this function's caller is its __init__ (the import
        # system's frames between that line and the __init__ are skipped)
        for message in _to_warn:
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        _to_warn.clear()


def run_as_the_command() -> bool:
    """Whether this process is ``python -m offload_shim ...``, whose ``info`` and ``doctor`` report the environment
    themselves, in their output (the package is imported before its ``__main__`` runs)."""
    argv = getattr(sys, "orig_argv", [])
    return sys.argv[:1] == ["-m"] and any(
        flag == "-m" and module == "offload_shim" for flag, module in zip(argv[1:], argv[2:]))


def _activate(install) -> bool:
    read = _config.load_environment()  # (the settings apply to a later install() even while switched off)
    if not run_as_the_command():
        for sentence in read.malformed:
            _warn(f"offload_shim: {sentence}")
    if read.enabled is False:
        _log.debug("offload_shim: %s is false; wrappers not installed", _config.ENV_ENABLE)
        return False
    _log_to_stderr(read.log_level)
    import torch

    # Settings that would be ignored without a word: misspelt names, and those that cannot act here.
    ignored = _config.unknown_variables() + _config.inert_settings(_config.settings(), torch.accelerator.is_available())
    for message in ignored:
        _warn(f"offload_shim: {message}")
    install()
    return True


def _warn(message: str) -> None:
    """Keep a start-up warning for :func:`activate_on_import` to give once activation is done, at the line that
    imported the package (the start-up module moves it to the program's line where that line is its own)."""
    _to_warn.append(message)


_to_warn: list[str] = []


def _log_to_stderr(level: int | None) -> None:
    """Send the ``offload_shim`` logger's records from ``level`` on to standard error (``OFFLOAD_SHIM_LOG``)."""
    if level is None:
        return
    import os

    handler = logging.StreamHandler()
    rank = os.environ.get("RANK", "").strip()  # torchrun sets it in each rank; a process started otherwise has none
    handler.setFormatter(logging.Formatter(f"[{f'rank {rank} ' if rank else ''}pid {os.getpid()}] %(message)s"))
    _log.addHandler(handler)
    _log.setLevel(level)
