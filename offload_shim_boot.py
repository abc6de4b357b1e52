"""offload_shim's start-up entry points, kept outside the ``offload_shim`` package: importing anything inside the
package runs its ``__init__``, which imports torch and installs the wrappers, and these two must not.

* :func:`autoload`, entry point of group ``torch.backends``: switches the shim on at ``import torch``.
* :func:`main`, the ``offload-shim`` command: ``run`` sets ``OFFLOAD_SHIM=1`` and executes a command without
  importing torch, and so do ``--help``, ``run --help`` and ``--version``; ``info`` imports the package and reports
  (a malformed setting becomes a message, not a traceback).
"""

import os
import sys
import warnings


def autoload() -> None:
    """torch loads this at the end of ``import torch`` in every interpreter where offload_shim is installed, so it
    must cost nothing and never fail: while ``OFFLOAD_SHIM`` is unset or empty it returns at once and imports
    nothing; otherwise it imports offload_shim, which installs the wrappers when the value is true and nothing
    when it is false. A malformed value, or any failure, becomes a warning: ``import torch`` goes on without the
    shim."""
    if not os.environ.get("OFFLOAD_SHIM", "").strip():
        return
    try:
        import offload_shim  # noqa: F401  (installs unless OFFLOAD_SHIM is false)
    except Exception as exc:  # never break `import torch`
        warnings.warn(f"offload_shim is not enabled: {exc}", RuntimeWarning, stacklevel=2)


def run_command(command: list) -> int:
    """Execute ``command`` (an argv list, optionally after ``--``) with ``OFFLOAD_SHIM=1``; returns only on error."""
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("offload-shim run: give a command, e.g. offload-shim run torchrun --nproc_per_node 2 train.py",
              file=sys.stderr)
        return 2
    os.environ["OFFLOAD_SHIM"] = "1"
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"offload-shim run: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127


RUN_USAGE = "offload-shim run [--] CMD [ARG...]"


def parser():
    """The command line's parser. Building it and printing help or the version import neither torch nor the
    ``offload_shim`` package (``run`` and ``--help`` stay cheap, and work where torch is broken)."""
    import argparse

    top = argparse.ArgumentParser(prog="offload-shim", description="Stage CPU tensors of collectives through the accelerator.")
    top.add_argument("--version", action="version", version=f"offload-shim {_version()}")
    sub = top.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="show versions, accelerator, settings and the start-up entry point")
    run = sub.add_parser(
        "run", usage=RUN_USAGE, help="run a command with OFFLOAD_SHIM=1",
        description="Run CMD with OFFLOAD_SHIM=1 in its environment, e.g. offload-shim run torchrun "
        "--nproc_per_node 2 train.py. Everything after run (or after --) is the command; -h/--help right after "
        "run prints this.",
    )
    run.add_argument("argv", nargs="*", metavar="CMD [ARG...]", help="the command and its arguments")
    return top


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("offload_shim")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (not installed)"


def main(argv=None) -> int:
    """``offload-shim run [--] CMD [ARG...]`` or ``offload-shim info`` (see ``offload_shim._cli``); ``--help``,
    ``run --help`` and ``--version`` print and exit 0."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"] and argv[1:2] not in (["-h"], ["--help"]):
        return run_command(argv[1:])
    try:
        parser().parse_args(argv)  # help, the version and usage errors, before torch is imported
    except SystemExit as stop:  # argparse's: 0 after help or the version, 2 for a usage error
        return stop.code if isinstance(stop.code, int) else 2
    try:
        with warnings.catch_warnings():  # a malformed variable is reported below, in one line (this process is ours)
            warnings.simplefilter("ignore", RuntimeWarning)
            from offload_shim import _cli
    except ValueError as exc:  # offload_shim.ConfigError: a malformed OFFLOAD_SHIM* variable
        print(f"offload-shim: {exc}", file=sys.stderr)
        return 2
    return _cli.info()
