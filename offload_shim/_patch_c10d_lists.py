"""Wrappers for the ``torch.distributed`` collectives on lists of tensors and on tensors of per-rank sizes:
gathers, scatters, all-to-all, and the coalesced forms.

Each is described by which of its parameters it reads and which it writes (:data:`COLLECTIVES`), and staged
whole by ``_patch_c10d.staged_arguments_wrapper``: never chunked and never routed off Gloo, because what a rank
passes may differ from its peers' (uneven ``all_gather`` lists, ``all_to_all_single`` split sizes,
``gather_list`` and ``scatter_list`` only on the root). So the staging memory on the accelerator is the size of
the call's host tensors on that rank: for ``gather`` on the root, the whole ``gather_list``. Whichever of these
functions the running torch has are wrapped.
"""

from __future__ import annotations

from offload_shim._patch_c10d import (
    ALIASES,
    AUTOGRAD_WRITTEN,
    CONTIGUOUS,
    MODULE,
    READ,
    READ_WRITE,
    WRITE,
    staged_arguments_wrapper,
)
from offload_shim._patching import Target

COLLECTIVES = {
    "all_gather": {"tensor_list": WRITE, "tensor": READ},
    "all_gather_into_tensor": {"output_tensor": WRITE, "input_tensor": READ},
    "all_gather_single": {"output_tensor": WRITE, "input_tensor": READ},
    "all_gather_coalesced": {"output_tensor_lists": WRITE, "input_tensor_list": READ},
    "reduce_scatter": {"output": WRITE, "input_list": READ},
    "reduce_scatter_tensor": {"output": WRITE, "input": READ},
    "reduce_scatter_single": {"output": WRITE, "input": READ},
    "all_reduce_coalesced": {"tensors": READ_WRITE},
    "all_to_all": {"output_tensor_list": WRITE, "input_tensor_list": READ},
    "all_to_all_single": {"output": WRITE, "input": READ},
    "gather": {"tensor": READ, "gather_list": WRITE},
    "scatter": {"tensor": WRITE, "scatter_list": READ},
}
# What torch refuses of these calls' tensors (see _patch_c10d): the outputs its CPU backend writes with copies
# that autograd checks, and the inputs it takes contiguous only. all_reduce, broadcast, reduce, scatter and
# all_to_all_single write their outputs in place, unchecked, and take any strides.
REFUSALS = {
    "all_gather": {"tensor_list": AUTOGRAD_WRITTEN},
    "all_gather_into_tensor": {"output_tensor": AUTOGRAD_WRITTEN},
    "all_gather_single": {"output_tensor": AUTOGRAD_WRITTEN},
    "all_gather_coalesced": {"output_tensor_lists": AUTOGRAD_WRITTEN},
    "reduce_scatter": {"output": AUTOGRAD_WRITTEN},
    "reduce_scatter_tensor": {"output": AUTOGRAD_WRITTEN},
    "reduce_scatter_single": {"output": AUTOGRAD_WRITTEN},
    "all_reduce_coalesced": {"tensors": AUTOGRAD_WRITTEN},
    "all_to_all": {"output_tensor_list": AUTOGRAD_WRITTEN},
    "all_to_all_single": {"input": CONTIGUOUS},
    "gather": {"gather_list": AUTOGRAD_WRITTEN},
}

TARGETS = [
    Target(MODULE, name, staged_arguments_wrapper(name, roles, REFUSALS.get(name, {})), aliases=ALIASES)
    for name, roles in COLLECTIVES.items()
]
