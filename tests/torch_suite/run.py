"""Run PyTorch's distributed tests twice, with torch alone and with every CPU tensor staged (the shim on, forced
through the CPU: ``OFFLOAD_SHIM=1``, ``OFFLOAD_SHIM_STAGING_DEVICE=cpu``, ``OFFLOAD_SHIM_ALWAYS_STAGE=1``), and
report which pass where, module by module, with the calls the shim staged in each. Each test spawns its own ranks
(fresh interpreters, so the shim switches on at their ``import torch``), or runs threaded ranks in its process.

    python tests/torch_suite/run.py [--world-size N] [-k EXPRESSION] [--out FILE.json]
    python tests/torch_suite/run.py --pytorch-tests PYTORCH/test [--modules PATH ...] [--out FILE.json]

The first form runs the collective tests of ``torch/testing/_internal/distributed/distributed_test.py`` (shipped in
the torch wheel) on Gloo ranks; the second also runs modules of a PyTorch source tree's ``test/`` folder (a
checkout of the release installed: its test files are not in the wheel), by default :data:`MODULES`. Exit status 1
where a test passes alone and fails staged. Takes many minutes: not part of the CI suite.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree

HERE = pathlib.Path(__file__).resolve().parent
# The collective tests of the functions the shim wraps (and their async, group and coalesced forms).
COLLECTIVES = (
    "all_reduce or broadcast or reduce or all_gather or gather or scatter or all_to_all or send_recv or isend "
    "or irecv or batch_isend_irecv or reduce_scatter or coalesced"
)
# Modules of PyTorch's test/ folder run with --pytorch-tests.
MODULES = (
    "distributed/test_functional_api.py",
    "distributed/test_c10d_functional_native.py",
    "distributed/tensor/test_dtensor.py",
    "distributed/tensor/test_redistribute.py",
    "distributed/test_c10d_object_collectives.py",
    "distributed/test_c10d_gloo.py",
)
FORCED = {"OFFLOAD_SHIM": "1", "OFFLOAD_SHIM_STAGING_DEVICE": "cpu", "OFFLOAD_SHIM_ALWAYS_STAGE": "1"}


def outcomes(target: pathlib.Path, expression: str | None, staged: bool, env: dict) -> tuple[dict[str, str], int]:
    """Each test's outcome in ``target`` (passed, failed or skipped), and the calls the shim staged in all their
    ranks (each rank prints its table at exit: ``OFFLOAD_SHIM_SUMMARY``)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_SHIM")}
    environ.update(env, **(FORCED if staged else {}))
    if staged:
        environ["OFFLOAD_SHIM_SUMMARY"] = "1"
    with tempfile.TemporaryDirectory() as directory:
        report = pathlib.Path(directory) / "report.xml"
        environ["TEMP_DIR"] = directory
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-o", "addopts=", "-o",
             "python_files=*.py", str(target), *(["-k", expression] if expression else []), f"--junitxml={report}"],
            env=environ, cwd=directory, check=False, capture_output=True, text=True,
        )
        print(f"  {target.name}, {'staged' if staged else 'alone'}: "
              + (run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]), flush=True)
        calls = sum(int(n) for n in re.findall(r"^total\s+(\d+)\s", run.stdout + run.stderr, re.M))
        results = {}
        if report.exists():
            for case in ElementTree.parse(report).getroot().iter("testcase"):
                kinds = {child.tag for child in case}
                outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
                results[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return results, calls


def compare(name: str, alone: dict, staged: dict, calls: int) -> dict:
    """One module's row: its counts alone and staged, the staged calls, and the tests whose outcome differs."""
    count = lambda run, what: sum(o == what for o in run.values())  # noqa: E731
    row = {"module": name, "tests": len(alone), "staged_calls": calls,
           "pass alone, fail staged": sorted(n for n, o in alone.items() if o == "passed" and staged.get(n) != "passed"),
           "fail alone, pass staged": sorted(n for n, o in staged.items() if o == "passed" and alone.get(n) != "passed")}
    for side, run in (("alone", alone), ("staged", staged)):
        row.update({f"{what} {side}": count(run, what) for what in ("passed", "failed", "skipped")})
    print(f"{name}: {row['tests']} tests; alone {row['passed alone']} passed, {row['failed alone']} failed, "
          f"{row['skipped alone']} skipped; staged {row['passed staged']} passed, {row['failed staged']} failed, "
          f"{row['skipped staged']} skipped; {calls} calls staged", flush=True)
    for key in ("pass alone, fail staged", "fail alone, pass staged"):
        print(f"  {key}: {len(row[key])}" + "".join(f"\n    {n}" for n in row[key]))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks of distributed_test.py's tests")
    parser.add_argument("-k", default=COLLECTIVES, help="pytest's -k expression selecting distributed_test.py's tests")
    parser.add_argument("--pytorch-tests", type=pathlib.Path, help="a PyTorch source tree's test/ folder")
    parser.add_argument("--modules", nargs="*", default=MODULES, help="modules of that folder to run (all their tests)")
    parser.add_argument("--modules-only", action="store_true", help="skip distributed_test.py's tests")
    parser.add_argument("--out", help="write every module's outcomes here (JSON)")
    args = parser.parse_args()
    targets = [] if args.modules_only else [("distributed_test.py (torch wheel)", HERE / "distributed_tests.py",
                                             args.k, {"BACKEND": "gloo", "WORLD_SIZE": str(args.world_size)})]
    if args.pytorch_tests is not None:
        root = args.pytorch_tests.resolve()
        for module in args.modules:  # (its own folder and test/ on the path: its siblings and helpers import)
            path = os.pathsep.join([str((root / module).parent), str(root), os.environ.get("PYTHONPATH", "")])
            targets.append((module, root / module, None, {"PYTHONPATH": path}))
    rows, runs = [], {}
    for name, target, expression, env in targets:
        alone, _ = outcomes(target, expression, staged=False, env=env)
        staged, calls = outcomes(target, expression, staged=True, env=env)
        rows.append(compare(name, alone, staged, calls))
        runs[name] = {"alone": alone, "staged": staged}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"world_size": args.world_size, "expression": args.k,
                                                      "modules": rows, "outcomes": runs}, indent=1, sort_keys=True))
    return 1 if any(row["pass alone, fail staged"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
