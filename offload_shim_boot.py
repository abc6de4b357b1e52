"""offload_shim's start-up, kept outside the ``offload_shim`` package: importing anything inside the package runs
its ``__init__``, which imports torch and installs the wrappers, and this module must not. It imports nothing at load.

* :func:`autoload`, called by the ``torch.backends`` entry point (``offload_shim_autoload``) at ``import torch``:
  switches the shim on where ``OFFLOAD_SHIM`` asks, except in torchrun's own process, which runs no collective.
* :func:`activate`, what every activation path ends in (the entry point and the sitecustomize drop-in): imports
  the package and, where the shim was asked for and is not installed, warns once per process with the cause and
  the fix (a folder shadowing the package, wrapt missing, no torch.distributed), at the program's line that
  imported torch. A malformed ``OFFLOAD_SHIM`` is read as unset: :func:`autoload` switches nothing on, and says so.

The command line is ``offload_shim_cli``.
"""

import os
import sys
import warnings

_warned = False  # activate() warns once per process, whichever paths asked for the shim


def autoload() -> None:
    """torch loads this at the end of ``import torch`` in every interpreter where offload_shim is installed, so it
    must cost nothing and never fail: while ``OFFLOAD_SHIM`` is unset or empty it returns at once and imports
    nothing; in torchrun's own process too (:func:`in_torchrun_launcher`); a malformed value is read as unset, with
    a warning (importing the package would install it); otherwise it calls :func:`activate`."""
    value = os.environ.get("OFFLOAD_SHIM", "")
    if in_torchrun_launcher():
        return
    if not value.strip():
        warn_look_alikes()
        return
    import offload_shim_names

    if value.strip().lower() in offload_shim_names.TRUE + offload_shim_names.FALSE:
        activate(f"OFFLOAD_SHIM={value!r}")
        return
    # Malformed: read as its default, unset, so nothing is switched on here (importing the package would install
    # it). Not where the package switches on all the same and warns of it itself: while it is being imported, or
    # where the drop-in (which installs unless OFFLOAD_SHIM is false) is this process's sitecustomize.
    if "offload_shim" in sys.modules or hasattr(sys.modules.get("sitecustomize"), "_offload_shim_activate"):
        return
    global _warned
    if not _warned:
        _warned = True
        problem = offload_shim_names.not_a_boolean("OFFLOAD_SHIM", value)
        warn_at_program("offload_shim is not enabled: "
                        + offload_shim_names.malformed("OFFLOAD_SHIM", problem, offload_shim_names.SWITCH_DEFAULT))
    warn_look_alikes()


def warn_look_alikes() -> None:
    """Where ``OFFLOAD_SHIM`` is unset (the shim off): warn about each variable that looks like one of offload_shim's
    (``offload_shim_names.look_alikes``), at the program's line that imported torch; a misspelt switch would leave the shim off
    without a word. Not where the shim switches on all the same, and names them itself: while ``offload_shim`` is
    being imported (its import imports torch), or where the drop-in is this process's ``sitecustomize``."""
    if "offload_shim" in sys.modules or hasattr(sys.modules.get("sitecustomize"), "_offload_shim_activate"):
        return
    import offload_shim_names

    for sentence in offload_shim_names.look_alikes():
        warn_at_program(f"offload_shim: {sentence}; offload_shim is off (OFFLOAD_SHIM is unset)")


_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")


def in_torchrun_launcher() -> bool:
    """Whether this process is torchrun's own (``torchrun ...``, ``python -m torch.distributed.run ...``), which
    imports torch, inherits ``OFFLOAD_SHIM``, and runs no collective: the shim is not switched on there, so it
    neither warns nor logs twice beside the ranks it starts (each of which is a process of its own)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    if len(argv) > 1 and os.path.basename(argv[1]) == "torchrun":
        return True
    return any(flag == "-m" and module in _LAUNCHERS for flag, module in zip(argv[1:], argv[2:]))


def activate(asked_by: str) -> None:
    """Import offload_shim, which installs the wrappers unless ``OFFLOAD_SHIM`` is false. Never raises: where the
    shim was asked for (``asked_by`` says by what, e.g. ``"OFFLOAD_SHIM='1'"``) and is not installed afterwards, a
    ``RuntimeWarning`` names the cause and the fix, once per process whichever paths call this."""
    try:
        reason = _not_a_package() if "offload_shim" not in sys.modules else None
        if reason is None:
            with warnings.catch_warnings(record=True) as given:
                warnings.simplefilter("always")
                import offload_shim
            _give_again(given)
            reason = not_installed_reason(offload_shim)
    except Exception as exc:  # never break `import torch`
        reason = import_failure(exc)
    global _warned
    if reason and not _warned:
        _warned = True
        warn_at_program(f"offload_shim is not enabled: {reason} [asked for by {asked_by}]")


def _give_again(given) -> None:
    """Warn again what importing the package warned (recorded): a warning located at this module's line (the
    package's start-up warnings point at the line that imported it) at the program's line instead; any other where
    it was, through the filters in force."""
    for each in given:
        if each.filename == __file__:
            warn_at_program(str(each.message), each.category)
        else:
            warnings.warn_explicit(each.message, each.category, each.filename, each.lineno, source=each.source)


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
    import offload_shim_names

    if module.is_installed() or os.environ.get("OFFLOAD_SHIM", "").strip().lower() in offload_shim_names.FALSE:
        return None
    import torch.distributed

    if not torch.distributed.is_available():
        return "this torch has no distributed support (torch.distributed.is_available() is False): nothing to wrap"
    return None  # installed, then uninstall()ed: the caller's own choice


def warn_at_program(message: str, category: type = RuntimeWarning) -> None:
    """A warning (``RuntimeWarning`` unless ``category``) located at the program's own line that led here (its ``import torch``): the first frame
    outside offload_shim's start-up, the drop-in, torch and the import system; not at a line of ours, which the
    warning would echo as its source."""
    frame = sys._getframe(1)
    while frame.f_back is not None and _not_the_program(frame):
        frame = frame.f_back
    registry = frame.f_globals.setdefault("__warningregistry__", {})
    # (no module_globals: for `python -c` they name a loader that raises when asked for the source line)
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__"), registry=registry)


def _not_the_program(frame) -> bool:
    name = frame.f_globals.get("__name__") or ""
    return (
        name.startswith(("offload_shim", "torch.", "importlib."))
        or name in ("torch", "importlib", "sitecustomize")
        or frame.f_code.co_filename.startswith("<frozen importlib")
    )
