"""Hugging Face accelerate: FSDP2 with parameter offload set through ``accelerate launch``'s variables, on the
``cuda:nccl,cpu:gloo`` group accelerate then makes; timed, since it works without the shim, over Gloo.

    torchrun --nproc_per_node 2 examples/recipes/accelerate_launch_env.py                  # CPU tensors over Gloo
    OFFLOAD_SHIM=1 torchrun --nproc_per_node 2 examples/recipes/accelerate_launch_env.py   # >= 1 MiB through NCCL

The script sets the variables ``accelerate launch --use_fsdp --fsdp_version 2 --fsdp_offload_params true ...`` would
set (``ACCELERATE_USE_FSDP``, ``FSDP_VERSION=2``, ``FSDP_OFFLOAD_PARAMS=true``, ...; those already in the
environment are kept) and builds ``Accelerator()`` from them. With ``FSDP_OFFLOAD_PARAMS=true``, accelerate (1.15)
initialises the process group as ``cuda:nccl,cpu:gloo`` (``PartialState.__init__`` in accelerate/state.py), so CPU
tensors go over Gloo and nothing fails; the script prints the backend and stops if the group has no CPU backend.

The model is a tiny LLaMA (``LlamaForCausalLM`` built from a config, random init, 117M parameters, 446 MiB in fp32;
nothing is downloaded); most of its weights are 1 MiB or more, so the shim routes them off Gloo. Timed, slowest rank:
a training step (``accelerator.clip_grad_norm_`` reduces only a norm scalar over Gloo, left there by the shim); a
``full_tensor()`` of every parameter (what an RL trainer does to send weights to its inference engine: a gather of
the CPU shards over Gloo without the shim, through NCCL with it); and ``accelerator.get_state_dict`` (torch moves
each shard to the GPU itself and gathers it over NCCL, either way).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

LAUNCH_ENV = {  # as accelerate/utils/launch.py sets them for `accelerate launch --use_fsdp ...`
    "ACCELERATE_USE_FSDP": "true",
    "ACCELERATE_MIXED_PRECISION": "no",
    "FSDP_VERSION": "2",
    "FSDP_OFFLOAD_PARAMS": "true",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
    "FSDP_ACTIVATION_CHECKPOINTING": "false",
}
for key, value in LAUNCH_ENV.items():
    os.environ.setdefault(key, value)

import accelerate  # noqa: E402  (after the variables, as under accelerate launch)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

VOCAB, BATCH, SEQ, STEPS, GATHERS = 32000, 2, 128, 4, 3


def slowest(seconds: float, device) -> float:
    value = torch.tensor(seconds, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)  # an accelerator tensor: untouched by the shim
    return value.item()


def main() -> int:
    accelerator = Accelerator()
    shim = sys.modules.get("offload_shim")
    shim_state = "on" if shim is not None and shim.is_installed() else "off"
    world, backend, device = accelerator.num_processes, dist.get_backend(), accelerator.device
    served = sorted(d.type for d in dist.group.WORLD._device_types)
    accelerator.print(f"torch {torch.__version__}, accelerate {accelerate.__version__}, world {world}, "
                      f"backend {backend} (serves {served}), offload_shim {shim_state}", flush=True)
    if "cpu" not in served:
        raise RuntimeError(f"expected accelerate to add Gloo for the CPU, got backend {backend!r}")

    torch.manual_seed(0)  # the same initial weights on every rank
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=SEQ)
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)

    data = torch.Generator().manual_seed(accelerator.process_index)
    step_s, losses = [], []
    for step in range(STEPS):
        start = time.perf_counter()
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=data).to(device)
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        step_s.append(slowest(time.perf_counter() - start, device))
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
        norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
        accelerator.print(f"step {step}  loss {losses[-1]:.6f}  grad_norm {norm:.6f}  {step_s[-1]:.3f} s", flush=True)

    gather_s = []
    for _ in range(GATHERS):
        start = time.perf_counter()
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        gather_s.append(slowest(time.perf_counter() - start, device))
    mib = sum(t.numel() * t.element_size() for t in full.values()) / 2**20
    devices = sorted({p.to_local().device.type for p in model.parameters()})
    routable = sum(t.numel() * t.element_size() >= 2**20 for t in full.values())
    count = len(full)
    del full
    start = time.perf_counter()
    state = accelerator.get_state_dict(model)
    state_s = slowest(time.perf_counter() - start, device)
    del state
    accelerator.print(f"local parameter devices {devices}; full_tensor() of {count} parameters ({mib:.1f} MiB, "
                      f"{routable} of 1 MiB or more): {', '.join(f'{s:.3f}' for s in gather_s)} s; "
                      f"get_state_dict {state_s:.3f} s", flush=True)
    accelerator.print(f"RESULT recipe=accelerate_launch_env status=ok world={world} backend={backend} "
                      f"shim={shim_state} steps={STEPS} loss_last={losses[-1]:.6f} param_devices={','.join(devices)} "
                      f"step_s_median={statistics.median(step_s[1:] or step_s):.3f} model_mib={mib:.1f} "
                      f"tensors_1mib_or_more={routable} full_tensor_s_min={min(gather_s):.3f} "
                      f"state_dict_s={state_s:.3f}", flush=True)
    accelerator.end_training()  # destroys the process group
    return 0


if __name__ == "__main__":
    sys.exit(main())
