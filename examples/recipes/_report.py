"""What the metric recipes share: each operation tried on CPU tensors, its error or its checked value, and its cost.

A recipe calls :meth:`Report.attempt` once per operation and ends with :meth:`Report.finish`. Without the shim
an operation on a NCCL-only group fails with torch's error, which is printed (its first line); with it the value
is compared with the expected one (same values and dtype, on the expected device: the CPU, where the caller made
its tensors, unless the framework makes its result elsewhere), and the call is
timed where the recipe gives the same operation on accelerator tensors (which needs no staging) to time beside
it: the minimum over ``ROUNDS`` calls, in microseconds. Rank 0 prints one ``RESULT`` line (``examples/run_recipes.sh`` reads it).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

ROUNDS = 20


def shim_state() -> str:
    shim = sys.modules.get("offload_shim")
    return "on" if shim is not None and shim.is_installed() else "off"


def _same(value, expected) -> bool:
    if isinstance(expected, torch.Tensor):
        return (isinstance(value, torch.Tensor) and value.device.type == expected.device.type
                and value.dtype == expected.dtype and torch.equal(value, expected))
    if isinstance(expected, (list, tuple)):
        return len(value) == len(expected) and all(_same(v, e) for v, e in zip(value, expected))
    return value == expected


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _microseconds(fn) -> float:
    best = float("inf")
    for _ in range(ROUNDS):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


class Report:
    def __init__(self, recipe: str):
        self.recipe = recipe
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.failed: list[str] = []
        self.figures: dict[str, float] = {}
        self.say(f"{recipe}: torch {torch.__version__}, world {self.world}, backend {dist.get_backend()}, "
                 f"offload_shim {shim_state()}")

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def attempt(self, name: str, call, expected, on_accelerator=None) -> None:
        """Run ``call()`` (CPU tensors) and check its value against ``expected``; where ``on_accelerator`` (the
        same operation on accelerator tensors) is given, time both."""
        try:
            value = call()
        except Exception as error:  # torch's error, without the shim
            self.failed.append(name)
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            self.say(f"{name}: {type(error).__name__}: {first}")
            return
        if not _same(value, expected):
            self.failed.append(name)
            self.say(f"{name}: WRONG VALUE {_shown(value)}, expected {_shown(expected)}")
            return
        if on_accelerator is None:
            self.say(f"{name}: {_shown(value)} as expected")
            return
        cost = self.figures[f"{name}_us"] = round(_microseconds(call), 1)
        reference = self.figures[f"{name}_accelerator_us"] = round(_microseconds(on_accelerator), 1)
        self.say(f"{name}: {_shown(value)} as expected; {cost} us per call (on accelerator tensors: {reference} us)")

    def finish(self) -> int:
        status = "fail" if self.failed else "ok"
        figures = " ".join(f"{key}={value}" for key, value in self.figures.items())
        self.say(f"RESULT recipe={self.recipe} status={status} world={self.world} shim={shim_state()} "
                 f"failed={','.join(self.failed) or '-'} {figures}".rstrip())
        return 1 if self.failed else 0
