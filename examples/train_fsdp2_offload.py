"""Train a small LLaMA-style transformer with FSDP2 and CPUOffloadPolicy on a NCCL-only process group.

This script never mentions offload_shim. On a NCCL-only group, ``clip_grad_norm_`` and ``full_tensor()`` of
offloaded parameters fail with ``RuntimeError: No backend type associated with device type cpu``; run it with
the shim switched on and they work:

    OFFLOAD_SHIM=1 torchrun --nproc_per_node 2 examples/train_fsdp2_offload.py

Options choose the references the shim is compared with: ``--backend cpu:gloo,cuda:nccl`` (the same offloaded run,
CPU tensors over Gloo) and ``--no-offload`` (parameters stay on the GPU). ``--out DIR`` makes rank 0 write
``DIR/<run>.json`` (losses, gradient norms, with their exact bits) and ``DIR/<run>.pt`` (the final parameters,
gathered by ``full_tensor()``). Model: random init, synthetic tokens from a fixed seed; nothing is downloaded.

On a machine without an accelerator there is nothing to offload from and nothing to stage through. The script
then shows torch's failure on a group that serves only the accelerator (``cuda:gloo``, which a CPU-only torch
accepts, stands in for ``nccl``) and, with the shim switched on, trains on Gloo ranks twice: once with every
collective forced through the shim's staging path with host copies, once without the shim; it reports whether the
two agree to the bit (exit status 1 if not). Without the shim it stops after the failure, with exit status 0: the
demonstration ran (torchrun would bury the message under its own report of a failed rank).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotary(x, base: float = 10000.0):
    """Rotary position embedding of x: (batch, heads, seq, head_dim)."""
    seq, half = x.shape[-2], x.shape[-1] // 2
    freqs = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.arange(seq, device=x.device, dtype=torch.float32)[:, None] * freqs[None, :]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = RMSNorm(dim)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def float_bits(value: float) -> str:
    return struct.pack(">f", value).hex()


VOCAB = 1024


def train(args, device: torch.device, rank: int, offload: bool):
    """``args.steps`` steps of AdamW with ``clip_grad_norm_`` on a TinyLlama sharded by FSDP2 (with
    ``CPUOffloadPolicy`` when ``offload``); returns the global losses, the gradient norms and the model."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(args.seed)
    model = TinyLlama(VOCAB, args.dim, args.layers, heads=8, hidden=4 * args.dim)
    policy = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    if not offload:
        model.to(device)
    for block in model.blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    data = torch.Generator().manual_seed(args.seed * 1000 + rank)
    losses, norms = [], []
    for step in range(args.steps):
        tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=data).to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)  # on an accelerator, untouched by the shim
        losses.append(global_loss.item() / dist.get_world_size())
        norms.append(norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item())
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.6f}  grad_norm {norms[-1]:.6f}", flush=True)
        assert math.isfinite(losses[-1])
    return losses, norms, model


def torch_alone_on_an_accelerator_group() -> str:
    """torch's own error for a CPU tensor (a gradient norm, as ``clip_grad_norm_`` reduces it under FSDP2 offload)
    on a group whose only backend serves the accelerator: ``cuda:gloo`` here, which has no CPU backend, as a
    NCCL-only group has none. The shim, if installed, is removed for the call and installed again."""
    group = dist.new_group(backend="cuda:gloo")
    dist.barrier()  # every rank's side of the new group connected before a rank may exit (Gloo's connectFullMesh)
    shim = sys.modules.get("offload_shim")
    installed = shim is not None and shim.is_installed()
    if installed:
        shim.uninstall()
    try:
        dist.all_reduce(torch.tensor(1.0), group=group)
        return "no error (unexpected)"
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    finally:
        if installed:
            shim.install()


