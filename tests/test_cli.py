"""The command line: ``offload-shim`` (``offload_shim_cli.main``) and ``python -m offload_shim``."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from interpreters import SHIM_VARIABLES

BOOT = "import sys, offload_shim_cli; sys.exit(offload_shim_cli.main(sys.argv[1:]))"


def cli(*args, env=None):
    environ = {k: v for k, v in os.environ.items() if k not in SHIM_VARIABLES}
    environ.update(env or {})
    return subprocess.run([sys.executable, "-c", BOOT, *args], capture_output=True, text=True, timeout=120, env=environ)


def test_info_reports_entry_point_and_settings():
    out = cli("info")
    assert out.returncode == 0, out.stderr
    assert "torch.backends entry point     ['offload_shim_autoload:autoload']" in out.stdout
    assert "settings                       Settings(staging_device=None, always_stage=False, chunk_bytes=16777216, route_min_bytes=1048576, summary_at_exit=False, host_staging=True, graphs=True, register_bytes=0)" in out.stdout


def test_python_dash_m_is_the_same_command():
    out = subprocess.run([sys.executable, "-m", "offload_shim", "info"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "torch.backends entry point" in out.stdout


PROBE = "import os, sys, torch, wrapt; print(os.environ['OFFLOAD_SHIM'], isinstance(torch.distributed.all_reduce, wrapt.FunctionWrapper))"


def test_run_sets_offload_shim_and_activates_at_import_torch():
    out = cli("run", sys.executable, "-c", PROBE)  # (`run -- CMD`: test_run_errors)
    assert out.returncode == 0 and out.stdout.strip() == "1 True", out


def test_run_needs_no_valid_environment_of_its_own():
    """run replaces OFFLOAD_SHIM and imports neither torch nor offload_shim in the launcher."""
    out = cli("run", sys.executable, "-c", "import os; print(os.environ['OFFLOAD_SHIM'])", env={"OFFLOAD_SHIM": "garbage"})
    assert out.returncode == 0 and out.stdout.strip() == "1", out


def dash_m(*args, env=None):
    environ = {k: v for k, v in os.environ.items() if k not in SHIM_VARIABLES}
    environ.update(env or {})
    return subprocess.run([sys.executable, "-m", "offload_shim", *args], capture_output=True, text=True, timeout=120, env=environ)


@pytest.mark.parametrize(
    "command, variable, value, message, default",
    # -m with a malformed OFFLOAD_SHIM: the package is half imported when torch's entry point asks for it
    [(cli, "OFFLOAD_SHIM_CHUNK_BYTES", "abc", "is not a size", "16MiB (16777216 bytes)"),
     (dash_m, "OFFLOAD_SHIM", "maybe", "is not a boolean", "unset (import torch switches nothing on; import "
      "offload_shim installs)")],
    ids=["offload-shim", "python -m offload_shim"],
)
def test_info_and_doctor_report_a_malformed_setting_and_its_default(command, variable, value, message, default):
    """Both spellings: info shows the settings in force (that variable's default) and one row naming the variable,
    the value and the default, exit status 0; doctor shows the value as malformed and makes it a problem, exit status
    1; neither a traceback nor a warning (the command reports it once, its own way)."""
    env = {variable: value, **({} if variable == "OFFLOAD_SHIM" else {"OFFLOAD_SHIM": "0"})}
    sentence = f"{variable}={value!r} {message}"
    out = command("info", env=env)
    rows = [line for line in out.stdout.splitlines() if line.startswith("malformed ")]
    assert out.returncode == 0 and len(rows) == 1, out
    assert rows[0].split(None, 1)[1].startswith(sentence), rows
    assert rows[0].endswith(f"; {variable} takes its default instead: {default}"), rows
    assert "chunk_bytes=16777216" in out.stdout
    assert "Traceback" not in out.stderr and "RuntimeWarning" not in out.stderr, out.stderr
    out = command("doctor", env=env)
    assert out.returncode == 1 and f"{variable:32s} {value!r} (malformed, so its default: {default})\n" in out.stdout
    assert f"PROBLEM: {sentence}" in out.stdout, out.stdout
    assert "Traceback" not in out.stderr and "RuntimeWarning" not in out.stderr, out.stderr


def test_run_errors():
    assert cli("run").returncode == 2
    dashes = cli("run", "--")  # `--` is taken off, not run as a program
    assert dashes.returncode == 2 and dashes.stderr.startswith("offload-shim run: give a command"), dashes
    empty = cli("run", "--", "")  # an empty program name, as a missing one
    assert empty.returncode == 2 and empty.stderr.startswith("offload-shim run: give a command"), empty
    missing = cli("run", "no-such-command-offload-shim")
    assert missing.returncode == 127 and "cannot run 'no-such-command-offload-shim'" in missing.stderr
    assert cli().returncode == 2


def test_help_version_and_run_help_import_no_torch(tmp_path):
    """``--version``, ``--help`` and ``run --help`` print and exit 0 with a ``torch`` that cannot be imported ahead
    on the path; ``run --help`` is help, not a program named ``--help``; a usage error exits 2."""
    import importlib.metadata

    (tmp_path / "torch.py").write_text("raise ImportError('the command imported torch')\n")
    env = {"PYTHONPATH": str(tmp_path)}
    expected = {
        ("--version",): f"offload-shim {importlib.metadata.version('offload_shim')}",
        ("--help",): "usage: offload-shim [-h] [--version] {info,doctor,dropin,run}",
        ("run", "--help"): "usage: offload-shim run [--] CMD [ARG...]",
        ("run", "-h"): "usage: offload-shim run [--] CMD [ARG...]",
    }
    for args, text in expected.items():
        out = cli(*args, env=env)
        assert out.returncode == 0 and text in out.stdout and "ImportError" not in out.stderr, (args, out)
    wrong = cli("bogus", env=env)
    assert wrong.returncode == 2 and "invalid choice: 'bogus'" in wrong.stderr and "ImportError" not in wrong.stderr


def test_dropin_writes_the_template_and_its_bytecode_without_importing_torch(tmp_path):
    """``dropin DIR`` writes the installed template as DIR/sitecustomize.py, compiled (no compile at each start-up
    where DIR is read-only); it leaves a different sitecustomize.py alone unless --force. No torch import."""
    (tmp_path / "torch.py").write_text("raise ImportError('the command imported torch')\n")
    env = {"PYTHONPATH": str(tmp_path)}
    target = tmp_path / "site" / "sitecustomize.py"
    template = (pathlib.Path(__file__).parents[1] / "sitecustomize_template.py").read_text()
    out = cli("dropin", str(target.parent), env=env)
    assert out.returncode == 0 and target.read_text() == template, out
    assert f"export PYTHONPATH={target.parent}" in out.stdout
    assert [p.name for p in (target.parent / "__pycache__").iterdir()] == [f"sitecustomize.{sys.implementation.cache_tag}.pyc"]
    assert cli("dropin", str(target.parent), env=env).returncode == 0  # the same file again: fine
    target.write_text("# the cluster's own\n")
    refused = cli("dropin", str(target.parent), env=env)
    assert refused.returncode == 1 and "exists and differs" in refused.stderr and target.read_text() == "# the cluster's own\n"
    assert cli("dropin", "--force", str(target.parent), env=env).returncode == 0 and target.read_text() == template


def test_dropin_says_in_one_line_what_it_cannot_write_and_quotes_the_path(tmp_path):
    """A DIR that cannot be written (here a file) is one line and exit status 1, no traceback; the line that puts
    DIR on PYTHONPATH is quoted for a shell, so a path with a space works as printed."""
    (tmp_path / "a file").write_text("")
    refused = cli("dropin", str(tmp_path / "a file"))
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused
    assert refused.stderr.startswith(f"offload-shim dropin: cannot write {tmp_path / 'a file' / 'sitecustomize.py'}: ")
    out = cli("dropin", str(tmp_path / "my dir"))
    export = out.stdout.splitlines()[-1].removeprefix("switch it on with: ")
    shell = subprocess.run(["bash", "-c", f"unset PYTHONPATH; {export}; printf %s \"$PYTHONPATH\""],
                           capture_output=True, text=True)
    assert out.returncode == 0 and shell.stdout == str((tmp_path / "my dir").resolve()), (export, shell)


def test_run_warns_when_torch_runs_no_entry_points():
    out = cli("run", sys.executable, "-c", "print('ran')", env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert out.returncode == 0 and out.stdout.strip() == "ran"
    assert out.stderr.startswith("offload-shim run: warning: TORCH_DEVICE_BACKEND_AUTOLOAD is not 1, so torch runs no "
                                 "torch.backends entry point"), out.stderr


def test_info_and_doctor_say_which_process_they_describe():
    """Both answer for their own process, which imported offload_shim to answer, and say so in their first row,
    with how to see the same of a job's ranks: each rank's first log line, rank 0's table at exit, doctor under
    torchrun."""
    import offload_shim

    for command, width in (("info", 30), ("doctor", 32)):
        out = cli(command)
        first = out.stdout.splitlines()[0]
        assert re.fullmatch(rf"this process {' ' * (width - 13)} pid \d+, offload-shim {command}'s own \(RANK unset: no "
                            r"rank of a job\); these rows describe it, not your job's ranks", first), first
        (job,) = [line for line in out.stdout.splitlines() if line.startswith("your job's ranks ")]
        for said in ("with OFFLOAD_SHIM_LOG=info, a rank where the shim is on writes first '[rank R pid P] "
                     "offload_shim VERSION: installed (torch ..., settings Settings(...))'",
                     "with OFFLOAD_SHIM_SUMMARY=1, rank 0 prints at exit 'offload_shim: staged calls on rank 0 (pid P):'",
                     "'offload_shim: no call was staged on rank 0 (pid P)'",
                     "torchrun ... -m offload_shim doctor checks each rank's group"):
            assert said in job, (said, job)
    # The lines quoted are the package's own: the one logged at install, and the summary's.
    package = "\n".join(path.read_text() for path in pathlib.Path(offload_shim.__file__).parent.glob("*.py"))
    for literal in ('"offload_shim %s: installed (torch %s, settings %s)"', "staged calls on", "no call was staged on"):
        assert literal in package, literal
    rank = cli("info", env={"RANK": "3"}).stdout.splitlines()[0]
    assert "offload-shim info's own (rank 3 of the job torchrun started for it)" in rank, rank


def test_doctor_says_who_installed_the_shim():
    """doctor imports offload_shim, which installs the wrappers in its own process: it says so, and says separately
    what import torch does in a program here."""
    unset = cli("doctor")
    assert re.search(r"^installed in this process        yes, by this command, which imports offload_shim \(pid \d+\)$",
                     unset.stdout, re.M), unset.stdout
    assert "import torch in a program here   does nothing: OFFLOAD_SHIM is unset" in unset.stdout
    asked = cli("doctor", env={"OFFLOAD_SHIM": "1"})
    assert ("import torch in a program here   switches the shim on (OFFLOAD_SHIM, through the torch.backends entry "
            "point)\n") in asked.stdout
    off = cli("doctor", env={"OFFLOAD_SHIM": "0"})
    assert "installed in this process        no: OFFLOAD_SHIM is false\n" in off.stdout
    assert "import torch in a program here   does nothing: OFFLOAD_SHIM is false\n" in off.stdout


def test_doctor_gives_the_registration_budget():
    """Registration is off unless OFFLOAD_SHIM_REGISTER_BYTES sets a budget: doctor gives 0 (default), or the size
    given."""
    out = cli("doctor")
    assert "  register_bytes                 0 (default)\n" in out.stdout, out.stdout
    out = cli("doctor", env={"OFFLOAD_SHIM_REGISTER_BYTES": "4GiB"})
    assert "  register_bytes                 4294967296 (set)\n" in out.stdout, out.stdout
    out = cli("doctor", env={"OFFLOAD_SHIM_REGISTER_BYTES": ""})  # empty: as unset, and said so
    assert "OFFLOAD_SHIM_REGISTER_BYTES      '' (empty: as unset)\n" in out.stdout, out.stdout
    assert "  register_bytes                 0 (default)\n" in out.stdout, out.stdout


def test_doctor_names_a_backend_it_cannot_make_a_group_with(monkeypatch):
    """``doctor --backend`` with a backend torch does not know: a problem line for the rank, no traceback, and no
    group left behind."""
    import warnings

    import torch.distributed as dist

    import offload_shim_cli

    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533")):
        monkeypatch.setenv(name, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's: "Device capability of bogus unknown"
        (problem,) = offload_shim_cli._check_ranks("bogus")
    # (torch's own words after the colon: "AssertionError: Unknown backend type bogus" in torch 2.13)
    assert problem.startswith("rank 0: cannot make the default process group with backend 'bogus': "), problem
    assert not dist.is_initialized()
