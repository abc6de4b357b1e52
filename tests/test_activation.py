"""Activation paths, each in fresh interpreters: ``import offload_shim``, ``OFFLOAD_SHIM=1`` through torch's
``torch.backends`` entry point (also under torchrun), and the sitecustomize drop-in."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from interpreters import REPORT, SHIM_VARIABLES, python

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALL_WRAPPED = "c10d=True funcol=True dtensor=True"
NONE_WRAPPED = "c10d=False funcol=False dtensor=False"
IMPORT_TORCH = "import torch, torch.distributed.tensor"


def last_line(result) -> str:
    return result.stdout.strip().splitlines()[-1]


def test_entry_point_is_registered():
    values = [e.value for e in importlib.metadata.entry_points(group="torch.backends") if e.name == "offload_shim"]
    assert values == ["offload_shim_boot:autoload"], "install the package (pip install -e .) to register it"


# Each spelling of a value: one through the whole path (a fresh interpreter's `import torch`), the others through
# the function that path ends in (offload_shim._startup.activate_on_import for a set value, offload_shim_boot.autoload
# for an empty one) in the same interpreter, as a fresh one would run it (activation runs once per process); a
# fresh interpreter per spelling cost CI half a minute.
SPELLINGS = """
import os, sys, offload_shim_boot
def each(values, activate):
    for value in values:
        os.environ["OFFLOAD_SHIM"] = value
        if "offload_shim._startup" in sys.modules:
            sys.modules["offload_shim._startup"]._activated = False
        activate()
        yield value
"""


def test_true_value_activates_at_import_torch():
    out = python(
        IMPORT_TORCH, REPORT, SPELLINGS,
        """
        import offload_shim
        from offload_shim import _startup
        offload_shim.uninstall()
        for value in each(["true", "YES", " on "], _startup.activate_on_import):
            assert offload_shim.is_installed(), value
            offload_shim.uninstall()
        """,
        env={"OFFLOAD_SHIM": "1"},
    )
    assert last_line(out) == ALL_WRAPPED


def test_unset_does_nothing_at_all():
    out = python(
        IMPORT_TORCH, REPORT, "print('offload_shim' in sys.modules)", SPELLINGS,
        """
        for value in each(["", "  "], offload_shim_boot.autoload):
            assert "offload_shim" not in sys.modules, repr(value)
        """,
    )
    assert out.stdout.strip().splitlines()[-2:] == [NONE_WRAPPED, "False"]


def test_false_value_installs_nothing():
    out = python(
        IMPORT_TORCH, REPORT, "import offload_shim; print(offload_shim.is_installed())", SPELLINGS,
        """
        from offload_shim import _startup
        for value in each(["false", "No", "OFF"], _startup.activate_on_import):
            assert not offload_shim.is_installed(), value
        """,
        env={"OFFLOAD_SHIM": "0"},
    )
    assert out.stdout.strip().splitlines()[-2:] == [NONE_WRAPPED, "False"]


def test_malformed_value_warns_and_never_breaks_import_torch():
    out = python(IMPORT_TORCH, REPORT, env={"OFFLOAD_SHIM": "maybe"})
    assert last_line(out) == NONE_WRAPPED
    assert "offload_shim is not enabled: OFFLOAD_SHIM='maybe' is not a boolean" in out.stderr


def test_malformed_value_rejected_by_import_offload_shim():
    out = python(
        """
        try:
            import offload_shim
        except Exception as exc:
            print(type(exc).__name__, exc)
        """,
        env={"OFFLOAD_SHIM": "2"},
    )
    assert last_line(out).startswith("ConfigError OFFLOAD_SHIM='2' is not a boolean: use one of")


def test_malformed_staging_device_rejected():
    out = python(
        "try:\n    import offload_shim\nexcept Exception as exc:\n    print(type(exc).__name__, exc)",
        env={"OFFLOAD_SHIM_STAGING_DEVICE": "gpu:zero"},
    )
    assert last_line(out).startswith("ConfigError OFFLOAD_SHIM_STAGING_DEVICE='gpu:zero' is not a device")


def test_switched_off_a_malformed_other_setting_only_warns():
    out = python("import offload_shim; print(offload_shim.is_installed())",
                 env={"OFFLOAD_SHIM": "0", "OFFLOAD_SHIM_CHUNK_BYTES": "lots"})
    assert last_line(out) == "False" and "OFFLOAD_SHIM_CHUNK_BYTES='lots' is not a size" in out.stderr


def test_import_offload_shim_installs():
    out = python("import offload_shim, torch.distributed.tensor", REPORT)
    assert last_line(out) == ALL_WRAPPED
    assert "[rank" not in out.stderr and "offload_shim" not in out.stderr, out.stderr  # quiet without OFFLOAD_SHIM_LOG


def test_torch_autoload_switch_off_is_respected():
    out = python(IMPORT_TORCH, REPORT, env={"OFFLOAD_SHIM": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert last_line(out) == NONE_WRAPPED


# A training script that never mentions offload_shim; its group serves CUDA only, on a machine without CUDA.
TRAIN = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("cuda:gloo")
tensor = torch.ones(4)
try:
    dist.all_reduce(tensor)
    line = f"rank {dist.get_rank()} result {tensor.tolist()}"
except RuntimeError as exc:
    line = f"rank {dist.get_rank()} {type(exc).__name__} {exc} | tensor {tensor.tolist()}"
os.write(1, (line + "\\n").encode())  # one write: the ranks share one pipe
gloo = dist.new_group(backend="gloo")  # serves CPU: staged only where OFFLOAD_SHIM_ALWAYS_STAGE forces it
for _ in range(2):
    dist.all_reduce(torch.ones(2), group=gloo)
# Wait for every rank before tearing down: a rank that destroys the group while another is still connecting makes
# that one's init fail ("Connection closed by peer"), and the group has no collective that works here.
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
store.add("finished", 1)
while store.add("finished", 0) < dist.get_world_size():
    time.sleep(0.01)
dist.destroy_process_group()
"""


