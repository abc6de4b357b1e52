"""offload_shim: collectives on CPU tensors over process groups that only have an accelerator backend.

FSDP2 CPU offload, optimizer offload and CPU-side state dicts leave tensors on the CPU. On a process group with
only NCCL (or HCCL, XCCL) a collective on such a tensor fails with ``RuntimeError: No backend type associated
with device type cpu``. With the shim installed, the collective is staged instead: the tensor is copied to the
accelerator (pinned, non-blocking), the collective runs there on the group's own backend, and the result comes
back to where the caller expects it, with the same semantics and the same bits.

Importing this package installs the wrappers, unless ``OFFLOAD_SHIM`` is false (see ``offload_shim._config``
for every environment variable). Public API: :func:`install`, :func:`uninstall`, :func:`is_installed`,
:func:`configure`, :func:`settings`, :func:`wrapped_functions`, :func:`release_buffers`,
:func:`register_communicator`, :func:`staging_counters`, :func:`reset_staging_counters`, :class:`StagingError`,
:class:`ConfigError`.
"""

from __future__ import annotations

__version__ = "0.2.0"

import logging


def _require(name: str, how: str) -> None:
    """Import ``name``, or say that offload_shim needs it and how to install it (not a bare ModuleNotFoundError)."""
    import sys

    try:
        __import__(name)
    except ModuleNotFoundError as missing:
        if missing.name != name:
            raise
        raise ModuleNotFoundError(
            f"offload_shim requires {name}, which is not installed in this environment ({sys.executable}): {how}",
            name=name,
        ) from None


_require("torch", "pip install torch (https://pytorch.org/get-started/locally/ gives the command for your accelerator)")
_require("wrapt", "pip install wrapt")

from offload_shim import _counters, _groups, _kernels, _patching, _registration, _replay, _state
from offload_shim._communicators import register_communicator
from offload_shim._config import ConfigError, Settings, configure, settings
from offload_shim._counters import reset_staging_counters, staging_counters
from offload_shim._devices import StagingError
from offload_shim._execute import release_buffers

__all__ = [
    "ConfigError",
    "Settings",
    "StagingError",
    "configure",
    "install",
    "is_installed",
    "register_communicator",
    "release_buffers",
    "reset_staging_counters",
    "settings",
    "staging_counters",
    "uninstall",
    "wrapped_functions",
]

if not logging.getLogger("offload_shim").handlers:  # (once: importlib.reload(offload_shim) runs this again)
    logging.getLogger("offload_shim").addHandler(logging.NullHandler())

# Public exceptions under their public path: tracebacks print offload_shim.StagingError, and pickles (errors sent
# between processes) name what users import.
StagingError.__module__ = ConfigError.__module__ = __name__


def _targets():
    from offload_shim import _wrappers

    return _wrappers.TARGETS


def install() -> None:
    """Install the wrappers: the ``torch.distributed`` collectives now (under every name that holds them), the
    functional collectives now or when torch first imports their module, the ``CPU`` kernels of the collective ops
    that compiled code, the functional collectives and DTensor run, and registered communicators; and the table of staged calls
    at exit, printed where the settings ask for it then (``summary_at_exit``). Installing twice changes nothing.
    Does nothing where ``torch.distributed`` is unavailable."""
    import torch
    import torch.distributed

    if not torch.distributed.is_available():
        logging.getLogger("offload_shim").info("offload_shim: torch.distributed is unavailable; nothing installed")
        return
    targets = _targets()  # (imported before the lock: a module's post-import hook takes it)
    with _state.state.patching_lock:  # one install or uninstall at a time, whole: never half of each
        _patching.install(targets)
        _replay.prune()  # captures of groups destroyed while the shim was not installed
        _groups.prune()  # and their served-path answers
        _kernels.install()
    _counters.register_summary_at_exit()
    logging.getLogger("offload_shim").info(
        "offload_shim %s: installed (torch %s, settings %s)", __version__, torch.__version__, settings()
    )


def uninstall() -> None:
    """Remove the wrappers: the exact original objects are bound again under every name where a wrapper was
    (modules imported while the shim was installed included), and the caller's storages that staging registered
    (``register_bytes``) are unregistered, once the copies queued on them have run. Removing twice changes
    nothing."""
    with _state.state.patching_lock:
        _patching.uninstall()
        _kernels.uninstall()
    _registration.unregister_all()  # (the caller's storages pageable again, as before the shim)


def is_installed() -> bool:
    """Whether the wrappers are installed."""
    return _patching.is_installed()


def wrapped_functions() -> dict:
    """The wrappers in place now, by the dotted name of the torch function each wraps."""
    return _patching.applied_wrappers()


from offload_shim import _startup  # noqa: E402

_startup.activate_on_import(install, is_installed)
