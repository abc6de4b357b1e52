"""The command line."""

import subprocess
import sys


def cli(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "offload_shim", *args], capture_output=True, text=True, timeout=120, **kwargs)


def test_info_reports_entry_point_and_settings():
    out = cli("info")
    assert out.returncode == 0, out.stderr
    assert "torch.backends entry point     ['offload_shim_autoload:autoload']" in out.stdout
    assert "settings                       Settings(staging_device=None, always_stage=False, chunk_bytes=16777216, route_min_bytes=1048576)" in out.stdout


def test_run_sets_offload_shim_and_activates_at_import_torch():
    out = cli("run", sys.executable, "-c", "import os, torch, wrapt; print(os.environ['OFFLOAD_SHIM'], isinstance(torch.distributed.all_reduce, wrapt.FunctionWrapper))")
    assert out.returncode == 0 and out.stdout.strip() == "1 True", out


def test_run_errors():
    assert cli("run").returncode == 2
    missing = cli("run", "no-such-command-offload-shim")
    assert missing.returncode == 127 and "cannot run 'no-such-command-offload-shim'" in missing.stderr
    assert cli().returncode == 2
