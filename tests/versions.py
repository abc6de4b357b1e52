"""Calls whose names changed between the torch releases the tests run on: looked up at each call (the shim
installs and removes its wrappers under these names)."""

import torch.distributed._functional_collectives as funcol


def all_gather_single(*args, **kwargs):
    """``funcol.all_gather_single`` (torch 2.13), ``funcol.all_gather_tensor`` before it: the same call."""
    return getattr(funcol, "all_gather_single", funcol.all_gather_tensor)(*args, **kwargs)


def reduce_scatter_single(*args, **kwargs):
    """``funcol.reduce_scatter_single`` (torch 2.13), ``funcol.reduce_scatter_tensor`` before it: the same call."""
    return getattr(funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor)(*args, **kwargs)
