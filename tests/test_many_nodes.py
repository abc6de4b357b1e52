"""One job launched as two nodes on this machine: two torchrun agents (``--nnodes 2``, rendezvous on localhost), two
ranks each, staging forced through the CPU. Every family of collective is staged across the nodes and equals
torch's own call; what depends on the node uses the local rank and the local world size (the copy threads), what
depends on the job the global rank (log lines, the one exit summary, doctor's report on rank 0)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from interpreters import environment

JOB = r'''
import json, os, sys
import torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import offload_shim
from offload_shim import _staging

dist.init_process_group("gloo")
offload_shim.configure(chunk_bytes=16)  # (below the environment's least size: configure() takes any)
rank, world = dist.get_rank(), dist.get_world_size()
right, left = (rank + 1) % world, (rank - 1) % world
mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("node", "local"))


def value(*shape, seed=0):
    return torch.arange(rank * 100 + seed, rank * 100 + seed + torch.Size(shape).numel(), dtype=torch.float32).view(*shape)


def ring(t):
    out = torch.zeros_like(t)
    if rank % 2:
        dist.recv(out, left); dist.send(t, right)
    else:
        dist.send(t, right); dist.recv(out, left)
    return [out]


def batch(t):
    out = torch.zeros_like(t)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, right), dist.P2POp(dist.irecv, out, left)]):
        work.wait()
    return [out]


def each(function):
    return lambda t: (function(t), [t])[1]


FAMILIES = {
    "all_reduce": each(dist.all_reduce),
    "all_reduce pipelined": each(dist.all_reduce),  # 48 float32 in 16-byte chunks (configure(chunk_bytes=16))
    "all_reduce async": lambda t: (dist.all_reduce(t, async_op=True).wait(), [t])[1],
    "broadcast from node 1": each(lambda t: dist.broadcast(t, src=3)),
    "reduce to node 1": lambda t: (dist.reduce(t, dst=2), [t] if rank == 2 else [])[1],
    "all_gather": lambda t: (lambda outs: (dist.all_gather(outs, t), outs)[1])([torch.zeros_like(t) for _ in range(world)]),
    "all_gather_into_tensor": lambda t: (lambda out: (dist.all_gather_into_tensor(out, t), [out])[1])(torch.zeros(world * t.numel())),
    "reduce_scatter_tensor": lambda t: (lambda out: (dist.reduce_scatter_tensor(out, t), [out])[1])(torch.zeros(t.numel() // world)),
    "all_to_all_single": lambda t: (lambda out: (dist.all_to_all_single(out, t), [out])[1])(torch.zeros_like(t)),
    "gather to node 0": lambda t: (lambda outs: (dist.gather(t, outs, dst=1), outs or [])[1])([torch.zeros_like(t) for _ in range(world)] if rank == 1 else None),
    "scatter from node 1": lambda t: (lambda out: (dist.scatter(out, list(t.chunk(world)) if rank == 2 else None, src=2), [out])[1])(torch.zeros(t.numel() // world)),
    "send and recv across nodes": ring,
    "batch_isend_irecv": batch,
    "funcol all_reduce": lambda t: [funcol.all_reduce(t, "sum", dist.group.WORLD)],
    "funcol all_gather_tensor": lambda t: [funcol.all_gather_tensor(t, 0, dist.group.WORLD)],
    "full_tensor on a node x local mesh": lambda t: [distribute_tensor(t.view(4, -1), mesh, [Shard(0), Shard(1)]).full_tensor()],
}
agree = {}
for name, function in FAMILIES.items():
    numel = 48 if name == "all_reduce pipelined" else 8
    previous = offload_shim.configure(always_stage=False)  # the reference: torch's own call
    expected = [r.clone() for r in function(value(numel, seed=len(name)))]
    offload_shim.configure(always_stage=previous.always_stage)
    got = function(value(numel, seed=len(name)))
    agree[name] = len(got) == len(expected) and all(torch.equal(g, e) for g, e in zip(got, expected))
staged = sorted({key.op for key in offload_shim.staging_counters()})
cpus = len(os.sched_getaffinity(0))
report = {
    "rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]), "group_rank": int(os.environ["GROUP_RANK"]),
    "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]), "world_size": world,
    "copy_threads": _staging.copy_threads(), "expected_copy_threads": max(1, min(32, cpus // 2)),
    "agree": agree, "staged": staged,
}
os.write(1, ("RESULT " + json.dumps(report) + "\n").encode())  # one write: the ranks share a pipe
dist.destroy_process_group()
'''


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(tmp_path, arguments, env) -> tuple[str, str]:
    """``torchrun ... ARGUMENTS`` as two nodes of two ranks on this machine; both agents' stdout and stderr."""
    port = _port()
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
             "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port), *arguments],
            env=environment(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [agent.communicate(timeout=240) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    for agent, (out, err) in zip(agents, outputs):
        assert agent.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    return "".join(out for out, _ in outputs), "".join(err for _, err in outputs)


FORCED = {"OFFLOAD_SHIM": "1", "OFFLOAD_SHIM_STAGING_DEVICE": "cpu", "OFFLOAD_SHIM_ALWAYS_STAGE": "1"}
needs_cpu_only = pytest.mark.skipif(
    __import__("torch").accelerator.is_available(), reason="needs a machine without an accelerator"
)


@needs_cpu_only
def test_two_nodes_on_one_machine(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {**FORCED, "OFFLOAD_SHIM_LOG": "info", "OFFLOAD_SHIM_SUMMARY": "1"}
    stdout, stderr = _two_nodes(tmp_path, [str(script)], env)
    reports = sorted((json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")),
                     key=lambda r: r["rank"])
    assert [(r["rank"], r["group_rank"], r["local_rank"]) for r in reports] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    for report in reports:
        assert all(report["agree"].values()), report
        # The node's CPUs over its own ranks (2), not the job's (4); on a 2-core machine both give 1 thread.
        assert (report["local_world_size"], report["world_size"]) == (2, 4), report
        assert report["copy_threads"] == report["expected_copy_threads"], report
        # DTensor's full_tensor and the functional all_reduce are staged as the ops they run.
        assert {"torch.distributed.all_reduce", "torch.distributed.batch_isend_irecv",
                "torch.ops._c10d_functional.all_gather_into_tensor",
                "torch.ops._c10d_functional.all_reduce"} <= set(report["staged"]), report
    # Log lines name the global rank; each rank logs the first staged call of each line and collective once.
    first = re.findall(r"^\[rank (\d) pid \d+\] offload_shim: first staged call at \S+job.py:(\d+): ([\w.]+),", stderr, re.M)
    assert {rank for rank, _, _ in first} == {"0", "1", "2", "3"}, stderr
    assert len(first) == len(set(first)), stderr
    # One exit summary in the whole job: rank 0's, not the other node's first rank (local rank 0, global rank 2).
    tables = [line for line in stderr.splitlines() if line.startswith(("offload_shim: staged calls on", "offload_shim: no call"))]
    assert len(tables) == 1 and tables[0].startswith("offload_shim: staged calls on rank 0 "), tables


@needs_cpu_only
def test_doctor_on_two_nodes(tmp_path):
    """``torchrun --nnodes 2 ... -m offload_shim doctor``: global rank 0 prints every rank's lines once, in rank
    order, and finds nothing wrong."""
    stdout, _ = _two_nodes(tmp_path, ["-m", "offload_shim", "doctor", "--backend", "gloo"], FORCED)
    checked = re.findall(r"^rank (\d): all_reduce of a CPU tensor: \[10\.0, 10\.0, 10\.0, 10\.0\] on cpu \(ok\)$", stdout, re.M)
    assert checked == ["0", "1", "2", "3"], stdout
    assert stdout.count("doctor: ok") == 1, stdout
