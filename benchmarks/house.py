"""The size of the house: what a maintainer has to hold in mind to change offload_shim.

Prints, for the package of the tree it is run from (or ``--tree DIR``):

* lines and modules of ``offload_shim/`` (``*.py``, every line counted);
* module-level mutable names: names a module binds at its top level to a mutable object (a dict, list or set display
  or comprehension; a call of a mutable container, lock, thread-local, weak table, queue or counter, or of a class of
  the module's own that subclasses ``threading.local``; a ``globals().get(...)``), or rebinds from a function
  (``global``); each counted once per module;
* ``globals().get`` idioms (state kept across ``importlib.reload``);
* distinct functions of the package that one staged call runs on the calling thread (``sys.setprofile``, which
  sees the calling thread only): an ``all_reduce`` of 64 MiB and of 16 B of float32 on two Gloo ranks with every host
  tensor staged through the host (``staging_device="cpu"``, ``always_stage``), the third call of each (the first makes
  the group's agreement and buffers), rank 0's count.

Run: ``python benchmarks/house.py [--tree DIR]`` on the CPU machine (CPU torch, two cores suffice).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import subprocess
import sys

MUTABLE_CALLS = {
    "dict", "list", "set", "OrderedDict", "defaultdict", "deque", "WeakKeyDictionary", "WeakValueDictionary",
    "WeakIdKeyDictionary", "WeakSet", "Lock", "RLock", "Condition", "Event", "local", "SimpleQueue", "Queue", "count",
}


def _called(node) -> str | None:
    if isinstance(node, ast.Call):
        function = node.func
        return function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
    return None


def _mutable(value, local_classes: set[str]) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.BoolOp):  # ``globals().get("x") or []``
        return any(_mutable(each, local_classes) for each in value.values)
    name = _called(value)
    if name in MUTABLE_CALLS or name in local_classes:
        return True
    if name == "get" and isinstance(value.func.value, ast.Call) and _called(value.func.value) == "globals":
        return True
    return False


def mutable_names(source: str) -> set[str]:
    tree = ast.parse(source)
    local_classes = {
        node.name for node in tree.body if isinstance(node, ast.ClassDef)
        and any(getattr(base, "attr", getattr(base, "id", None)) == "local" for base in node.bases)
    }
    names = set()
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        if value is not None and _mutable(value, local_classes):
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            names.update(node.names)
    return names


def static(package: pathlib.Path) -> dict:
    sources = {path.name: path.read_text() for path in sorted(package.glob("*.py"))}
    names = {module: sorted(mutable_names(source)) for module, source in sources.items()}
    names = {module: found for module, found in names.items() if found}
    return {
        "lines": sum(len(source.splitlines()) for source in sources.values()),
        "modules": len(sources),
        "mutable_names": sum(map(len, names.values())),
        "modules_with_mutable_names": len(names),
        "globals_get": sum(source.count("globals().get(") for source in sources.values()),
        "mutable_names_by_module": names,
    }


_PROFILED = r'''
import json, os, sys, datetime
import torch, torch.distributed as dist
import offload_shim
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
offload_shim.configure(staging_device="cpu", always_stage=True)
package = os.path.dirname(offload_shim.__file__) + os.sep
counts = {}
for nbytes in (64 << 20, 16):
    tensor = torch.ones(nbytes // 4)
    for _ in range(2):
        dist.all_reduce(tensor)
    seen = set()
    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            seen.add((frame.f_code.co_filename, frame.f_code.co_firstlineno, frame.f_code.co_name))
    sys.setprofile(profile)
    dist.all_reduce(tensor)
    sys.setprofile(None)
    counts[nbytes] = {"functions": len(seen), "modules": len({file for file, _, _ in seen})}
if dist.get_rank() == 0:
    print("HOUSE " + json.dumps(counts))
dist.destroy_process_group()
'''


def dynamic(tree: pathlib.Path) -> dict:
    script = pathlib.Path("/tmp/offload_shim_house_profile.py")
    script.write_text(_PROFILED)
    environ = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    environ.pop("OFFLOAD_SHIM", None)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
        env=environ, capture_output=True, text=True, timeout=300, cwd=tree)
    line = next((line for line in result.stdout.splitlines() if line.startswith("HOUSE ")), None)
    if line is None:
        raise SystemExit(f"the profiled call failed:\n{result.stdout}\n{result.stderr[-3000:]}")
    counts = json.loads(line[len("HOUSE "):])
    return {"functions_64MiB": counts[str(64 << 20)]["functions"], "modules_64MiB": counts[str(64 << 20)]["modules"],
            "functions_16B": counts["16"]["functions"], "modules_16B": counts["16"]["modules"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=str(pathlib.Path(__file__).resolve().parents[1]),
                        help="the tree whose offload_shim/ is measured (default: this one)")
    parser.add_argument("--json", action="store_true", help="print JSON, names by module included")
    options = parser.parse_args()
    tree = pathlib.Path(options.tree).resolve()
    figures = {**static(tree / "offload_shim"), **dynamic(tree)}
    if options.json:
        print(json.dumps(figures, indent=1))
        return
    for key, value in figures.items():
        if key != "mutable_names_by_module":
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
