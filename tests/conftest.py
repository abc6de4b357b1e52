import pathlib
import shutil
import subprocess
import sys

import pytest

from contracts import NOT_IN_CONTRACT
from ranks import RankPool


ROOT = pathlib.Path(__file__).resolve().parents[1]


SOURCE_FILES = (
    "setup.cfg", "pyproject.toml", "MANIFEST.in", "README.md", "docs/package.md", "LICENSE", "offload_shim_autoload.py", "offload_shim_boot.py", "offload_shim_cli.py",
    "offload_shim_names.py",
    "sitecustomize_template.py", "build_backend/offload_shim_build.py",
)


def copy_source(destination: pathlib.Path) -> pathlib.Path:
    """The files a build of offload_shim reads, copied from this tree into ``destination`` (returned)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist")
    shutil.copytree(ROOT / "offload_shim", destination / "offload_shim", ignore=ignore)
    for name in SOURCE_FILES:
        (destination / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, destination / name)
    return destination


@pytest.fixture(scope="session")
def wheel_site(tmp_path_factory):
    """offload_shim as users install it: a wheel built from this tree (the files a build reads, copied away so
    nothing is written here), installed with ``pip install --target`` into a directory that tests put first on
    PYTHONPATH (``interpreters.environment(site=...)``); its ``torch.backends`` entry point and console script come
    with it. Returns that directory."""
    top = tmp_path_factory.mktemp("wheel")
    source = copy_source(top / "source")
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(top), str(source)], check=True, capture_output=True)
    (wheel,) = top.glob("offload_shim-*.whl")
    site = top / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, capture_output=True)
    return str(site)


@pytest.fixture(params=["source", "wheel"])
def install(request):
    """Which offload_shim the fresh interpreters of a test import: ``None`` for this tree (the editable install the
    README's set-up makes), or the directory of the built wheel's install (:func:`wheel_site`)."""
    return request.getfixturevalue("wheel_site") if request.param == "wheel" else None


@pytest.fixture(scope="session")
def gloo_ranks():
    """Two ranks of a Gloo group (serves CPU)."""
    pool = RankPool(world_size=2, backend="gloo")
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def three_gloo_ranks():
    """Three ranks of a Gloo group (serves CPU)."""
    pool = RankPool(world_size=3, backend="gloo")
    yield pool
    pool.close()


def accelerator_rank_pool(world_size: int) -> RankPool:
    """``world_size`` ranks, each on accelerator ``rank % device_count``, of a group whose only backend is the
    accelerator's (NCCL on CUDA)."""
    import torch
    import torch.distributed as dist

    backend = dist.Backend.default_device_backend_map[torch.accelerator.current_accelerator().type]
    return RankPool(world_size=world_size, backend=backend, timeout=300)


@pytest.fixture(scope="module")
def accelerator_ranks():
    """Two ranks, one accelerator each (see :func:`accelerator_rank_pool`). Per module: GPU test files that start
    torchrun or pools of their own run while none is alive."""
    pool = accelerator_rank_pool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def accelerator_only_ranks():
    """Two ranks of a group whose only backend serves ``cuda``, on a machine without CUDA: torch's own
    reproduction of ``No backend type associated with device type cpu`` (case 06)."""
    import torch

    if torch.accelerator.is_available():
        pytest.skip("needs a machine without an accelerator")
    pool = RankPool(world_size=2, backend="cuda:gloo")
    yield pool
    pool.close()



class ContractTally:
    """Counts the generated contract cases (tests/contracts.py) of a run for the report at its end. Tests record
    each case as a ``contract_case`` user property, which reaches this process from pytest-xdist's workers too."""

    def __init__(self):
        self.cases = {}
        self.calls = {}
        self.refused = {}  # "op/dtype/reduce op: error type" -> count
        self.bounded = 0  # calls compared within the reordering bound rather than bitwise

    def add(self, world_size, ops, refused, bounded=0):
        self.bounded += bounded
        self.cases[world_size] = self.cases.get(world_size, 0) + 1
        for op in ops:
            self.calls[op] = self.calls.get(op, 0) + 1
        for what in refused:
            self.refused[what] = self.refused.get(what, 0) + 1

    def lines(self):
        total = sum(self.cases.values())
        by_ranks = ", ".join(f"{n} ranks: {c}" for n, c in sorted(self.cases.items()))
        by_op = ", ".join(f"{op} {c}" for op, c in sorted(self.calls.items()))
        return [
            f"contract cases run: {total} ({by_ranks}); collective calls checked: {sum(self.calls.values())}, "
            f"of which refused by torch and by the shim alike: {sum(self.refused.values())}; "
            f"compared within the reordering bound rather than bitwise: {self.bounded}",
            f"calls by collective: {by_op}",
            "refused (collective/dtype/reduce op: error, count): "
            + ", ".join(f"{what} {n}" for what, n in sorted(self.refused.items())),
            "not called by the cases: " + "; ".join(f"{what} ({why})" for what, why in NOT_IN_CONTRACT.items()),
        ]


_tally = ContractTally()
_wire = {}  # world size -> [cases, collectives recorded] of tests/test_wire_cpu.py


def pytest_runtest_logreport(report):
    if report.when == "call":
        for name, value in report.user_properties:
            if name == "contract_case":
                _tally.add(*value)
            elif name == "wire_case":
                counts = _wire.setdefault(value[0], [0, 0])
                counts[0] += 1
                counts[1] += value[1]


def pytest_terminal_summary(terminalreporter):
    if _tally.cases:
        for line in _tally.lines():
            terminalreporter.write_line(line)
    if _wire:
        cases = sum(c for c, _ in _wire.values())
        by_ranks = ", ".join(f"{n} ranks: {c}" for n, (c, _) in sorted(_wire.items()))
        recorded = sum(r for _, r in _wire.values())
        terminalreporter.write_line(
            f"wire cases run: {cases} ({by_ranks}); collectives recorded below the shim, the same on every rank: "
            f"{recorded}")
