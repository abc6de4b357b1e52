"""Run PyTorch's distributed collective tests twice, with torch alone and with every CPU tensor staged (the
shim on, forced through the CPU: ``OFFLOAD_SHIM=1``, ``OFFLOAD_SHIM_STAGING_DEVICE=cpu``,
``OFFLOAD_SHIM_ALWAYS_STAGE=1``), and report which pass where. Each test spawns its own ranks (fresh interpreters,
so the shim switches on at their ``import torch``).

    python tests/torch_suite/run.py [--world-size N] [-k EXPRESSION] [--out FILE.json]

Exit status 1 where a test passes alone and fails staged. Takes many minutes: not part of the CI suite.
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
FORCED = {"OFFLOAD_SHIM": "1", "OFFLOAD_SHIM_STAGING_DEVICE": "cpu", "OFFLOAD_SHIM_ALWAYS_STAGE": "1"}


def outcomes(world_size: int, expression: str, staged: bool) -> tuple[dict[str, str], int]:
    """Each selected test's outcome (passed, failed or skipped), and the calls the shim staged in all their ranks
    (each rank prints its table at exit: ``OFFLOAD_SHIM_SUMMARY``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_SHIM")}
    env.update(BACKEND="gloo", WORLD_SIZE=str(world_size), **(FORCED if staged else {}))
    if staged:
        env["OFFLOAD_SHIM_SUMMARY"] = "1"
    with tempfile.TemporaryDirectory() as directory:
        report = pathlib.Path(directory) / "report.xml"
        env["TEMP_DIR"] = directory
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-o", "addopts=", "-o",
             "python_files=*.py", str(HERE / "distributed_tests.py"), "-k", expression, f"--junitxml={report}"],
            env=env, cwd=directory, check=False, capture_output=True, text=True,
        )
        print(run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:])
        calls = sum(int(n) for n in re.findall(r"^total\s+(\d+)\s", run.stdout + run.stderr, re.M))
        results = {}
        for case in ElementTree.parse(report).getroot().iter("testcase"):
            kinds = {child.tag for child in case}
            outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
            results[case.get("name")] = outcome
    return results, calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("-k", default=COLLECTIVES, help="pytest's -k expression selecting the tests")
    parser.add_argument("--out", help="write both runs' outcomes here (JSON)")
    args = parser.parse_args()
    alone, _ = outcomes(args.world_size, args.k, staged=False)
    staged, calls = outcomes(args.world_size, args.k, staged=True)
    regressions = sorted(n for n, o in alone.items() if o == "passed" and staged.get(n) != "passed")
    count = lambda run, what: sum(o == what for o in run.values())  # noqa: E731
    for name, run in (("torch alone", alone), ("staged", staged)):
        print(f"{name}: {len(run)} tests, {count(run, 'passed')} passed, {count(run, 'failed')} failed, "
              f"{count(run, 'skipped')} skipped")
    print(f"calls staged in the staged run, over every rank: {calls}")
    print(f"pass alone, fail staged: {len(regressions)}" + "".join(f"\n  {n}" for n in regressions))
    fixed = sorted(n for n, o in staged.items() if o == "passed" and alone.get(n) != "passed")
    print(f"fail alone, pass staged: {len(fixed)}" + "".join(f"\n  {n}" for n in fixed))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"world_size": args.world_size, "expression": args.k,
                                                      "staged_calls": calls, "alone": alone, "staged": staged},
                                                     indent=1, sort_keys=True))
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
