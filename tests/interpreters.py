"""Fresh interpreters for tests of what happens at import and start-up."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SHIM_VARIABLES = (
    "OFFLOAD_SHIM", "OFFLOAD_SHIM_STAGING_DEVICE", "OFFLOAD_SHIM_ALWAYS_STAGE", "OFFLOAD_SHIM_LOG", "OFFLOAD_SHIM_SUMMARY"
)


def python(*code: str, env: dict | None = None, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the ``code`` parts (each dedented, then joined) in a new interpreter with offload_shim's variables
    cleared, then set from ``env``."""
    environ = {k: v for k, v in os.environ.items() if k not in SHIM_VARIABLES}
    environ.update(env or {})
    result = subprocess.run(
        [sys.executable, "-c", "\n".join(textwrap.dedent(part) for part in code)], env=environ, capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


# Prints, as the last line, whether each collective is wrapped: "c10d=<bool> funcol=<bool> dtensor=<bool>".
REPORT = """
import sys, wrapt
def _wrapped(module_name, name, owner=None):
    module = sys.modules.get(module_name)
    if module is None:
        return None
    holder = getattr(module, owner) if owner else module
    return isinstance(vars(holder)[name], wrapt.FunctionWrapper)
print("c10d=%s funcol=%s dtensor=%s" % (
    _wrapped("torch.distributed.distributed_c10d", "all_reduce"),
    _wrapped("torch.distributed._functional_collectives", "all_gather_single"),
    _wrapped("torch.distributed.tensor._api", "full_tensor", "DTensor"),
))
"""
