"""offload_shim's start-up entry points, kept outside the ``offload_shim`` package: importing anything inside the
package runs its ``__init__``, which imports torch and installs the wrappers, and these two must not.

* :func:`autoload`, entry point of group ``torch.backends``: switches the shim on at ``import torch``.
* :func:`main`, the ``offload-shim`` command: ``run`` sets ``OFFLOAD_SHIM=1`` and executes a command without
  importing torch; ``info`` imports the package and reports (a malformed setting becomes a message, not a
  traceback).
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


def main(argv=None) -> int:
    """``offload-shim run [--] CMD [ARG...]`` or ``offload-shim info`` (see ``offload_shim._cli``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:
        return run_command(argv[1:])
    try:
        with warnings.catch_warnings():  # a malformed variable is reported below, in one line (this process is ours)
            warnings.simplefilter("ignore", RuntimeWarning)
            from offload_shim import _cli
    except ValueError as exc:  # offload_shim.ConfigError: a malformed OFFLOAD_SHIM* variable
        print(f"offload-shim: {exc}", file=sys.stderr)
        return 2
    return _cli.main(argv)