def torchrun(tmp_path, env):
    """The ranks' lines of stdout, sorted, and stderr."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    environ = {k: v for k, v in os.environ.items() if k not in SHIM_VARIABLES}
    environ.update(env)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    result = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=240)
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert result.returncode == 0 and len(lines) == 2, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return lines, result.stderr


@pytest.mark.skipif(__import__("torch").accelerator.is_available(), reason="needs a machine without an accelerator")
def test_torchrun_with_offload_shim_1(tmp_path):
    """Also, with OFFLOAD_SHIM_LOG=info and OFFLOAD_SHIM_SUMMARY=1 (and the staging forced on the script's Gloo
    group): each rank logs the first staged call from the script's line once, and at exit rank 0 alone prints the
    table (not rank 1, nor torchrun's own process, which imports the shim too); without the shim, nothing."""
    lines, stderr = torchrun(tmp_path, {
        "OFFLOAD_SHIM": "1", "OFFLOAD_SHIM_LOG": "info", "OFFLOAD_SHIM_SUMMARY": "1",
        "OFFLOAD_SHIM_STAGING_DEVICE": "cpu", "OFFLOAD_SHIM_ALWAYS_STAGE": "1",
    })
    for rank, line in enumerate(lines):
        assert line.startswith(f"rank {rank} StagingError offload_shim: torch.distributed.all_reduce got a tensor on cpu")
        assert line.endswith("| tensor [1.0, 1.0, 1.0, 1.0]")
    site = f"{tmp_path / 'train.py'}:{TRAIN.splitlines().index('    dist.all_reduce(torch.ones(2), group=gloo)') + 1}"
    logged = sorted(re.sub(r"pid \d+", "pid P", line) for line in stderr.splitlines() if "first staged call" in line)
    assert logged == [
        f"[rank {rank} pid P] offload_shim: first staged call at {site}: torch.distributed.all_reduce, 8 B, route "
        f"forced (always_stage; group '1' with backend gloo serves cpu, cuda), mode small, through cpu"
        for rank in range(2)
    ]
    errors = stderr.splitlines()
    summaries = ("offload_shim: staged calls on ", "offload_shim: no call was staged on ")
    tables = [i for i, line in enumerate(errors) if line.startswith(summaries)]
    assert len(tables) == 1 and re.fullmatch(r"offload_shim: staged calls on rank 0 \(pid \d+\):", errors[tables[0]])
    header, row, total = errors[tables[0] + 1 : tables[0] + 4]
    assert header == "op                            route   mode   calls  bytes   seconds"
    assert re.fullmatch(r"torch\.distributed\.all_reduce  forced  small      2   16 B  0\.\d{6}", row), row
    assert re.fullmatch(r"total                                            2   16 B  0\.\d{6}", total), total
    without, stderr = torchrun(tmp_path, {"OFFLOAD_SHIM_LOG": "info", "OFFLOAD_SHIM_SUMMARY": "1"})
    assert without == [f"rank {r} RuntimeError No backend type associated with device type cpu | tensor [1.0, 1.0, 1.0, 1.0]" for r in range(2)]
    assert "offload_shim" not in stderr


@pytest.fixture
def site(tmp_path):
    """A site directory holding the template as sitecustomize.py, and a second one with the sitecustomize it
    shadows."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    shutil.copy(ROOT / "sitecustomize_template.py", ours / "sitecustomize.py")
    (theirs / "sitecustomize.py").write_text("import builtins\nbuiltins.SHADOWED_SITECUSTOMIZE_RAN = True\n")
    return [str(ours), str(theirs)]


def site_python(site, *code, env=None):
    return python(*code, env={"PYTHONPATH": os.pathsep.join(site), **(env or {})})


def test_sitecustomize_activates_on_torch_import(site):
    out = site_python(
        site,
        "import sys, builtins",
        "print(builtins.SHADOWED_SITECUSTOMIZE_RAN, 'torch' in sys.modules, 'offload_shim' in sys.modules)",
        IMPORT_TORCH,
        REPORT,
    )
    assert out.stdout.strip().splitlines()[-2:] == ["True False False", ALL_WRAPPED]


def test_sitecustomize_with_its_directory_twice_on_the_path(site, tmp_path):
    """The same directory under another spelling (a link): the shadowed one still runs, once, no recursion."""
    link = tmp_path / "ours-link"
    link.symlink_to(site[0])
    out = site_python([site[0], str(link), site[1]], "import builtins; print(builtins.SHADOWED_SITECUSTOMIZE_RAN)")
    assert last_line(out) == "True" and out.stderr == ""


def test_sitecustomize_respects_false(site):
    out = site_python(site, IMPORT_TORCH, REPORT, env={"OFFLOAD_SHIM": "off"})
    assert last_line(out) == NONE_WRAPPED


def test_sitecustomize_malformed_value_warns(site):
    out = site_python(site, IMPORT_TORCH, REPORT, env={"OFFLOAD_SHIM": "sometimes"})
    assert last_line(out) == NONE_WRAPPED
    assert "offload_shim is not enabled: OFFLOAD_SHIM='sometimes' is not a boolean" in out.stderr


@pytest.mark.parametrize("missing", ["offload_shim", "wrapt"])
def test_sitecustomize_never_breaks_start_up(site, tmp_path, missing):
    stubs = tmp_path / "stubs"
    (stubs / missing).mkdir(parents=True)
    (stubs / missing / "__init__.py").write_text(f"raise ImportError('{missing} is not installed (test stub)')\n")
    out = site_python([site[0], str(stubs), site[1]], "print('started')", env={"OFFLOAD_SHIM": "1"})
    assert last_line(out) == "started" and out.stderr == ""
    if missing == "offload_shim":  # torch itself still imports; the entry point warns, the hook stays quiet
        out = site_python([site[0], str(stubs), site[1]], "import torch; print('torch imported')")
        assert last_line(out) == "torch imported"


def test_log_variable_prints_install_and_staging_decisions():
    """OFFLOAD_SHIM_LOG=debug: the install line and each staging decision on standard error, with the rank (without
    it, nothing: test_import_offload_shim_installs)."""
    code = (
        "import os, torch, torch.distributed as dist",
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(__import__('socket').create_server(('127.0.0.1', 0)).getsockname()[1]))",
        "dist.init_process_group('gloo', rank=0, world_size=1)",
        "import offload_shim",
        "offload_shim.configure(staging_device='cpu', always_stage=True)",
        "dist.all_reduce(torch.ones(3))",
        "dist.destroy_process_group()",
    )
    logged = python(*code, env={"OFFLOAD_SHIM": "1", "OFFLOAD_SHIM_LOG": "debug", "RANK": "0"})
    lines = [line for line in logged.stderr.splitlines() if line.startswith("[rank 0 pid ")]
    assert any("offload_shim 0.1.0: installed (torch" in line for line in lines), logged.stderr
    assert any("staging torch.distributed.all_reduce of a cpu tensor (3,) torch.float32 through cpu" in line
               for line in lines), logged.stderr


def test_log_variable_values():
    from offload_shim import ConfigError, _config

    assert [_config.log_level_from_environment({"OFFLOAD_SHIM_LOG": v}) for v in ("", " INFO ", "debug")] == [None, 20, 10]
    with pytest.raises(ConfigError, match=r"OFFLOAD_SHIM_LOG='verbose' is not a log level: use one of \['debug', 'info'\]"):
        _config.log_level_from_environment({"OFFLOAD_SHIM_LOG": "verbose"})
