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

        warnings.warn(
            f"offload_shim is not enabled: its start-up module cannot run ({type(exc).__name__}: {exc}); the "
            f"installation in this environment ({sys.executable}) is broken or half removed: reinstall offload_shim, "
            f"or pip uninstall offload_shim [asked for by OFFLOAD_SHIM={value!r}]",
            RuntimeWarning,
            stacklevel=2,
        )
