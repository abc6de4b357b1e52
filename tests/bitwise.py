"""Bit-for-bit comparison of tensors, NaNs included."""

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape, device and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(bits(a), bits(b))
