"""Start-up activation: the three ways the shim switches itself on.

* ``import offload_shim``: :func:`activate_on_import` installs the wrappers unless ``OFFLOAD_SHIM`` is false.
* ``OFFLOAD_SHIM=1`` with the package installed: torch runs the ``torch.backends`` entry points at the end of
  ``import torch`` (``torch._import_device_backends``, the hook Ascend's torch_npu uses), in every fresh
  interpreter, so every rank torchrun starts. The entry point, ``offload_shim_boot.autoload``, is a
  top-level module so that loading it imports nothing of offload_shim while ``OFFLOAD_SHIM`` is unset.
* ``sitecustomize_template.py``: imports offload_shim once torch is imported, unless ``OFFLOAD_SHIM`` is false.
"""

from __future__ import annotations

import logging
import warnings

from offload_shim import _config

_log = logging.getLogger("offload_shim")


def activate_on_import() -> bool:
    """Read the environment and install the wrappers unless ``OFFLOAD_SHIM`` is false.

    Returns:
        Whether the wrappers were installed.

    Raises:
        ConfigError: an ``OFFLOAD_SHIM*`` variable is malformed (while ``OFFLOAD_SHIM`` is not false: switched off,
            a malformed other variable is a warning); nothing is installed then.
    """
    enabled = _config.parse_flag(_config.ENV_ENABLE)
    if enabled is False:
        _log.debug("offload_shim: %s is false; wrappers not installed", _config.ENV_ENABLE)
        try:  # the settings still apply to a later install(); switched off, a bad one only warns
            _config.load_environment()
        except _config.ConfigError as exc:
            warnings.warn(f"offload_shim: {exc}; default settings kept", RuntimeWarning, stacklevel=3)
        return False
    _config.load_environment()
    from offload_shim import install

    install()
    return True
