"""A staged 16 B all_reduce's cost with N outstanding asynchronous staged calls (2 Gloo ranks, staging forced
through the host). Prints rank 0's per-call microseconds (minimum of 5 blocks of 200 calls)."""
import os, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp

def main(rank, world, port, counts):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OFFLOAD_SHIM_STAGING_DEVICE="cpu",
                      OFFLOAD_SHIM_ALWAYS_STAGE="1", OMP_NUM_THREADS="1")
    import offload_shim
    offload_shim.install()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t = torch.ones(4)
    for n in counts:
        tensors = [torch.ones(4) for _ in range(n)]
        works = [dist.all_reduce(x, async_op=True) for x in tensors]
        best = float("inf")
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(200):
                dist.all_reduce(t)
            best = min(best, (time.perf_counter() - start) / 200)
        for w in works:
            w.wait()
        if rank == 0:
            print(f"outstanding {n}: {best * 1e6:.1f} us a call", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(main, args=(2, 29611, [0, 100, 3000]), nprocs=2)