def main_on_cpu(args) -> int:
    """Without an accelerator there is nothing to offload from, and nothing to stage through: show torch's failure
    on an accelerator-only group, then train on Gloo ranks twice, once with every collective forced through the
    shim's staging path with host copies (``configure(staging_device="cpu", always_stage=True)``: real copies, the
    collective on the staged tensors, results copied back) and once without the shim, and report whether losses,
    gradient norms and parameters agree to the bit."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    failure = torch_alone_on_an_accelerator_group()
    if rank == 0:
        print("torch alone, a CPU tensor's all_reduce on a group that serves only the accelerator (cuda:gloo here, "
              f"as nccl on a GPU machine):\n  {failure}", flush=True)
    shim = sys.modules.get("offload_shim")
    if shim is None or not shim.is_installed():
        if rank == 0:
            print("offload_shim is not switched on: run with OFFLOAD_SHIM=1 to see it stage this training's "
                  "collectives (through host copies here, on Gloo ranks, for want of an accelerator).", flush=True)
        dist.destroy_process_group()
        return 0
    cpu = torch.device("cpu")
    runs = {}
    for name, staged in (("staged through host copies", True), ("without the shim", False)):
        if rank == 0:
            print(f"run {name}: torch {torch.__version__}, world {dist.get_world_size()}, backend gloo, no accelerator", flush=True)
        if staged:
            shim.configure(staging_device="cpu", always_stage=True)
            shim.reset_staging_counters()
        else:
            shim.uninstall()
        losses, norms, model = train(args, cpu, rank, offload=False)
        runs[name] = (losses, norms, {n: p.full_tensor() for n, p in model.named_parameters()})
        if staged and rank == 0:
            counts = shim.staging_counters()
            print(f"staged {sum(c.calls for c in counts.values())} calls of {len({k.op for k in counts})} collectives, "
                  f"{sum(c.bytes for c in counts.values()) / 2**20:.1f} MiB of FSDP2's tensors, through host copies",
                  flush=True)
    (losses, norms, full), (ref_losses, ref_norms, ref_full) = runs.values()
    same = losses == ref_losses and norms == ref_norms and all(torch.equal(full[n], ref_full[n]) for n in full)
    if rank == 0:
        print(f"{len(full)} parameters gathered with full_tensor() in each run; losses, gradient norms and "
              f"parameters {'bitwise equal' if same else 'DIFFER'} with and without the shim", flush=True)
        print("On a machine with GPUs the same command trains with CPUOffloadPolicy on a NCCL-only group: without the "
              "shim clip_grad_norm_ fails with the error above; with it, the CPU tensors are staged through each "
              "rank's GPU (pinned, non-blocking copies) instead of host copies.", flush=True)
    dist.destroy_process_group()
    return 0 if same else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, help="default 20; 3 on a machine without an accelerator")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="nccl", help="process group backend, e.g. nccl or cpu:gloo,cuda:nccl")
    parser.add_argument("--no-offload", action="store_true", help="keep parameters on the accelerator")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--out", help="directory for rank 0's results")
    parser.add_argument("--name", help="run name for the result files (default: from the options)")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 20 if torch.accelerator.is_available() else 3

    if not torch.accelerator.is_available():
        return main_on_cpu(args)

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device(torch.accelerator.current_accelerator().type, local_rank)
    torch.accelerator.set_device_index(local_rank)
    dist.init_process_group(args.backend, device_id=device)
    name = args.name or ("no-offload" if args.no_offload else "offload-" + args.backend.replace(":", "-").replace(",", "+"))
    shim = sys.modules.get("offload_shim")
    if rank == 0:
        print(
            f"run {name}: torch {torch.__version__}, nccl {'.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else '-'}, "
            f"world {dist.get_world_size()}, backend {dist.get_backend()}, "
            f"offload_shim {'installed' if shim is not None and shim.is_installed() else 'not installed'}",
            flush=True,
        )

    losses, norms, model = train(args, device, rank, offload=not args.no_offload)
    full = {n: p.full_tensor().cpu() for n, p in model.named_parameters()}
    if rank == 0:
        devices = sorted({str(p.to_local().device.type) for p in model.parameters()})
        print(f"local parameter devices {devices}; gathered {len(full)} parameters with full_tensor()", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            torch.save(full, os.path.join(args.out, f"{name}.pt"))
            with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                json.dump(
                    {
                        "name": name,
                        "torch": torch.__version__,
                        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
                        "backend": args.backend,
                        "offload": not args.no_offload,
                        "offload_shim_installed": bool(shim is not None and shim.is_installed()),
                        "losses": losses,
                        "grad_norms": norms,
                        "loss_bits": [float_bits(v) for v in losses],
                        "grad_norm_bits": [float_bits(v) for v in norms],
                    },
                    f,
                    indent=1,
                )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
