"""Entry point of group ``torch.backends`` for offload_shim: switches the shim on at ``import torch``.

torch loads this at the end of ``import torch`` in every interpreter where offload_shim is installed, so it must
cost nothing and never fail: while ``OFFLOAD_SHIM`` is unset or empty it returns at once and imports nothing;
otherwise it imports offload_shim, which installs the wrappers when the value is true and nothing when it is
false. A malformed value, or any failure, becomes a warning: ``import torch`` goes on without the shim.

This module lies outside the ``offload_shim`` package because importing anything inside that package runs
its ``__init__``, which installs the wrappers.
"""

import os
import warnings


def autoload() -> None:
    if not os.environ.get("OFFLOAD_SHIM", "").strip():
        return
    try:
        import offload_shim  # noqa: F401  (installs unless OFFLOAD_SHIM is false)
    except Exception as exc:  # never break `import torch`
        warnings.warn(f"offload_shim is not enabled: {exc}", RuntimeWarning, stacklevel=2)
