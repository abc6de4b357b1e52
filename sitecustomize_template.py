"""offload_shim drop-in for a cluster: copy this file as ``sitecustomize.py`` into a directory on PYTHONPATH.

    cp sitecustomize_template.py /opt/site/sitecustomize.py
    export PYTHONPATH=/opt/site${PYTHONPATH:+:$PYTHONPATH}

Every Python process then switches offload_shim on as soon as it imports torch (not before: start-up stays as
fast as without it), unless ``OFFLOAD_SHIM`` is false (0, false, no, off) in its environment. It never breaks
interpreter start-up: if wrapt, offload_shim or torch is missing, or activation fails, the process runs without
the shim (with a warning where activation failed). Python imports only one ``sitecustomize`` module; this one
imports the ``sitecustomize`` it shadows, from later on ``sys.path``, so that one keeps working.
"""


def _offload_shim_chain_shadowed_sitecustomize():
    import importlib.machinery
    import importlib.util
    import os
    import sys
    import warnings

    ours = os.path.realpath(__file__)
    # The first sitecustomize on sys.path after ours that is not this same file (a directory may appear twice,
    # under another spelling or through a link).
    for entry in sys.path:
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is None or spec.origin is None or os.path.realpath(spec.origin) == ours:
            continue
        if spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            warnings.warn(f"the sitecustomize at {spec.origin} failed: {exc!r}", RuntimeWarning)
        return


def _offload_shim_activate_on_torch_import():
    import warnings

    try:
        import wrapt
    except ImportError:
        return  # offload_shim is not installed here (wrapt is one of its requirements)

    def activate(_torch):
        try:
            import offload_shim  # noqa: F401  (installs unless OFFLOAD_SHIM is false)
        except ImportError:
            pass  # not installed in this environment
        except Exception as exc:
            warnings.warn(f"offload_shim is not enabled: {exc}", RuntimeWarning)

    wrapt.register_post_import_hook(activate, "torch")


def _offload_shim_sitecustomize():
    try:
        _offload_shim_chain_shadowed_sitecustomize()
        # offload_shim reads OFFLOAD_SHIM itself when imported: false installs nothing, malformed warns.
        _offload_shim_activate_on_torch_import()
    except Exception as exc:  # never break interpreter start-up
        import warnings

        warnings.warn(f"offload_shim's sitecustomize failed: {exc!r}", RuntimeWarning)


_offload_shim_sitecustomize()
