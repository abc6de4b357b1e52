"""The served path's decision for a CPU all_reduce on a two-backend group rebuilt step by step (s1: the tensor read;
s2: + isinstance and the __torch_function__ check; s3: + is_cpu; s4: + the group's answer; s5: + the size check), each
through wrapt around a function that copies ARGV[1] KiB, in turn with the shim's own wrapper; the median difference
within a turn against a pass-through s0 (s0b: a second pass-through), in us. python steps.py KIB"""
import os, time, statistics, sys, math
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29634")
import torch, torch.distributed as dist, wrapt
import torch.testing._internal.distributed.fake_pg  # noqa
import offload_shim
from offload_shim import _groups
dist.init_process_group("gloo", rank=0, world_size=1)
two = dist.new_group(backend="cpu:gloo,cuda:fake")
offload_shim.install()
host = torch.ones(1)
args, kwargs = (host,), {"group": two}
shim = dist.all_reduce
shim(*args, **kwargs)
answers = _groups.host_answers
Tensor = torch.Tensor; _overrides = torch.overrides.has_torch_function_unary; INF = math.inf
def s0(w, i, a, k): return w(*a, **k)
def s1(w, i, a, k):
    t = a[0] if len(a) > 0 else k.get("tensor")
    return w(*a, **k)
def s2(w, i, a, k):
    t = a[0] if len(a) > 0 else k.get("tensor")
    if not isinstance(t, Tensor) or _overrides(t): return w(*a, **k)
    return w(*a, **k)
def s3(w, i, a, k):
    t = a[0] if len(a) > 0 else k.get("tensor")
    if not isinstance(t, Tensor) or _overrides(t): return w(*a, **k)
    if not t.is_cpu: return w(*a, **k)
    return w(*a, **k)
def s4(w, i, a, k):
    t = a[0] if len(a) > 0 else k.get("tensor")
    if not isinstance(t, Tensor) or _overrides(t): return w(*a, **k)
    if not t.is_cpu: return w(*a, **k)
    g = a[1] if len(a) > 1 else k.get("group")
    b = answers.get(g)
    return w(*a, **k)
def s5(w, i, a, k):
    t = a[0] if len(a) > 0 else k.get("tensor")
    if not isinstance(t, Tensor) or _overrides(t): return w(*a, **k)
    if not t.is_cpu: return w(*a, **k)
    g = a[1] if len(a) > 1 else k.get("group")
    b = answers.get(g)
    if b is INF or t.nbytes < b: return w(*a, **k)
    return w(*a, **k)
size = int(sys.argv[1]) << 10
x = bytearray(size); y = bytearray(size)
def work(*p, **q): x[:] = y
routes = {n: wrapt.FunctionWrapper(work, f) for n, f in [("s0", s0), ("s0b", lambda w, i, a, k: w(*a, **k)), ("s1", s1), ("s2", s2), ("s3", s3), ("s4", s4), ("s5", s5), ("shim", shim._self_wrapper)]}
named = list(routes.items()); spent = {k: [] for k in routes}
for turn in range(-200, 20000):
    r = turn % len(named)
    for name, f in named[r:] + named[:r]:
        s = time.thread_time_ns(); f(*args, **kwargs); e = time.thread_time_ns() - s
        if turn >= 0: spent[name].append(e)
md = lambda p, q: statistics.median(u - v for u, v in zip(spent[p], spent[q])) / 1000
print(f"thrash {size>>10} KiB:", {n: round(md(n, "s0"), 3) for n in routes})
