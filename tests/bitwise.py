"""Bit-for-bit comparison of tensors, NaNs included."""

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    # A fresh contiguous copy: a one-element view may keep a stride other than 1, which view() refuses. A bool
    # tensor is read as its bytes first: a copy between bool tensors stores 1 for any nonzero byte.
    t = t.detach()
    t = t.view(torch.uint8) if t.dtype is torch.bool else t
    return t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape, device and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(bits(a), bits(b))
