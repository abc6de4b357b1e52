"""RL weight sync: ``full_tensor()`` of every FSDP2-offloaded parameter, then a broadcast, on a NCCL-only group.

    OFFLOAD_SHIM=1 torchrun --nproc_per_node 2 examples/recipes/rl_weight_sync.py

An RL trainer that shards its policy with FSDP2 sends the full weights to its inference engine after each optimizer
step: ``full_tensor()`` of every parameter, then a broadcast from the trainer's rank 0. Here the broadcast goes over
the training group itself, standing in for the engine's communicator. The policy is a tiny LLaMA
(``LlamaForCausalLM`` built from a config, random init, 45.6M parameters, 174 MiB in fp32; nothing is downloaded),
offloaded with ``fully_shard(..., offload_policy=CPUOffloadPolicy())``. Each iteration takes one AdamW step on random
tokens, then syncs, timed on every rank (the slowest rank's time is printed). Every rank checks that its
``full_tensor()`` holds its own shard and that the broadcast delivered bitwise what its ``full_tensor()`` returned.

Without the shim it fails with ``RuntimeError: No backend type associated with device type cpu``: on 2 ranks or
more in ``full_tensor()`` (DTensor's all-gather of the CPU shards on the NCCL group); on one rank, where DTensor runs
no collective, in ``dist.broadcast`` of the CPU tensor. ``--backend cpu:gloo,cuda:nccl`` runs the same sync over
Gloo without the shim, for its time; with the shim on that group, tensors of 1 MiB or more go through NCCL instead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from transformers import AutoModelForCausalLM, LlamaConfig

VOCAB, BATCH, SEQ = 32000, 2, 64


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = [t.reshape(-1).view(torch.uint8) for t in (a, b)]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*bits)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--backend", default="nccl", help="process group backend, e.g. nccl or cpu:gloo,cuda:nccl")
    args = parser.parse_args()
    if not torch.accelerator.is_available():
        sys.exit("rl_weight_sync.py offloads to the CPU from an accelerator, and this machine has none")

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device(torch.accelerator.current_accelerator().type, local_rank)
    torch.accelerator.set_device_index(local_rank)
    dist.init_process_group(args.backend, device_id=device)
    world = dist.get_world_size()
    shim = sys.modules.get("offload_shim")
    shim_state = "on" if shim is not None and shim.is_installed() else "off"
    if rank == 0:
        print(f"torch {torch.__version__}, world {world}, backend {dist.get_backend()}, offload_shim {shim_state}",
              flush=True)

    torch.manual_seed(0)  # the same initial weights on every rank
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=SEQ)
    model = AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:
        fully_shard(layer, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    data = torch.Generator().manual_seed(rank)
    times_ms = []
    for iteration in range(args.iterations):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=data).to(device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

        synced = []  # (name, this rank's full_tensor(), what the broadcast delivered)
        start = time.perf_counter()
        for name, param in model.named_parameters():
            full = param.full_tensor()
            received = full if rank == 0 else torch.empty_like(full)
            dist.broadcast(received, src=0)
            synced.append((name, full, received))
        slowest = torch.tensor(time.perf_counter() - start, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # an accelerator tensor: untouched by the shim
        times_ms.append(slowest.item() * 1000)

        wrong = []
        for (name, full, received), param in zip(synced, model.parameters()):
            chunks = full.chunk(world)  # FSDP2 shards dim 0 as torch.chunk does
            mine = chunks[rank] if rank < len(chunks) else full[:0]
            if not (same_bits(received, full) and same_bits(mine, param.to_local())):
                wrong.append(name)
        count = torch.tensor(len(wrong), device=device)
        dist.all_reduce(count)
        if count.item():
            raise AssertionError(f"rank {rank}: synced weights differ from the gathered ones: {wrong}")
        mib = sum(full.numel() * full.element_size() for _, full, _ in synced) / 2**20
        if rank == 0:
            print(f"iteration {iteration}  loss {loss.item():.6f}  synced {len(synced)} tensors, {mib:.1f} MiB, "
                  f"{times_ms[-1]:.1f} ms (slowest rank), on {synced[0][1].device.type}; bitwise equal on every rank",
                  flush=True)

    if rank == 0:
        print(f"RESULT recipe=rl_weight_sync status=ok world={world} backend={dist.get_backend()} shim={shim_state} "
              f"iterations={args.iterations} tensors={len(synced)} mib={mib:.1f} bitwise=yes "
              f"sync_ms_first={times_ms[0]:.1f} sync_ms_min={min(times_ms):.1f} "
              f"sync_ms_median={statistics.median(times_ms):.1f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
