"""Living with other patches, run in a fresh interpreter by tests/test_other_patches.py (one rank, a Gloo group,
staging forced through the CPU, every staging decision recorded).

Every order of: install, a user's wrapper put on ``torch.distributed.all_reduce``, one put on
``torch.distributed.distributed_c10d.all_reduce``, uninstall, install again. After each step, through both
spellings, one call is staged exactly once while the shim is installed and never otherwise, and each user wrapper
in the call's path runs exactly once; at the end, after uninstall, each spelling holds torch's own function or the
user's wrapper, nothing of the shim. Then: a wrapper without ``functools.wraps``; reloads.
Prints one line per part; exits non-zero on the first failure.
"""

from __future__ import annotations

import functools
import importlib
import itertools

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import offload_shim
from observe import recording_staging

TORCH_ALL_REDUCE = c10d.all_reduce
SPELLINGS = {"torch.distributed": dist, "torch.distributed.distributed_c10d": c10d}


_CALLS: dict[int, object] = {}  # user wrapper (by id) -> what it calls


class UserWrapper:
    """What a user's or another tool's patch does: ``module.all_reduce = wraps(old)(...)``; counts its calls."""

    def __init__(self, module, use_wraps=True):
        self.module, self.seen, self.calls = module, module.all_reduce, 0
        seen = self.seen

        def user_all_reduce(*args, **kwargs):
            self.calls += 1
            return seen(*args, **kwargs)

        self.function = functools.wraps(seen)(user_all_reduce) if use_wraps else user_all_reduce
        _CALLS[id(self.function)] = seen
        module.all_reduce = self.function


def check_calls(installed: bool, wrappers: list[UserWrapper], where: str) -> None:
    for name, module in SPELLINGS.items():
        before = {id(w): w.calls for w in wrappers}
        tensor = torch.arange(4.0)
        with recording_staging() as staged:
            module.all_reduce(tensor)
        assert torch.equal(tensor, torch.arange(4.0)), where
        assert len(staged) == (1 if installed else 0), (where, name, staged)
        for wrapper in wrappers:
            in_path = _in_path(module.all_reduce, wrapper.function)
            assert wrapper.calls - before[id(wrapper)] == (1 if in_path else 0), (where, name)


def _in_path(function, target) -> bool:
    """Whether calling ``function`` runs ``target``: ``target`` is it, or is what it calls, transitively."""
    seen = set()
    while function is not None and id(function) not in seen:
        if function is target:
            return True
        seen.add(id(function))
        inner = _CALLS.get(id(function))  # a user wrapper calls what it saw; anything else, its __wrapped__
        function = inner if inner is not None else getattr(function, "__wrapped__", None)
    return False


def permutations() -> int:
    steps = ["install", "install", "uninstall", "patch torch.distributed", "patch distributed_c10d"]
    orders = sorted(set(itertools.permutations(steps)))
    for order in orders:
        assert dist.all_reduce is TORCH_ALL_REDUCE and c10d.all_reduce is TORCH_ALL_REDUCE, "not pristine"
        wrappers: list[UserWrapper] = []
        for step in order:
            if step == "install":
                offload_shim.install()
            elif step == "uninstall":
                offload_shim.uninstall()
            else:
                wrappers.append(UserWrapper(dist if step == "patch torch.distributed" else c10d))
            check_calls(offload_shim.is_installed(), wrappers, f"{order} after {step}")
        offload_shim.uninstall()
        check_calls(False, wrappers, f"{order} uninstalled")
        patched = {w.module for w in wrappers}
        for name, module in SPELLINGS.items():
            if module not in patched:
                assert module.all_reduce is TORCH_ALL_REDUCE, (order, name, module.all_reduce)
        for module in SPELLINGS.values():  # pristine for the next order
            module.all_reduce = TORCH_ALL_REDUCE
    return len(orders)


def wrapper_without_wraps() -> None:
    for modules in ([dist], [c10d, dist]):  # at the alias only; at the home and the alias (nothing names parameters)
        wrappers = [UserWrapper(module, use_wraps=False) for module in modules]
        offload_shim.install()
        check_calls(True, wrappers, f"no functools.wraps on {[m.__name__ for m in modules]}")
        offload_shim.uninstall()
        assert all(w.module.all_reduce is w.function for w in wrappers)
        for module in SPELLINGS.values():
            module.all_reduce = TORCH_ALL_REDUCE


def reloads() -> None:
    offload_shim.install()
    offload_shim.configure(chunk_bytes=12345)
    importlib.reload(offload_shim)  # (the package's own code; its internal modules are not reloadable)
    assert offload_shim.settings().chunk_bytes == 12345 and offload_shim.is_installed()
    check_calls(True, [], "after reloads")
    offload_shim.uninstall()
    assert dist.all_reduce is TORCH_ALL_REDUCE and c10d.all_reduce is TORCH_ALL_REDUCE
    check_calls(False, [], "after reloads, uninstalled")


def main() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    offload_shim.uninstall()  # OFFLOAD_SHIM=0 in the environment: start pristine
    offload_shim.configure(staging_device="cpu", always_stage=True)
    print(f"orders of install, user patches, uninstall, reinstall checked: {permutations()}")
    wrapper_without_wraps()
    print("a user wrapper without functools.wraps: staged once")
    reloads()
    print("a reload of the package: settings and wrappers kept")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
