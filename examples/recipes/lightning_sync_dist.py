"""PyTorch Lightning's ``self.log(..., sync_dist=True)`` of tensors made on the CPU, under DDP on a NCCL group.

    torchrun --nproc_per_node 1 examples/recipes/lightning_sync_dist.py                  # torch's error
    OFFLOAD_SHIM=1 torchrun --nproc_per_node 1 examples/recipes/lightning_sync_dist.py   # the values, checked

A LightningModule logs a value computed on the CPU (a count, a metric from CPU outputs) with ``sync_dist=True``:
Lightning reduces it across ranks with ``torch.distributed.all_reduce`` of that CPU tensor, which torch refuses on
the NCCL group of ``strategy="ddp"`` (Lightning #18803; terratorch PR #1004). Logged per step (synced in
``self.log``) and per epoch (synced at the epoch's end), mean over ranks. With the shim each reduction is staged
through the GPU; ``trainer.callback_metrics`` holds the mean over ranks. The cost per call is that of one
``self.log`` with ``sync_dist=True`` in ``training_step``, beside the same of a GPU tensor. ``--accelerator cpu
--backend cuda:gloo`` shows torch's error on a CPU-only machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from _report import Report

STEPS = 24


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.costs = {"cpu": [], "accelerator": []}

    def training_step(self, batch, index):
        value = torch.tensor(float(self.global_rank + 1))  # made on the CPU
        start = time.perf_counter()
        self.log("step_mean", value, sync_dist=True, on_step=True, on_epoch=False)
        self.costs["cpu"].append(time.perf_counter() - start)
        on_device = value.to(self.device)
        start = time.perf_counter()
        self.log("step_mean_accelerator", on_device, sync_dist=True, on_step=True, on_epoch=False)
        self.costs["accelerator"].append(time.perf_counter() - start)
        self.log("epoch_mean", value, sync_dist=True, on_step=False, on_epoch=True)
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--backend", help="the strategy's process group backend (default: Lightning's)")
    args = parser.parse_args()
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    trainer = L.Trainer(accelerator=args.accelerator, devices=devices, strategy=DDPStrategy(
        process_group_backend=args.backend), max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False)
    module = Module()
    data = torch.utils.data.DataLoader(torch.randn(4 * STEPS, 4), batch_size=4)
    error = None
    try:
        trainer.fit(module, data)
    except Exception as exc:  # torch's error, raised in self.log
        error = exc
    report = Report(f"lightning_sync_dist (lightning {L.__version__})")
    mean = torch.tensor((report.world + 1) / 2)

    def logged(name):
        if error is not None:
            raise error
        return trainer.callback_metrics[name].cpu()

    report.attempt("self.log per step", lambda: logged("step_mean"), mean)
    report.attempt("self.log per epoch", lambda: logged("epoch_mean"), mean)
    if error is None:  # the cost of one self.log with sync_dist=True: the minimum over the steps after the first
        for kind, key in (("cpu", "self.log_us"), ("accelerator", "self.log_accelerator_us")):
            report.figures[key] = round(min(module.costs[kind][1:]) * 1e6, 1)
        report.say(f"one self.log(sync_dist=True) in training_step: {report.figures['self.log_us']} us of a CPU "
                   f"tensor, {report.figures['self.log_accelerator_us']} us of a GPU tensor")
    code = report.finish()
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
