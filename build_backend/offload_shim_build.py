"""The build backend: setuptools' own (every PEP 517 hook), with one addition to editable wheels.

An editable install of setuptools puts the source tree on ``sys.path`` (a ``.pth`` line) and its metadata in the
environment. If the tree is deleted, the metadata's ``torch.backends`` entry point would name a module that no
longer exists, and torch raises at every ``import torch`` of the environment. So the editable wheel also carries
the entry point's module itself (``offload_shim_autoload.py``, which never changes and imports nothing at load):
it stays in the environment with the metadata, and does nothing where the rest of offload_shim is gone.
"""

import base64
import hashlib
import os
import pathlib
import zipfile

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403 - every hook as setuptools provides it

ENTRY_POINT_MODULE = "offload_shim_autoload.py"


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    source = pathlib.Path(__file__).resolve().parents[1] / ENTRY_POINT_MODULE
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
