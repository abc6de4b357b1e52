"""offload_shim's start-up entry points, kept outside the ``offload_shim`` package: importing anything inside the
package runs its ``__init__``, which imports torch and installs the wrappers, and these must not.

* :func:`autoload`, entry point of group ``torch.backends``: switches the shim on at ``import torch``.
* :func:`activate`, what every activation path ends in (the entry point and the sitecustomize drop-in): imports
  the package and, where the shim was asked for and is not installed, warns once per process with the cause and
  the fix (a folder shadowing the package, wrapt missing, no torch.distributed, a malformed setting).
* :func:`main`, the ``offload-shim`` command: ``run`` sets ``OFFLOAD_SHIM=1`` and executes a command without
  importing torch, and so do ``--help``, ``run --help``, ``--version`` and ``dropin``; ``info`` and ``doctor``
  import the package and report (a malformed setting becomes a message, not a traceback).
"""

import os
import sys
import warnings

_FALSE = ("0", "false", "no", "off")  # offload_shim._config's false spellings (that module imports torch)
_warned = False  # activate() warns once per process, whichever paths asked for the shim


def autoload() -> None:
    """torch loads this at the end of ``import torch`` in every interpreter where offload_shim is installed, so it
    must cost nothing and never fail: while ``OFFLOAD_SHIM`` is unset or empty it returns at once and imports
    nothing; otherwise it calls :func:`activate`."""
    value = os.environ.get("OFFLOAD_SHIM", "")
    if value.strip():
        activate(f"OFFLOAD_SHIM={value!r}")


def activate(asked_by: str) -> None:
    """Import offload_shim, which installs the wrappers unless ``OFFLOAD_SHIM`` is false. Never raises: where the
    shim was asked for (``asked_by`` says by what, e.g. ``"OFFLOAD_SHIM='1'"``) and is not installed afterwards, a
    ``RuntimeWarning`` names the cause and the fix, once per process whichever paths call this."""
    try:
        reason = _not_a_package() if "offload_shim" not in sys.modules else None
        if reason is None:
            import offload_shim

            reason = not_installed_reason(offload_shim)
    except Exception as exc:  # never break `import torch`
        reason = import_failure(exc)
    global _warned
    if reason and not _warned:
        _warned = True
        warnings.warn(f"offload_shim is not enabled: {reason} [asked for by {asked_by}]", RuntimeWarning, stacklevel=2)


def _not_a_package() -> str | None:
    """Why what ``import offload_shim`` would find is not a package to import, found without importing it: a
    module file of that name (someone's ``offload_shim.py``, which importing would run) or nothing at all. ``None``
    for a package, or a folder the import system would make a namespace package (:func:`not_installed_reason`)."""
    import importlib.util

    spec = importlib.util.find_spec("offload_shim")
    if spec is None:
        return f"offload_shim is not installed in this environment ({sys.executable}): pip install offload_shim"
    if spec.submodule_search_locations is None:
        return (
            f"'offload_shim' would be imported from {spec.origin}, which is not the offload_shim package (not run): "
            "a module of that name comes first on sys.path; rename it or run from another folder"
        )
    return None


def import_failure(exc: BaseException) -> str:
    """Why ``import offload_shim`` raised ``exc``, and what to do, in one sentence."""
    where = f"this environment ({sys.executable})"
    if isinstance(exc, ModuleNotFoundError) and exc.name in ("wrapt", "torch", "offload_shim"):
        return f"{exc.name} is not installed in {where}: pip install {exc.name}"
    if isinstance(exc, ValueError):  # offload_shim.ConfigError: names the variable and the values it takes
        return str(exc)
    return f"importing offload_shim failed in {where}: {type(exc).__name__}: {exc}"


def not_installed_reason(module) -> str | None:
    """Why the imported ``module`` named ``offload_shim`` has not installed the wrappers, and the fix; ``None``
    where they are installed, or ``OFFLOAD_SHIM`` is false (switched off on purpose)."""
    if getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None  # being imported (its __init__ imports torch, which runs the entry point): it installs itself
    if getattr(module, "__file__", None) is None:
        folders = ", ".join(getattr(module, "__path__", [])) or "?"
        return (
            f"'offload_shim' was imported as an empty namespace package from {folders}: a folder of that name "
            "without __init__.py (usually a clone of the repository) comes before the installed package on "
            "sys.path (the script's folder or the current directory comes first); run from another folder, "
            "rename that one, or reinstall the clone with pip install -e (since offload_shim 0.2.0 that puts it "
            "on sys.path)"
        )
    if not callable(getattr(module, "is_installed", None)):
        return (
            f"'offload_shim' was imported from {module.__file__}, which is not the offload_shim package: a module "
            "of that name comes first on sys.path; rename it or run from another folder"
        )
    if module.is_installed() or os.environ.get("OFFLOAD_SHIM", "").strip().lower() in _FALSE:
        return None
    import torch.distributed

    if not torch.distributed.is_available():
        return "this torch has no distributed support (torch.distributed.is_available() is False): nothing to wrap"
    return None  # installed, then uninstall()ed: the caller's own choice


