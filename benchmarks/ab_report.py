"""The table of an A/B run (``benchmarks/ab_staging.sh``): for each figure the issue's bound is about, each side's
minimum over its runs and this tree's over the other's, with the bare CUDA graph of the small calls beside them (it
runs no code of the shim's: how far the machine itself moved).

    python3 benchmarks/ab_report.py OUTDIR     # OUTDIR holds other1/bench.json, this1/bench.json, ...
"""

from __future__ import annotations

import argparse
import json
import pathlib

# (label, record kind, what tells the record, key); seconds.
FIGURES = [
    ("pinned all_reduce 256 MiB", "duplex", {}, "offload_shim_seconds"),
    ("pinned all_reduce 256 MiB, beside the pageable routes", "pageable", {}, "offload_shim_pinned_seconds"),
    ("pageable all_reduce 256 MiB, a storage's first call", "pageable", {}, "offload_shim_bounce_seconds"),
    ("pageable 256 MiB reused, registered", "pageable", {}, "offload_shim_registered_seconds"),
    *((f"{case} {op}, small (replayed)", "small", {"op": op, "case": case}, key)
      for op, case in [("all_reduce", "0-dim fp32 SUM"), ("all_reduce", "1-element int8 MIN flag"),
                       ("broadcast", "0-dim fp32 from rank 0"), ("broadcast", "1-element int8 from rank 0")]
      for key in ("offload_shim_seconds", "bare_graph_seconds")),
    *((f"async {'pinned' if pinned else 'pageable'} all_reduce 256 MiB, {what}", "async", {"pinned": pinned},
       f"async_{what}_seconds") for pinned in (True, False) for what in ("returned", "completed")),
]


def _value(records, kind, match, key):
    for record in records:
        if record.get("kind") == kind and all(record.get(k) == v for k, v in match.items()) and key in record:
            return record[key]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir", type=pathlib.Path)
    out = parser.parse_args().outdir
    runs = {"other": [], "this": []}
    for path in sorted(out.glob("*/bench.json")):
        side = "other" if path.parent.name.startswith("other") else "this"
        runs[side].append(json.loads(path.read_text())["records"])
    print(f"runs: other {len(runs['other'])}, this {len(runs['this'])}; each side's minimum, seconds\n")
    print("| figure | other | this | this / other |\n| --- | --- | --- | --- |")
    for label, kind, match, key in FIGURES:
        sides = {}
        for side, records in runs.items():
            values = [v for v in (_value(r, kind, match, key) for r in records) if v is not None]
            sides[side] = min(values) if values else None
        if None in sides.values():
            continue
        shown = label + (" (bare graph)" if key == "bare_graph_seconds" else "")
        print(f"| {shown} | {sides['other']:.4g} | {sides['this']:.4g} | {sides['this'] / sides['other']:.3f} |")


if __name__ == "__main__":
    main()
