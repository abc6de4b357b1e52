"""Fresh interpreters for tests of what happens at import and start-up."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import offload_shim_names

# Every variable of offload_shim's (the one list), and torch's that switches its entry points off.
SHIM_VARIABLES = (*offload_shim_names.VARIABLES, "TORCH_DEVICE_BACKEND_AUTOLOAD")


def environment(env: dict | None = None, site: str | None = None) -> dict:
    """This process's environment with offload_shim's variables cleared, then set from ``env``; ``site`` (a
    directory offload_shim's wheel was installed into, see the ``install`` fixture) goes first on PYTHONPATH."""
    environ = {k: v for k, v in os.environ.items() if k not in SHIM_VARIABLES}
    environ.update(env or {})
    if site:
        environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, environ.get("PYTHONPATH")) if p)
    return environ


def python(*code: str, env: dict | None = None, check: bool = True, timeout: float = 120, site: str | None = None,
           script: str | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Run the ``code`` parts (each dedented, then joined) in a new interpreter (``-c``, or written to the file
    ``script`` and run as a script) with :func:`environment` ``(env, site)``."""
    source = "\n".join(textwrap.dedent(part) for part in code)
    if script:
        with open(script, "w") as f:
            f.write(source)
    result = subprocess.run(
        [sys.executable, *([script] if script else ["-c", source])], env=environment(env, site), cwd=cwd,
        capture_output=True, text=True, timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


# Prints, as the last line, whether each family is wrapped: "c10d=<bool> funcol=<bool> kernels=<bool>" (the
# functional collectives' module is imported lazily: None before; kernels: the CPU kernel of the functional all_reduce
# op, which compiled code, the functional collectives and DTensor reach).
REPORT = """
import sys, wrapt
def _wrapped(module_name, name, owner=None):
    module = sys.modules.get(module_name)
    if module is None:
        return None
    holder = getattr(module, owner) if owner else module
    return isinstance(vars(holder)[name], wrapt.FunctionWrapper)
def _kernel():
    import torch
    return torch._C._dispatch_has_kernel_for_dispatch_key("_c10d_functional::all_reduce", "CPU")
print("c10d=%s funcol=%s kernels=%s" % (
    _wrapped("torch.distributed.distributed_c10d", "all_reduce"),
    _wrapped("torch.distributed._functional_collectives", "all_reduce"),
    _kernel(),
))
"""
