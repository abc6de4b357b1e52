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


def outcomes(world_size: int, expression: str, staged: bool) -> dict[str, str]:
    """Each selected test's outcome: passed, failed or skipped."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_SHIM")}
    env.update(BACKEND="gloo", WORLD_SIZE=str(world_size), **(FORCED if staged else {}))
    with tempfile.TemporaryDirectory() as directory:
        report = pathlib.Path(directory) / "report.xml"
        env["TEMP_DIR"] = directory
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-o",
             "python_files=*.py", str(HERE / "distributed_tests.py"), "-k", expression, f"--junitxml={report}"],
            env=env, cwd=directory, check=False,
        )
        results = {}
        for case in ElementTree.parse(report).getroot().iter("testcase"):
            kinds = {child.tag for child in case}
            outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
            results[case.get("name")] = outcome
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("-k", default=COLLECTIVES, help="pytest's -k expression selecting the tests")
    parser.add_argument("--out", help="write both runs' outcomes here (JSON)")
    args = parser.parse_args()
    alone = outcomes(args.world_size, args.k, staged=False)
    staged = outcomes(args.world_size, args.k, staged=True)
    regressions = sorted(n for n, o in alone.items() if o == "passed" and staged.get(n) != "passed")
    count = lambda run, what: sum(o == what for o in run.values())  # noqa: E731
    for name, run in (("torch alone", alone), ("staged", staged)):
        print(f"{name}: {len(run)} tests, {count(run, 'passed')} passed, {count(run, 'failed')} failed, "
              f"{count(run, 'skipped')} skipped")
    print(f"pass alone, fail staged: {len(regressions)}" + "".join(f"\n  {n}" for n in regressions))
    fixed = sorted(n for n, o in staged.items() if o == "passed" and alone.get(n) != "passed")
    print(f"fail alone, pass staged: {len(fixed)}" + "".join(f"\n  {n}" for n in fixed))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"world_size": args.world_size, "expression": args.k,
                                                      "alone": alone, "staged": staged}, indent=1, sort_keys=True))
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
