"""Line profile of a pinned 256 MiB all_reduce(async_op=True) on a one-rank NCCL group (diagnosis probe)."""
import io, json, os, sys, time, types
import torch, torch.distributed as dist
import offload_shim
from offload_shim import _execute, _plan, _staging, _groups, _wrappers, _counters, _config, _devices
from line_profiler import LineProfiler

out = sys.argv[1]
device = torch.device("cuda", 0); torch.cuda.set_device(device)
dist.init_process_group("nccl", device_id=device)
host = torch.ones((256 << 20) // 4, pin_memory=True)

def returned(rounds=15):
    best = float("inf")
    for _ in range(rounds):
        torch.accelerator.synchronize()
        t = time.perf_counter(); w = dist.all_reduce(host, async_op=True); best = min(best, time.perf_counter() - t)
        w.wait(); torch.accelerator.synchronize()
    return best

for _ in range(5):
    dist.all_reduce(host, async_op=True).wait()
before = returned()
lp = LineProfiler()
funcs = [_plan.decide, _plan._stage, _plan._chunks, _plan._decided if hasattr(_plan, "_decided") else None,
         _execute.run, _execute._pipelined, _execute._host_bytes, _execute._run_async, _execute._agreement,
         _execute._launcher, _execute._handle, _staging.BackgroundWork.__init__, _groups.agree, _groups.lane,
         _staging.new_stream, _wrappers._bind, _counters.count]
for name in ("expect_writes", "finish_writes_to", "_span"):
    if hasattr(_staging, name): funcs.append(getattr(_staging, name))
wrapper = dist.all_reduce
inner = getattr(wrapper, "_self_wrapper", None)
if inner is not None: funcs.append(inner)
def nested(fn):
    for c in fn.__code__.co_consts:
        if isinstance(c, types.CodeType):
            g = types.FunctionType(c, fn.__globals__, closure=tuple(types.CellType() for _ in c.co_freevars))
            yield g
            yield from nested(g)
for f in (_execute._launcher, _execute._run_async):
    funcs.extend(nested(f))
for f in funcs:
    if f is not None: lp.add_function(f)
lp.enable_by_count()
for _ in range(20):
    torch.accelerator.synchronize()
    w = dist.all_reduce(host, async_op=True)
    w.wait()
lp.disable_by_count()
s = io.StringIO(); lp.print_stats(stream=s, output_unit=1e-6, stripzeros=True)
open(os.path.join(out, "lines.txt"), "w").write(s.getvalue())
after = returned()
print(json.dumps({"returned_min_before_s": before, "returned_min_after_s": after}))
dist.destroy_process_group()
