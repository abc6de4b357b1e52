"""Living with other patches and reloads (tests/other_patches.py, in a fresh interpreter: it patches
torch.distributed for real)."""

import os

from interpreters import python

HERE = os.path.dirname(os.path.abspath(__file__))


def test_other_patches_and_reloads():
    result = python(
        f"import sys; sys.path.insert(0, {HERE!r}); sys.argv = ['other_patches']",
        f"import runpy; runpy.run_path({os.path.join(HERE, 'other_patches.py')!r}, run_name='__main__')",
        env={"OFFLOAD_SHIM": "0"},
    )
    lines = result.stdout.splitlines()
    print("\n".join(lines))
    assert lines[0] == "orders of install, user patches, uninstall, reinstall checked: 60", lines
    assert lines[1:] == [
        "a user wrapper without functools.wraps: staged once",
        "a reload of the package: settings and wrappers kept",
    ], lines
