"""What the sitecustomize drop-in adds to the start-up of a Python process that never imports torch.

    python benchmarks/bench_dropin_startup.py [--blocks 10] [--per-block 10] [--json FILE]

Starts ``python -c pass`` without and with the drop-in (``offload-shim dropin`` into a temporary directory on
PYTHONPATH; the run without it gets an empty directory there, so both interpreters search the same number of
path entries), alternating the two in blocks, and reports each side's minimum wall time, their difference and
their ratio; and the modules that are imported with the drop-in and not without it (expected: ``sitecustomize``
alone).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

LIST_MODULES = "import sys; print(' '.join(sorted(sys.modules)))"


def start(env: dict, code: str = "pass") -> tuple[float, str]:
    began = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - began, out.stdout


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--per-block", type=int, default=10)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as empty, tempfile.TemporaryDirectory() as site:
        subprocess.run([sys.executable, "-c", "import sys, offload_shim_cli; sys.exit(offload_shim_cli.main())",
                        "dropin", site], check=True, capture_output=True)
        base = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_SHIM")}
        sides = {"without": {**base, "PYTHONPATH": empty}, "with drop-in": {**base, "PYTHONPATH": site}}
        best = {name: float("inf") for name in sides}
        for _ in range(args.blocks):
            for name, env in sides.items():
                for _ in range(args.per_block):
                    best[name] = min(best[name], start(env)[0])
        modules = {name: set(start(env, LIST_MODULES)[1].split()) for name, env in sides.items()}
    extra = sorted(modules["with drop-in"] - modules["without"])
    result = {
        "python": sys.version.split()[0],
        "starts_per_side": args.blocks * args.per_block,
        "without_ms": best["without"] * 1e3,
        "with_dropin_ms": best["with drop-in"] * 1e3,
        "added_ms": (best["with drop-in"] - best["without"]) * 1e3,
        "ratio": best["with drop-in"] / best["without"],
        "modules_added": extra,
    }
    print(f"python -c pass, minimum of {result['starts_per_side']} starts each, alternating in blocks:")
    print(f"  without {result['without_ms']:.2f} ms, with the drop-in {result['with_dropin_ms']:.2f} ms: "
          f"{result['added_ms']:+.2f} ms ({result['ratio']:.3f}x)")
    print(f"  modules imported with the drop-in only: {' '.join(extra) or '-'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
