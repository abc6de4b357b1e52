"""``offload-shim info`` (the command itself, its parser and ``run``, live in ``offload_shim_boot``), also
``python -m offload_shim``.

    offload-shim info                 versions, accelerator, settings, start-up entry point, what is wrapped
    offload-shim run [--] CMD [ARG...]  run CMD with OFFLOAD_SHIM=1, e.g. offload-shim run torchrun --nproc_per_node 2 train.py
    offload-shim --version | --help | run --help   (import neither torch nor the package)
"""

from __future__ import annotations

import os
import sys


def _info() -> int:
    import importlib.metadata

    import torch
    import wrapt

    import offload_shim
    from offload_shim import _config

    accelerator = torch.accelerator.current_accelerator()
    entry_points = [e.value for e in importlib.metadata.entry_points(group="torch.backends") if e.name == "offload_shim"]
    rows = [
        ("offload_shim", offload_shim.__version__),
        ("torch", torch.__version__),
        ("wrapt", getattr(wrapt, "__version__", "?")),
        ("accelerator", f"{accelerator} (available: {torch.accelerator.is_available()}, devices: {torch.accelerator.device_count()})"),
        ("torch.distributed available", torch.distributed.is_available()),
        ("torch.backends entry point", entry_points or "not registered (is the package installed?)"),
        (_config.ENV_ENABLE, os.environ.get(_config.ENV_ENABLE, "<unset>")),
        ("settings", offload_shim.settings()),
        ("installed (import offload_shim)", offload_shim.is_installed()),
        ("wrapped so far", ", ".join(sorted(offload_shim.wrapped_functions())) or "-"),
        ("", "(DTensor and functional collectives are wrapped when torch imports their modules)"),
    ]
    for key, value in rows:
        print(f"{key:30s} {value}")
    return 0


def info() -> int:
    """``offload-shim info``: a malformed setting is reported in one line (exit status 2), as
    ``offload_shim_boot.main`` reports it when importing the package raises."""
    from offload_shim import _config

    try:
        _config.parse_flag(_config.ENV_ENABLE)
        _config.settings_from_environment()
        _config.log_level_from_environment()
    except _config.ConfigError as exc:
        print(f"offload-shim: {exc}", file=sys.stderr)
        return 2
    return _info()
