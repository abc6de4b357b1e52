"""Living with other patches, reloads and warnings' locations (tests/other_patches.py, in a fresh interpreter: it
patches torch.distributed for real)."""

import os

import torch.distributed._functional_collectives as funcol
from interpreters import python

HERE = os.path.dirname(os.path.abspath(__file__))


def test_other_patches_reloads_and_warning_locations():
    result = python(
        f"import sys; sys.path.insert(0, {HERE!r}); sys.argv = ['other_patches']",
        f"import runpy; runpy.run_path({os.path.join(HERE, 'other_patches.py')!r}, run_name='__main__')",
        env={"OFFLOAD_SHIM": "0"},
    )
    lines = result.stdout.splitlines()
    print("\n".join(lines))
    assert lines[0] == "orders of install, user patches, uninstall, reinstall checked: 60", lines
    # torch 2.13 deprecates funcol.all_gather_tensor, whose warning the last check locates; 2.11 and 2.12 raise none
    warns = hasattr(funcol, "all_gather_single")
    assert lines[1:] == [
        "a user wrapper without functools.wraps: staged once",
        "reloads of the package and its stateful modules: settings and wrappers kept",
        "warnings inside wrapped calls point at the caller" if warns else "torch raises no such warning here: not checked",
    ], lines
