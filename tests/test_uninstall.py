"""Uninstalling as README.md says leaves nothing that switches the shim on. In a virtual environment of its own, a
clone is installed as the README installs it (``pip install -e``, with build isolation) and its drop-in is written.
Then ``pip uninstall -y offload_shim`` runs and the drop-in is deleted. Afterwards, under ``OFFLOAD_SHIM=1``,
``import torch`` imports nothing of offload_shim, from the clone's root (the current directory first on
``sys.path``) or from any other folder. pip's build hooks used to leave setuptools' ``offload_shim.egg-info``, with
the ``torch.backends`` entry point, in the clone's root, where torch found it after the uninstall.

The environment reuses this one's torch: this environment's site-packages, without offload_shim's own files, are
linked into a folder that a ``.pth`` line puts on the new environment's path (pip would take minutes to install
torch again)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sysconfig
import venv

from conftest import copy_source
from interpreters import SHIM_VARIABLES

# What a program prints: whether anything of offload_shim was imported, or its wrappers installed, by import torch.
PROBE = ("import sys, torch; print(sorted(m for m in sys.modules if m.startswith('offload_shim')), "
         "type(torch.distributed.all_reduce).__name__)")
NOTHING = "[] function"


def _is_the_shims(name: str) -> bool:
    return name.startswith(("offload_shim", "__editable__.offload_shim", "__editable___offload_shim"))


def _environment(top: pathlib.Path) -> pathlib.Path:
    """A virtual environment under ``top`` without pip of its own, whose path holds this one's site-packages
    (pip, setuptools and torch too) without offload_shim: its python."""
    home = top / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(home)
    python = home / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    borrowed = top / "borrowed"
    borrowed.mkdir()
    for place in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for entry in os.scandir(place):
            if not _is_the_shims(entry.name) and not entry.name.endswith(".pth") and entry.name != "__pycache__" \
                    and not (borrowed / entry.name).exists():
                (borrowed / entry.name).symlink_to(entry.path)
    pathlib.Path(purelib, "borrowed.pth").write_text(f"{borrowed}\n")
    return python


def _run(command, cwd, env=None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in SHIM_VARIABLES and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    environ.update(env or {})
    return subprocess.run(command, cwd=cwd, env=environ, capture_output=True, text=True, timeout=180)


def _probes(python, folders, env) -> dict:
    """:data:`PROBE`'s last line, run from each folder at once (one interpreter each)."""
    environ = {k: v for k, v in os.environ.items() if k not in SHIM_VARIABLES and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    environ.update(env)
    running = {folder: subprocess.Popen([python, "-c", PROBE], cwd=folder, env=environ, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True) for folder in folders}
    results = {}
    for folder, process in running.items():
        out, err = process.communicate(timeout=180)
        results[str(folder)] = (out.strip().splitlines() or [f"exit {process.returncode}: {err}"])[-1]
    return results


def test_uninstall_as_the_readme_says_leaves_nothing(tmp_path):
    python = _environment(tmp_path)
    clone = copy_source(tmp_path / "clone")
    (clone / "tests").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # What an older build left in a clone: setuptools' metadata, with the torch.backends entry point.
    stale = clone / "offload_shim.egg-info"
    stale.mkdir()
    (stale / "entry_points.txt").write_text("[torch.backends]\noffload_shim = offload_shim_autoload:autoload\n")
    (stale / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: offload_shim\nVersion: 0.0.1\n")
    pip = [str(python), "-m", "pip", "-q", "--disable-pip-version-check"]
    installed = _run([*pip, "install", "--no-deps", "-e", "."], cwd=clone)  # README's pip install -e, no extra
    assert installed.returncode == 0, installed.stderr
    assert not stale.exists()  # (the build backend removes it, its own and an older build's)
    dropin = tmp_path / "dropin"
    written = _run([str(python.parent / "offload-shim"), "dropin", str(dropin)], cwd=elsewhere)
    assert written.returncode == 0 and (dropin / "sitecustomize.py").is_file(), written
    folders = [clone, clone / "tests", elsewhere]
    # Installed, it switches on (else this test would tell nothing).
    (on,) = _probes(python, [elsewhere], {"OFFLOAD_SHIM": "1"}).values()
    assert on.endswith(" FunctionWrapper") and "'offload_shim'" in on, on

    # README.md: pip uninstall offload_shim; delete any drop-in, its PYTHONPATH entry.
    removed = _run([*pip, "uninstall", "-y", "offload_shim"], cwd=clone)
    assert removed.returncode == 0, removed.stderr
    for entry in dropin.iterdir():
        if entry.is_dir():
            for inner in entry.iterdir():
                inner.unlink()
            entry.rmdir()
        else:
            entry.unlink()
    dropin.rmdir()

    off = _probes(python, folders, {"OFFLOAD_SHIM": "1"})
    assert off == {str(folder): NOTHING for folder in folders}, off
    left = [p.name for p in python.parent.parent.rglob("*") if "offload" in p.name and "shim" in p.name]
    assert left == [], left
    fresh = {p.name for p in copy_source(tmp_path / "fresh").iterdir()} | {"tests", "__pycache__"}
    assert {p.name for p in clone.iterdir()} <= fresh, sorted({p.name for p in clone.iterdir()} - fresh)