def run_command(command: list) -> int:
    """Execute ``command`` (an argv list, optionally after ``--``) with ``OFFLOAD_SHIM=1``; returns only on error."""
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("offload-shim run: give a command, e.g. offload-shim run torchrun --nproc_per_node 2 train.py",
              file=sys.stderr)
        return 2
    os.environ["OFFLOAD_SHIM"] = "1"
    if not autoload_enabled():
        print(f"offload-shim run: warning: {AUTOLOAD_OFF}", file=sys.stderr)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"offload-shim run: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127


AUTOLOAD_OFF = (
    "TORCH_DEVICE_BACKEND_AUTOLOAD is not 1, so torch runs no torch.backends entry point and OFFLOAD_SHIM=1 "
    "switches nothing on at import torch; unset it, import offload_shim in the script, or put the drop-in on "
    "PYTHONPATH (offload-shim dropin DIR)"
)


def autoload_enabled() -> bool:
    """Whether torch runs its ``torch.backends`` entry points at ``import torch`` (torch's own test, in
    ``torch._is_device_backend_autoload_enabled``: ``TORCH_DEVICE_BACKEND_AUTOLOAD`` unset or ``1``)."""
    return os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") == "1"


RUN_USAGE = "offload-shim run [--] CMD [ARG...]"


def parser():
    """The command line's parser. Building it and printing help or the version import neither torch nor the
    ``offload_shim`` package (``run``, ``dropin`` and ``--help`` stay cheap, and work where torch is broken)."""
    import argparse

    top = argparse.ArgumentParser(prog="offload-shim", description="Stage CPU tensors of collectives through the accelerator.")
    top.add_argument("--version", action="version", version=f"offload-shim {_version()}")
    sub = top.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="show versions, accelerator, settings and the start-up entry point")
    doctor = sub.add_parser(
        "doctor", help="check that the shim would work here; exit status 1 with the reasons where it would not",
        description="Check that offload_shim would work here: versions, the accelerator, which offload_shim a "
        "script in this directory imports, the start-up entry point and drop-in, the settings and their sources; "
        "under torchrun, on every rank, the default process group's backends, the device types it serves, the "
        "staging device and one all_reduce of a CPU tensor through the shim. Exit status 1 with the reasons "
        "where the shim would not work, 0 otherwise.",
    )
    doctor.add_argument(
        "--backend", help="backend of the default process group made under torchrun (default: the accelerator's "
        "own, e.g. nccl; gloo where there is no accelerator)",
    )
    dropin = sub.add_parser(
        "dropin", help="write the sitecustomize drop-in into DIR",
        description="Write the drop-in (sitecustomize_template.py) as DIR/sitecustomize.py; with DIR on "
        "PYTHONPATH, every Python process switches the shim on when it imports torch, unless OFFLOAD_SHIM is false.",
    )
    dropin.add_argument("directory", metavar="DIR")
    dropin.add_argument("--force", action="store_true", help="replace a different DIR/sitecustomize.py")
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


def write_dropin(directory: str, force: bool = False) -> int:
    """``offload-shim dropin DIR``: copy the installed ``sitecustomize_template.py`` to ``DIR/sitecustomize.py``
    (``DIR`` made if missing), with its bytecode for this Python in ``DIR/__pycache__``. Refuses, exit status 1,
    to replace a different file there unless ``force``."""
    import importlib.util
    import pathlib

    spec = importlib.util.find_spec("sitecustomize_template")  # found, not imported (importing it would arm it)
    if spec is None or spec.origin is None:
        print("offload-shim dropin: sitecustomize_template is not installed with offload_shim", file=sys.stderr)
        return 1
    text = pathlib.Path(spec.origin).read_text()
    target = pathlib.Path(directory) / "sitecustomize.py"
    if target.exists() and target.read_text() != text and not force:
        print(f"offload-shim dropin: {target} exists and differs; the drop-in runs the sitecustomize it shadows "
              "from later on sys.path, so put that one in another directory, or pass --force", file=sys.stderr)
        return 1
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    import py_compile

    # Its bytecode too, for this Python: where the directory is read-only or PYTHONDONTWRITEBYTECODE is set,
    # every start-up would otherwise compile the file again (about 2 ms).
    py_compile.compile(str(target), doraise=True)
    print(f"wrote {target}\nswitch it on with: export PYTHONPATH={target.parent.resolve()}${{PYTHONPATH:+:$PYTHONPATH}}")
    return 0


def main(argv=None) -> int:
    """``offload-shim run [--] CMD [ARG...]``, ``dropin DIR``, ``info`` or ``doctor``; ``--help``, ``run --help``
    and ``--version`` print and exit 0. ``info`` and ``doctor`` import the package: where that fails, one line
    says why (exit status 2 for a malformed setting, 1 otherwise)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"] and argv[1:2] not in (["-h"], ["--help"]):
        return run_command(argv[1:])
    try:
        args = parser().parse_args(argv)  # help, the version and usage errors, before torch is imported
    except SystemExit as stop:  # argparse's: 0 after help or the version, 2 for a usage error
        return stop.code if isinstance(stop.code, int) else 2
    if args.command == "dropin":
        return write_dropin(args.directory, args.force)
    try:
        with warnings.catch_warnings():  # a malformed variable is reported below, in one line (this process is ours)
            warnings.simplefilter("ignore", RuntimeWarning)
            from offload_shim import _cli
    except Exception as exc:
        print(f"offload-shim: {import_failure(exc)}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    return _cli.info() if args.command == "info" else _cli.doctor(args.backend)
