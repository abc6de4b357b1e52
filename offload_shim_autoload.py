"""offload_shim's ``torch.backends`` entry point, which torch runs at the end of every ``import torch``.

torch turns any exception of an entry point, an ``ImportError`` of its module included, into a ``RuntimeError`` that
breaks ``import torch`` for every program of the environment. So this module, the one the package's metadata names,
is a file of its own that imports nothing at load, and lives beside that metadata in every install layout: a
wheel's, and an editable install's too (the build backend, ``build_backend/offload_shim_build.py``, writes it into
the editable wheel, so it stays when the source tree it points to is deleted). It hands over to
``offload_shim_boot.autoload`` and, where that module is gone or broken, does nothing, or warns once where the shim
was asked for. An editable install's copy shadows the source tree's: a change here reaches it only when the package
is installed again.
"""

import os


def autoload() -> None:
    """Nothing while ``OFFLOAD_SHIM`` is unset or empty and no variable's name holds ``SHIM``; otherwise
    ``offload_shim_boot.autoload()`` (which also names a misspelt switch), or one ``RuntimeWarning`` where that cannot
    run and the shim was asked for. Never raises."""
    value = os.environ.get("OFFLOAD_SHIM", "")
    if not value.strip() and not any("SHIM" in name.upper() for name in os.environ):
        return  # (a variable like the shim's, misspelt, holds SHIM: offload_shim_names.look_alikes names it)
    try:
        import offload_shim_boot

        offload_shim_boot.autoload()
    except Exception as exc:  # a broken or half-removed install: never break `import torch`
        if not value.strip():
            return
        import sys
        import warnings

        frame = sys._getframe(1)  # the program's line that imported torch, not torch's line that runs entry points
        while frame.f_back is not None and (
            (frame.f_globals.get("__name__") or "").split(".")[0] in ("torch", "importlib")
            or frame.f_code.co_filename.startswith("<frozen importlib")
        ):
            frame = frame.f_back
        warnings.warn_explicit(
            f"offload_shim is not enabled: its start-up module cannot run ({type(exc).__name__}: {exc}). What is "
            f"left of offload_shim in this environment ({sys.executable}) is its torch entry point, which torch "
            f"runs at every import torch (an editable install whose clone was deleted leaves it): pip uninstall "
            f"offload_shim removes it, or install offload_shim again [asked for by OFFLOAD_SHIM={value!r}]",
            RuntimeWarning, frame.f_code.co_filename, frame.f_lineno, module=frame.f_globals.get("__name__"),
            registry=frame.f_globals.setdefault("__warningregistry__", {}),
        )
