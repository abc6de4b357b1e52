"""Hugging Face accelerate: FSDP2 with parameter offload configured in code, on the NCCL-only group accelerate makes.

    OFFLOAD_SHIM=1 torchrun --nproc_per_node 2 examples/recipes/accelerate_fsdp2.py

The plugin is given in code, ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
cpu_offload=True, ...))``. accelerate (1.15) then initialises the process group with NCCL alone: it adds Gloo for
the CPU (``cuda:nccl,cpu:gloo``) only when the environment has ``FSDP_OFFLOAD_PARAMS=true`` (or
``FSDP_STATE_DICT_TYPE=FULL_STATE_DICT``), as ``accelerate launch`` sets it (``PartialState.__init__`` in
accelerate/state.py; ``accelerate_launch_env.py`` is that case). The model is a tiny LLaMA (``LlamaForCausalLM``
built from a config, random init; nothing is downloaded), trained for 4 steps on random tokens with
``accelerator.clip_grad_norm_``, then gathered with ``accelerator.get_state_dict``.

Without the shim it fails on 2 ranks or more with ``RuntimeError: No backend type associated with device type
cpu`` in ``accelerator.clip_grad_norm_``: the offloaded gradients are DTensors on the CPU, and their norm is summed
over the ranks by DTensor's ``all_reduce`` of a CPU tensor on the NCCL group. On one rank DTensor runs no
collective, and the script passes without the shim. ``get_state_dict`` works either way: torch moves each offloaded
shard to the GPU before gathering it (``_gather_state_dict`` in torch/distributed/_state_dict_utils.py).
"""

from __future__ import annotations

import statistics
import sys
import time

import accelerate
import torch
import torch.distributed as dist
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from transformers import AutoModelForCausalLM, LlamaConfig

VOCAB, BATCH, SEQ, STEPS = 4096, 4, 128, 4


def main() -> int:
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        cpu_offload=True,  # CPUOffloadPolicy()
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
    )
    accelerator = Accelerator(fsdp_plugin=plugin)
    shim = sys.modules.get("offload_shim")
    shim_state = "on" if shim is not None and shim.is_installed() else "off"
    world, backend = accelerator.num_processes, dist.get_backend()
    accelerator.print(f"torch {torch.__version__}, accelerate {accelerate.__version__}, world {world}, "
                      f"backend {backend}, offload_shim {shim_state}", flush=True)
    if any(d.type == "cpu" for d in dist.group.WORLD._device_types):
        raise RuntimeError(f"expected accelerate to keep NCCL alone, got backend {backend!r} (FSDP_* variables set?)")

    torch.manual_seed(0)  # the same initial weights on every rank
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=SEQ)
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)  # FSDP2 needs both in one call

    data = torch.Generator().manual_seed(accelerator.process_index)
    losses, norms, step_s = [], [], []
    for step in range(STEPS):
        start = time.perf_counter()
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=data).to(accelerator.device)
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        step_s.append(time.perf_counter() - start)
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
        norms.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())
        accelerator.print(f"step {step}  loss {losses[-1]:.6f}  grad_norm {norms[-1]:.6f}", flush=True)

    start = time.perf_counter()
    state = accelerator.get_state_dict(model)  # full tensors on the CPU, on rank 0; empty elsewhere
    state_s = time.perf_counter() - start
    if accelerator.is_main_process:
        devices = sorted({p.to_local().device.type for p in model.parameters()})
        mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
        print(f"local parameter devices {devices}; get_state_dict: {len(state)} tensors, {mib:.1f} MiB, "
              f"on {sorted({t.device.type for t in state.values()})}", flush=True)
        print(f"RESULT recipe=accelerate_fsdp2 status=ok world={world} backend={backend} shim={shim_state} "
              f"steps={STEPS} loss_first={losses[0]:.6f} loss_last={losses[-1]:.6f} grad_norm_first={norms[0]:.6f} "
              f"grad_norm_last={norms[-1]:.6f} param_devices={','.join(devices)} state_dict_tensors={len(state)} "
              f"state_dict_mib={mib:.1f} state_dict_s={state_s:.3f} step_s_median={statistics.median(step_s):.3f}",
              flush=True)
    accelerator.end_training()  # destroys the process group
    return 0


if __name__ == "__main__":
    sys.exit(main())
