"""Command line: ``offload-shim`` (``offload_shim_boot.main``, which runs ``run`` without importing torch), or
``python -m offload_shim``.

    offload-shim info                 versions, accelerator, settings, start-up entry point, what is wrapped
    offload-shim run [--] CMD [ARG...]  run CMD with OFFLOAD_SHIM=1, e.g. offload-shim run torchrun --nproc_per_node 2 train.py
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="offload-shim", description="Stage CPU tensors of collectives through the accelerator.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="show versions, accelerator, settings and the start-up entry point")
    run = sub.add_parser("run", help="run a command with OFFLOAD_SHIM=1")
    run.add_argument("argv", nargs=argparse.REMAINDER, help="the command and its arguments")
    args = parser.parse_args(argv)
    if args.command == "info":
        from offload_shim import _config

        try:  # as offload_shim_boot.main reports it when importing the package raises
            _config.parse_flag(_config.ENV_ENABLE)
            _config.settings_from_environment()
        except _config.ConfigError as exc:
            print(f"offload-shim: {exc}", file=sys.stderr)
            return 2
        return _info()
    from offload_shim_boot import run_command

    return run_command(args.argv)
