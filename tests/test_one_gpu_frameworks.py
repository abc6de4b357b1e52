"""One-GPU tests of the metric and logging recipes (examples/recipes/): each run as a user runs it, under
``torchrun --nproc_per_node 1`` on a NCCL group, fails with torch's error without the shim and gives the checked
values with ``OFFLOAD_SHIM=1`` (every operation of the recipe: its ``RESULT`` line says ``status=ok``).

Run: ``python -m pytest -o addopts="" -m gpu tests/test_one_gpu_frameworks.py`` (skipped without an accelerator,
and per recipe where its framework is not installed). With ``RECIPES_LOG=DIR`` each run's command and output are
also written to ``DIR/RECIPE.shim.log`` and ``DIR/RECIPE.no-shim.log``.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator"),
]
RECIPES = pathlib.Path(__file__).resolve().parent.parent / "examples" / "recipes"
TORCH_ERRORS = ("No backend type associated with device type cpu", "Tensors must be CUDA and dense")
# recipe: the framework it needs, and the operations it reports
CASES = {
    "accelerate_metrics": ("accelerate", ["reduce", "gather", "gather_for_metrics", "pad_across_processes",
                                          "broadcast"]),
    "lightning_sync_dist": ("lightning", ["self.log per step", "self.log per epoch"]),
    "torchmetrics_cpu": ("torchmetrics", ["MeanMetric.compute", "CatMetric.compute", "BinaryAccuracy.compute"]),
    "broadcast_size": (None, ["exchange"]),
}


def _run(recipe: str, shim: str) -> tuple[int, str]:
    env = {**os.environ, "OFFLOAD_SHIM": shim, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               str(RECIPES / f"{recipe}.py")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    if os.environ.get("RECIPES_LOG"):
        log = pathlib.Path(os.environ["RECIPES_LOG"], f"{recipe}.{'shim' if shim == '1' else 'no-shim'}.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"$ OFFLOAD_SHIM={shim} {' '.join(command)}\nexit {done.returncode}\n{output}")
    return done.returncode, output


@pytest.mark.parametrize("recipe", sorted(CASES))
def test_recipe_fails_without_the_shim_and_is_right_with_it(recipe):
    framework, operations = CASES[recipe]
    if framework is not None and importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed")
    code, output = _run(recipe, "0")
    assert code != 0 and "status=fail" in output, output[-3000:]
    for operation in operations:  # each operation reported torch's error
        line = next((l for l in output.splitlines() if l.startswith(f"{operation}: ")), "")
        assert any(error in line for error in TORCH_ERRORS), (operation, output[-3000:])
    code, output = _run(recipe, "1")
    result = re.search(r"^RESULT .*$", output, re.M)
    assert code == 0 and result and "status=ok" in result.group(0) and "shim=on" in result.group(0), output[-3000:]
    for operation in operations:
        assert re.search(rf"^{re.escape(operation)}: .* as expected", output, re.M), (operation, output[-3000:])
