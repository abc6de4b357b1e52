"""PyTorch Lightning: ``ModelParallelStrategy`` (FSDP2) with CPU offload and gradient clipping, on a NCCL-only group.

    OFFLOAD_SHIM=1 torchrun --nproc_per_node 2 examples/recipes/lightning_fsdp2.py

Lightning (2.6) has no offload option of its own for FSDP2: the LightningModule shards itself in
``configure_model`` with ``fully_shard``, to which it passes ``offload_policy=CPUOffloadPolicy()``. The strategy
initialises the process group with NCCL alone (its default for a CUDA device). The model is a tiny LLaMA
(``LlamaForCausalLM`` built from a config, random init; nothing is downloaded), trained for 4 steps on random tokens
by ``Trainer.fit`` with ``gradient_clip_val=1.0``.

Without the shim it fails on 2 ranks or more with ``RuntimeError: No backend type associated with device type
cpu`` in Lightning's clipping (``Precision.clip_grad_by_norm`` calls ``torch.nn.utils.clip_grad_norm_``): the
offloaded gradients' norm is summed over the ranks by DTensor's ``all_reduce`` of a CPU tensor on the NCCL group.
On one rank DTensor runs no collective, and the script passes without the shim.

The strategy moves the whole module to the GPU after ``configure_model`` (``ModelParallelStrategy.setup`` calls
``model_to_device``, ``self.model.to(self.root_device)``), offloaded shards included, and FSDP2 then refuses them at
the first forward ("FSDP parameters should be materialized on CPU when enabling CPU offloading": seen with torch
2.11 and lightning 2.6.6 on an H200). The script's strategy, a subclass of four lines, moves only the buffers. The
script prints where the shards are after training.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import lightning
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, LlamaConfig

VOCAB, BATCH, SEQ, STEPS = 4096, 4, 128, 4


class TinyLlama(LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=SEQ)
        self.model = AutoModelForCausalLM.from_config(config)
        self.losses, self.step_s = [], []

    def configure_model(self):
        if isinstance(self.model, FSDPModule):  # Lightning may call this hook more than once
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy())
        fully_shard(self.model, mesh=mesh, offload_policy=CPUOffloadPolicy())

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.losses.append(loss.detach())
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        self.started = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx):  # after backward, clipping and the optimizer step
        self.step_s.append(time.perf_counter() - self.started)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)


class OffloadModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` that leaves FSDP2-offloaded parameters on the CPU. Lightning's own
    ``model_to_device`` is ``self.model.to(self.root_device)``: it moves the offloaded shards to the GPU after
    ``configure_model``, and FSDP2 then refuses them at the first forward ("FSDP parameters should be materialized on
    CPU when enabling CPU offloading", seen with torch 2.11 and lightning 2.6.6). Here only the buffers move."""

    def model_to_device(self):
        for module in self.model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(self.root_device)


def main() -> int:
    world = int(os.environ["WORLD_SIZE"])
    tokens = torch.randint(0, VOCAB, (STEPS * BATCH * world, SEQ), generator=torch.Generator().manual_seed(0))
    module = TinyLlama()
    trainer = Trainer(
        accelerator="gpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=world // int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=OffloadModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        max_steps=STEPS,
        gradient_clip_val=1.0,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=BATCH))

    shim = sys.modules.get("offload_shim")
    shim_state = "on" if shim is not None and shim.is_installed() else "off"
    losses = torch.stack(module.losses)
    dist.all_reduce(losses)  # accelerator tensors: untouched by the shim
    losses = (losses / world).tolist()
    devices = sorted({p.to_local().device.type for p in module.parameters()})
    if trainer.global_rank == 0:
        print(f"torch {torch.__version__}, lightning {lightning.__version__}, world {world}, "
              f"backend {dist.get_backend()}, offload_shim {shim_state}; local parameter devices {devices}; "
              f"losses {', '.join(f'{v:.6f}' for v in losses)}", flush=True)
        print(f"RESULT recipe=lightning_fsdp2 status=ok world={world} backend={dist.get_backend()} shim={shim_state} "
              f"steps={len(losses)} loss_first={losses[0]:.6f} loss_last={losses[-1]:.6f} "
              f"param_devices={','.join(devices)} step_s_median={statistics.median(module.step_s):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
