"""Hugging Face accelerate's metric helpers on CPU tensors, over the NCCL-only group accelerate makes under torchrun.

    torchrun --nproc_per_node 1 examples/recipes/accelerate_metrics.py                  # torch's errors
    OFFLOAD_SHIM=1 torchrun --nproc_per_node 1 examples/recipes/accelerate_metrics.py   # the values, checked

``Accelerator().reduce``, ``gather``, ``gather_for_metrics``, ``pad_across_processes`` and
``accelerate.utils.broadcast`` of tensors made on the CPU (a metric computed from CPU outputs, a count, a length):
accelerate passes them to ``torch.distributed`` as they are, and on a NCCL group torch refuses them ("No backend
type associated with device type cpu", accelerate PR #2180 added a message for it). With the shim each is staged
through this rank's GPU and the result is the one the same call gives on GPU tensors, where accelerate puts it: on
the CPU, but for the gathers, whose output accelerate makes on its device. ``--backend``
initialises the process group before accelerate does (``cuda:gloo`` shows torch's error on a CPU-only machine).
"""

from __future__ import annotations

import argparse
import sys

import accelerate
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import broadcast

from _report import Report


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", help="init_process_group(BACKEND) before accelerate (default: accelerate's)")
    args = parser.parse_args()
    if args.backend:
        dist.init_process_group(args.backend)
    accelerator = Accelerator()
    report = Report(f"accelerate_metrics (accelerate {accelerate.__version__})")
    rank, world, device = report.rank, report.world, accelerator.device

    def mine(k):  # rank k's metric values
        return torch.tensor([k + 1.0, 2.0 * (k + 1)])

    x = mine(rank)
    everyone = torch.cat([mine(k) for k in range(world)])
    report.attempt("reduce", lambda: accelerator.reduce(x, "sum"), everyone.view(world, 2).sum(0),
                   lambda: accelerator.reduce(x.to(device), "sum"))
    # accelerate gathers into a tensor it makes on its device (``_gpu_gather_one``): the result is there, as for
    # accelerator tensors
    report.attempt("gather", lambda: accelerator.gather(x), everyone.to(device),
                   lambda: accelerator.gather(x.to(device)))
    report.attempt("gather_for_metrics", lambda: accelerator.gather_for_metrics(x), everyone.to(device),
                   lambda: accelerator.gather_for_metrics(x.to(device)))
    ragged = torch.arange(rank + 1.0)  # one more element per rank: padded to the longest
    padded = torch.cat([ragged, torch.zeros(world - rank - 1)])
    report.attempt("pad_across_processes", lambda: accelerator.pad_across_processes(ragged), padded,
                   lambda: accelerator.pad_across_processes(ragged.to(device)))
    report.attempt("broadcast", lambda: broadcast(torch.full((3,), float(rank)), from_process=0), torch.zeros(3),
                   lambda: broadcast(torch.full((3,), float(rank), device=device), from_process=0))
    code = report.finish()
    accelerator.end_training()
    return code


if __name__ == "__main__":
    sys.exit(main())
