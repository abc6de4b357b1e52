"""Distributed checkpoint of an FSDP2-offloaded model and its optimizer, saved and loaded on a NCCL-only group.

    OFFLOAD_SHIM=1 torchrun --nproc_per_node 2 examples/recipes/dcp_fsdp2.py

A tiny LLaMA (``LlamaForCausalLM`` built from a config, random init; nothing is downloaded), offloaded with
``fully_shard(..., offload_policy=CPUOffloadPolicy())``, trains for 3 steps with AdamW and ``clip_grad_norm_``. Its
model and optimizer state (``get_state_dict``: sharded, each rank's shards on the CPU) is saved with
``torch.distributed.checkpoint.save`` to a temporary directory, then loaded into a fresh model and optimizer built
from another seed (``torch.distributed.checkpoint.load``, ``set_state_dict``). Every rank checks that every tensor
of the loaded model and optimizer state is bitwise what was saved, and that the loaded model's loss on a held-out
batch is bitwise the trained model's.

Without the shim it fails on 2 ranks or more with ``RuntimeError: No backend type associated with device type
cpu`` in ``clip_grad_norm_``: the offloaded gradients' norm is summed over the ranks by DTensor's ``all_reduce`` of a
CPU tensor on the NCCL group. The checkpoint itself hands no CPU tensor to a collective: ``save`` and ``load`` plan
through object collectives, which torch runs on the GPU, and sharded state dicts move nothing between ranks. So on
one rank, where DTensor runs no collective, the script passes without the shim.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, LlamaConfig

VOCAB, BATCH, SEQ, STEPS = 4096, 4, 128, 3


def build(seed: int):
    torch.manual_seed(seed)  # the same initial weights on every rank
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=SEQ)
    model = AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:
        fully_shard(layer, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def flat(tree, prefix=""):
    """{"model/lm_head.weight": tensor, "optim/state/.../exp_avg": tensor, "optim/param_groups/0/lr": 0.001, ...}"""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}/").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in flat(sub, f"{prefix}{i}/").items()}
    if isinstance(tree, DTensor):
        tree = tree.to_local()  # this rank's shard
    return {prefix[:-1]: tree.detach().clone() if isinstance(tree, torch.Tensor) else tree}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        bits = [t.reshape(-1).view(torch.uint8) for t in (a, b)]
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*bits)
    return type(a) is type(b) and a == b


def main() -> int:
    if not torch.accelerator.is_available():
        sys.exit("dcp_fsdp2.py offloads to the CPU from an accelerator, and this machine has none")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device(torch.accelerator.current_accelerator().type, local_rank)
    torch.accelerator.set_device_index(local_rank)
    dist.init_process_group("nccl", device_id=device)
    world = dist.get_world_size()
    shim = sys.modules.get("offload_shim")
    shim_state = "on" if shim is not None and shim.is_installed() else "off"
    if rank == 0:
        print(f"torch {torch.__version__}, world {world}, backend {dist.get_backend()}, offload_shim {shim_state}",
              flush=True)

    model, optimizer = build(seed=0)
    data = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=data).to(device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}  loss {loss.item():.6f}  grad_norm {norm.full_tensor().item():.6f}", flush=True)

    path = [tempfile.mkdtemp(prefix="dcp_fsdp2_") if rank == 0 else None]
    dist.broadcast_object_list(path)  # every rank writes into rank 0's directory
    path = path[0]
    model_sd, optim_sd = get_state_dict(model, optimizer)
    saved = flat({"model": model_sd, "optim": optim_sd})
    start = time.perf_counter()
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    save_s = time.perf_counter() - start

    restored, restored_optimizer = build(seed=1)
    model_sd, optim_sd = get_state_dict(restored, restored_optimizer)
    start = time.perf_counter()
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(restored, restored_optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    load_s = time.perf_counter() - start

    loaded = flat(dict(zip(("model", "optim"), get_state_dict(restored, restored_optimizer))))
    wrong = sorted(set(saved) ^ set(loaded))
    wrong += sorted(k for k in saved.keys() & loaded.keys() if not same(saved[k], loaded[k]))
    held_out = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1000)).to(device)
    with torch.no_grad():
        losses = [m(input_ids=held_out, labels=held_out).loss for m in (model, restored)]
    if not same(losses[0], losses[1]):
        wrong.append(f"held-out loss {losses[0].item()!r} != {losses[1].item()!r}")
    count = torch.tensor(len(wrong), device=device)
    dist.all_reduce(count)  # an accelerator tensor: untouched by the shim
    if count.item():
        raise AssertionError(f"rank {rank}: loaded state differs from the saved one: {wrong[:10]}")

    dist.barrier()
    if rank == 0:
        mib = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 2**20
        shutil.rmtree(path)
        tensors = sum(isinstance(v, torch.Tensor) for v in saved.values())
        print(f"saved and loaded {len(saved)} entries ({tensors} tensors) per rank, checkpoint {mib:.1f} MiB: "
              f"bitwise equal on every rank, held-out loss {losses[1].item():.6f} equal", flush=True)
        print(f"RESULT recipe=dcp_fsdp2 status=ok world={world} backend={dist.get_backend()} shim={shim_state} "
              f"steps={STEPS} entries={len(saved)} tensors={tensors} checkpoint_mib={mib:.1f} bitwise=yes "
              f"save_s={save_s:.3f} load_s={load_s:.3f} held_out_loss={losses[1].item():.6f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
