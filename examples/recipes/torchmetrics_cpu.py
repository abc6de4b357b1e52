"""torchmetrics metrics whose states stay on the CPU, synced at ``compute()`` over a NCCL group.

    torchrun --nproc_per_node 1 examples/recipes/torchmetrics_cpu.py                  # torch's errors
    OFFLOAD_SHIM=1 torchrun --nproc_per_node 1 examples/recipes/torchmetrics_cpu.py   # the values, checked

A metric that is never moved to the GPU (``metric.to(device)`` forgotten, or kept on the CPU on purpose, to hold
its states in host memory) syncs its states at ``compute()`` with ``torch.distributed.all_gather`` of CPU tensors
(torchmetrics' ``gather_all_tensors``: first each state's shape, then the state), which torch refuses on a NCCL
group (torchmetrics issue #2477). Three metrics: a mean (``MeanMetric``: sum and weight states), a concatenation
(``CatMetric``: a list state) and a classification metric (``BinaryAccuracy``: counts). Each rank updates with its
own values; the expected results are computed from every rank's values. The cost per call is one sync of the
metric's states (``metric.sync_context()``), beside the same metric on the GPU. ``--backend`` picks the process
group's backend (default ``nccl``; ``cuda:gloo`` shows torch's error on a CPU-only machine).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torchmetrics
from torchmetrics import CatMetric, MeanMetric
from torchmetrics.classification import BinaryAccuracy

from _report import Report


def _sync(metric) -> None:
    """One sync of ``metric``'s states across the ranks, undone after (what ``compute()`` does before computing)."""
    with metric.sync_context():
        pass


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="nccl")
    args = parser.parse_args()
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    report = Report(f"torchmetrics_cpu (torchmetrics {torchmetrics.__version__})")
    rank, world = report.rank, report.world

    def values(k):
        return torch.tensor([k + 1.0, k + 2.0])

    def predictions(k):  # rank k: 4 predictions, k % 4 + 1 of them right
        target = torch.tensor([1, 0, 1, 0])
        right = k % 4 + 1
        preds = torch.where(torch.arange(4) < right, target.float(), 1.0 - target.float())
        return preds, target

    everyone = torch.cat([values(k) for k in range(world)])
    right = sum(k % 4 + 1 for k in range(world))
    cases = [
        ("MeanMetric", MeanMetric, lambda m, k: m.update(values(k)), everyone.mean()),
        ("CatMetric", CatMetric, lambda m, k: m.update(values(k)), everyone),
        ("BinaryAccuracy", BinaryAccuracy, lambda m, k: m.update(*predictions(k)), torch.tensor(right / (4 * world))),
    ]
    for name, make, update, expected in cases:
        metric, reference = make(), make().to(device)
        update(metric, rank)
        update(reference, rank)
        report.attempt(f"{name}.compute", metric.compute, expected)
        report.attempt(f"{name}.sync", lambda: _sync(metric), None, lambda: _sync(reference))
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
