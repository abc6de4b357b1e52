"""offload_shim drop-in for a cluster: a ``sitecustomize.py`` in a directory on PYTHONPATH.

    offload-shim dropin /opt/site            # writes /opt/site/sitecustomize.py (this file)
    export PYTHONPATH=/opt/site${PYTHONPATH:+:$PYTHONPATH}

Every Python process then switches offload_shim on as soon as it imports torch, unless ``OFFLOAD_SHIM`` is false
(0, false, no, off) in its environment. Until torch is imported it costs nothing measurable: it puts one finder
on ``sys.meta_path`` that waits for ``torch`` and imports nothing else (not wrapt, not offload_shim). It never
breaks interpreter start-up or ``import torch``: when the shim cannot switch on (offload_shim or wrapt missing, a
folder shadowing the package, a malformed setting), the process runs without it and one warning says why. Python
imports only one ``sitecustomize`` module; this one runs the ``sitecustomize`` it shadows, from later on
``sys.path``, so that one keeps working.
"""


def _offload_shim_chain_shadowed_sitecustomize():
    # Only what start-up has imported already: the import system's own frozen modules, not importlib's package.
    import os
    import sys

    bootstrap = sys.modules["_frozen_importlib"]
    path_finder = sys.modules["_frozen_importlib_external"].PathFinder
    ours = os.path.realpath(__file__)
    # The first sitecustomize on sys.path after ours that is not this same file (a directory may appear twice,
    # under another spelling or through a link).
    for entry in sys.path:
        spec = path_finder.find_spec("sitecustomize", [entry])
        if spec is None or spec.origin is None or os.path.realpath(spec.origin) == ours:
            continue
        if spec.loader is None:
            return
        module = bootstrap.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            import warnings

            warnings.warn(f"the sitecustomize at {spec.origin} failed: {exc!r}", RuntimeWarning)
        return


class _OffloadShimAfterTorchImport:
    """A ``sys.meta_path`` finder that finds nothing itself: when ``torch`` is first imported, it leaves
    ``sys.meta_path``, lets the other finders find torch, and has torch's loader call :func:`_offload_shim_activate`
    once torch's own code has run (after torch's ``torch.backends`` entry points, offload_shim's among them)."""

    def __init__(self):
        self.finding = False

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or self.finding:
            return None
        import importlib.util
        import sys

        self.finding = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.finding = False
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # no torch here (None: the import fails as it would without us)
        exec_module = spec.loader.exec_module

        def exec_then_activate(module):
            del spec.loader.exec_module  # the loader's own method again (importlib.reload(torch))
            exec_module(module)
            _offload_shim_activate()

        spec.loader.exec_module = exec_then_activate
        return spec


def _offload_shim_activate():
    import os
    import sys
    import warnings

    try:
        import offload_shim_boot
    except ImportError:  # the package is gone and this drop-in was left behind
        argv = getattr(sys, "orig_argv", sys.argv)  # (offload_shim_boot.in_torchrun_launcher's rule, which is gone)
        if (len(argv) > 1 and os.path.basename(argv[1]) == "torchrun") or any(
            flag == "-m" and module in ("torch.distributed.run", "torch.distributed.launch")
            for flag, module in zip(argv[1:], argv[2:])
        ):
            return  # torchrun's own process: each rank it starts says it
        frame = sys._getframe(1)  # the program's line that imported torch, not a line of this file or torch's
        while frame.f_back is not None and (
            (frame.f_globals.get("__name__") or "").split(".")[0] in ("sitecustomize", "torch", "importlib")
            or frame.f_code.co_filename.startswith("<frozen importlib")
        ):
            frame = frame.f_back
        here = os.path.realpath(__file__)
        warnings.warn_explicit(
            f"offload_shim is not enabled: offload_shim is not installed in this environment ({sys.executable}), but "
            f"its start-up drop-in {here} is still on PYTHONPATH and asks for it at every import torch: remove that "
            f"file (or its folder from PYTHONPATH), or pip install offload_shim; OFFLOAD_SHIM=0 silences this",
            RuntimeWarning, frame.f_code.co_filename, frame.f_lineno, module=frame.f_globals.get("__name__"),
            registry=frame.f_globals.setdefault("__warningregistry__", {}),
        )
        return
    # Imports offload_shim, which installs unless OFFLOAD_SHIM is false; warns once if it cannot.
    offload_shim_boot.activate(f"the drop-in {os.path.realpath(__file__)}")


def _offload_shim_sitecustomize():
    try:
        _offload_shim_chain_shadowed_sitecustomize()
        import os
        import sys

        if os.environ.get("OFFLOAD_SHIM", "").strip().lower() not in ("0", "false", "no", "off"):
            if "torch" in sys.modules:  # imported by the sitecustomize chained above
                _offload_shim_activate()
            else:
                sys.meta_path.insert(0, _OffloadShimAfterTorchImport())
    except Exception as exc:  # never break interpreter start-up
        import warnings

        warnings.warn(f"offload_shim's sitecustomize failed: {exc!r}", RuntimeWarning)


_offload_shim_sitecustomize()
