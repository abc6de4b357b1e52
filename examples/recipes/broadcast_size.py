"""A size tensor made on the CPU, broadcast before an object exchange over a NCCL group.

    torchrun --nproc_per_node 1 examples/recipes/broadcast_size.py                  # torch's error
    OFFLOAD_SHIM=1 torchrun --nproc_per_node 1 examples/recipes/broadcast_size.py   # the object, checked

The pattern of hand-written object exchanges (unsloth-zoo #129, mistral-inference #252, sglang PR #5322): rank 0
pickles an object, broadcasts its length as a one-element ``torch.long`` tensor, then the bytes as a ``uint8``
tensor of that length; the other ranks allocate the buffer from the received length. Both tensors are made on the
CPU, so torch refuses the first broadcast on a NCCL group. With the shim both are staged through the GPU; every
rank unpickles rank 0's object. ``--backend`` picks the process group's backend (default ``nccl``; ``cuda:gloo``
shows torch's error on a CPU-only machine).
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys

import torch
import torch.distributed as dist

from _report import Report

OBJECT = {"step": 1200, "lr": 3e-4, "stop": False, "tokens": list(range(1000))}  # about 5 KB pickled


def exchange(obj, device=None):
    """Rank 0's ``obj`` on every rank: its length, then its bytes, broadcast from rank 0 (tensors on ``device``, or
    made on the CPU)."""
    payload = pickle.dumps(obj) if dist.get_rank() == 0 else b""
    size = torch.tensor([len(payload)], dtype=torch.long, device=device)
    dist.broadcast(size, src=0)
    if dist.get_rank() == 0:
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device or "cpu")
    else:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=0)
    return pickle.loads(buffer.cpu().numpy().tobytes())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="nccl")
    args = parser.parse_args()
    device = None
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    report = Report("broadcast_size")
    sent = OBJECT if report.rank == 0 else None
    report.attempt("exchange", lambda: exchange(sent), OBJECT, lambda: exchange(sent, device))
    code = report.finish()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
