"""The build backend: setuptools' own (every PEP 517 hook), with one addition to editable wheels.

An editable install of setuptools puts the source tree on ``sys.path`` (a ``.pth`` line) and its metadata in the
environment. If the tree is deleted, the metadata's ``torch.backends`` entry point would name a module that no
longer exists, and torch raises at every ``import torch`` of the environment. So the editable wheel also carries
the entry point's module itself (``offload_shim_autoload.py``, which never changes and imports nothing at load):
it stays in the environment with the metadata, and does nothing where the rest of offload_shim is gone.

And no hook leaves ``offload_shim.egg-info`` in the source tree. setuptools writes it there (pip's
``get_requires_for_build_*`` hooks run ``egg_info`` in the tree), and it holds the ``torch.backends`` entry point:
after ``pip uninstall``, a program run from the clone's root (the current directory first on ``sys.path``) still
found the entry point there, and torch switched the shim on from the clone's files under ``OFFLOAD_SHIM=1``. The
metadata pip installs is built apart from it (in pip's own folder, or in the wheel), so each hook removes it.
"""

import base64
import functools
import hashlib
import os
import pathlib
import shutil
import zipfile

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403 - every hook as setuptools provides it

ENTRY_POINT_MODULE = "offload_shim_autoload.py"
ROOT = pathlib.Path(__file__).resolve().parents[1]
EGG_INFO = "offload_shim.egg-info"


def _leaving_no_egg_info(hook):
    """``hook``, then ``offload_shim.egg-info`` removed from the source tree (whether it wrote it or an older
    build did)."""

    @functools.wraps(hook)
    def run(*args, **kwargs):
        try:
            return hook(*args, **kwargs)
        finally:
            shutil.rmtree(ROOT / EGG_INFO, ignore_errors=True)

    return run


for _name in _setuptools.__all__:
    if _name.startswith(("build_", "get_requires_for_build_", "prepare_metadata_for_build_")):
        globals()[_name] = _leaving_no_egg_info(getattr(_setuptools, _name))


@_leaving_no_egg_info
def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    source = ROOT / ENTRY_POINT_MODULE
    _add_to_wheel(os.path.join(wheel_directory, name), ENTRY_POINT_MODULE, source.read_bytes())
    return name


def _add_to_wheel(wheel: str, arcname: str, data: bytes) -> None:
    """Add ``arcname`` to ``wheel`` and to its RECORD (a wheel lists every file with its hash and size)."""
    with zipfile.ZipFile(wheel) as old:
        entries = [(info, old.read(info)) for info in old.infolist()]
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    line = f"{arcname},sha256={digest},{len(data)}\n".encode()
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as new:
        new.writestr(arcname, data)
        for info, content in entries:
            if info.filename.endswith(".dist-info/RECORD"):
                content = line + content
            new.writestr(info, content)
