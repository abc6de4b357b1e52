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

from conftest import copy_source
from interpreters import REPORT, SHIM_VARIABLES, environment, python

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALL_WRAPPED = "c10d=True funcol=True kernels=True"
NONE_WRAPPED = "c10d=False funcol=False kernels=False"
IMPORT_TORCH = "import torch, torch.distributed.tensor"


def torch_has_accelerator() -> bool:
    import torch

    return torch.accelerator.is_available()


def last_line(result) -> str:
    return result.stdout.strip().splitlines()[-1]


def test_entry_point_is_registered():
    values = [e.value for e in importlib.metadata.entry_points(group="torch.backends") if e.name == "offload_shim"]
    assert values == ["offload_shim_autoload:autoload"], "install the package (pip install -e .) to register it"


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
        for value in each(["true", "YES", " on "], lambda: _startup.activate_on_import(offload_shim.install, offload_shim.is_installed)):
            assert offload_shim.is_installed(), value
            offload_shim.uninstall()
        """,
        env={"OFFLOAD_SHIM": "1", "OFFLOAD_SHIM_ALWAYS_STAGE": "1", "OFFLOAD_SHIM_STAGING_DEVCE": "cpu"},
    )
    assert last_line(out) == ALL_WRAPPED
    # A misspelt name is not ignored without a word.
    assert "offload_shim: OFFLOAD_SHIM_STAGING_DEVCE is not a variable of offload_shim and is ignored (did you mean " \
           "OFFLOAD_SHIM_STAGING_DEVICE?)" in out.stderr, out.stderr
    # A setting that cannot act says so: with no accelerator, always-stage has nothing to stage through.
    inert = "offload_shim: OFFLOAD_SHIM_ALWAYS_STAGE (always_stage) has no effect on collectives here: there is no device"
    assert (inert in out.stderr) != torch_has_accelerator(), out.stderr


def test_unset_does_nothing_at_all():
    out = python(
        IMPORT_TORCH, REPORT, "print('offload_shim' in sys.modules)", SPELLINGS,
        """
        for value in each(["", "  "], offload_shim_boot.autoload):
            assert "offload_shim" not in sys.modules, repr(value)
        """,
    )
    assert out.stdout.strip().splitlines()[-2:] == [NONE_WRAPPED, "False"]


def test_empty_value_is_unset():
    """``OFFLOAD_SHIM=`` (set, empty) is unset, as usual for switches: ``import torch`` installs nothing, and
    ``import offload_shim`` installs, as it does with the variable unset."""
    for env in ({"OFFLOAD_SHIM": ""}, {"OFFLOAD_SHIM": " "}, {}):
        out = python(IMPORT_TORCH, REPORT, "import offload_shim; print(offload_shim.is_installed())", env=env)
        assert out.stdout.strip().splitlines()[-2:] == [NONE_WRAPPED, "True"], (env, out.stdout, out.stderr)


@pytest.mark.parametrize("name", ["OFFLOAD_SHIMM", "OFLOAD_SHIM", "offload_shim", "OFFLOAD_SHIM_LOGG"])
def test_misspelt_switch_is_named_at_import_torch(tmp_path, name):
    """With ``OFFLOAD_SHIM`` unset, a variable that looks like one of the shim's is named once, with the nearest
    name, at the program's line that imported torch, and the shim stays off; a variable that only shares a word
    (``ACCELERATE_FSDP_OFFLOAD_PARAMS``, ``SHIMMER``) is not named."""
    script = tmp_path / "train.py"
    out = python("import sys", "import torch", "print('offload_shim' in sys.modules)", script=str(script),
                 env={name: "1", "ACCELERATE_FSDP_OFFLOAD_PARAMS": "1", "SHIMMER": "1", "PYTHONWARNINGS": "default"})
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout  # the package not even imported
    near = "OFFLOAD_SHIM_LOG" if name.endswith("LOGG") else "OFFLOAD_SHIM"
    expected = (f"{script}:2: RuntimeWarning: offload_shim: {name} is not a variable of offload_shim and is ignored "
                f"(did you mean {near}?); offload_shim is off (OFFLOAD_SHIM is unset)")
    assert out.stderr.count("RuntimeWarning") == 1 and expected in out.stderr, out.stderr


def test_variables_named_without_importing_the_package():
    """The start-up module's list of variables (what the entry point checks names against) is the package's: each
    is read by the package (its constant used beyond its definition), and named in the README's settings table."""
    import pathlib

    import offload_shim_names
    from offload_shim import _config

    root = pathlib.Path(_config.__file__).parent
    source = "\n".join(p.read_text() for p in root.glob("*.py"))
    readme = (root.parent / "README.md").read_text()
    constants = {value: name for name, value in vars(_config).items() if name.startswith("ENV_")}
    assert set(constants) == set(offload_shim_names.VARIABLES)
    unread = [v for v, name in constants.items() if source.count(f"ENV_{name[4:]}") < 2 and source.count(name) < 3]
    undocumented = [v for v in offload_shim_names.VARIABLES if f"`{v}`" not in readme]
    assert not unread and not undocumented, (unread, undocumented)


def test_false_value_installs_nothing(site):
    """Neither the entry point nor the drop-in (on PYTHONPATH here) installs anything at import torch, nor does
    ``import offload_shim``; the other false spellings through the function activation ends in."""
    out = site_python(
        site, IMPORT_TORCH, REPORT, "import offload_shim; print(offload_shim.is_installed())", SPELLINGS,
        """
        from offload_shim import _startup
        for value in each(["false", "No", "0"], lambda: _startup.activate_on_import(offload_shim.install, offload_shim.is_installed)):
            assert not offload_shim.is_installed(), value
        """,
        env={"OFFLOAD_SHIM": "off"},
    )
    assert out.stdout.strip().splitlines()[-2:] == [NONE_WRAPPED, "False"]


def test_malformed_value_warns_and_never_breaks_import_torch():
    """A malformed switch is read as its default, unset: import torch switches nothing on (not even importing the
    package), and says so once, with the values it takes."""
    out = python(IMPORT_TORCH, REPORT, "print('offload_shim' in sys.modules)", env={"OFFLOAD_SHIM": "maybe"})
    assert out.stdout.strip().splitlines()[-2:] == [NONE_WRAPPED, "False"]
    assert out.stderr.count("RuntimeWarning") == 1, out.stderr
    assert ("offload_shim is not enabled: OFFLOAD_SHIM='maybe' is not a boolean: use one of ['1', 'on', 'true', "
            "'yes'] to enable or ['0', 'false', 'no', 'off'] to disable (case-insensitive); OFFLOAD_SHIM takes its "
            "default instead: unset (import torch switches nothing on; import offload_shim installs)") in out.stderr


def test_malformed_values_warn_at_import_offload_shim_and_keep_their_defaults():
    """A malformed variable never raises from ``import offload_shim``: it takes its default (the switch's: unset,
    so the package installs), with a warning naming it; with OFFLOAD_SHIM false, nothing installs, and a malformed
    other variable warns alike. Each in turn in one interpreter, activation reset between them, as a fresh
    interpreter would run it."""
    out = python(
        SPELLINGS,
        """
        import warnings
        cases = [{"OFFLOAD_SHIM": "2"}, {"OFFLOAD_SHIM_STAGING_DEVICE": "gpu:zero"},
                 {"OFFLOAD_SHIM": "0", "OFFLOAD_SHIM_CHUNK_BYTES": "lots"}]
        for variables in cases:
            os.environ.update(variables)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                again = "offload_shim" in sys.modules
                import offload_shim
                if again:
                    offload_shim.uninstall()
                    sys.modules["offload_shim._startup"]._activated = False
                    sys.modules["offload_shim._startup"].activate_on_import(offload_shim.install, offload_shim.is_installed)
            print("installed", offload_shim.is_installed(), "|", *(str(w.message) for w in caught))
            for name in variables:
                del os.environ[name]
        """,
    )
    switch, device, switched_off = out.stdout.strip().splitlines()[-3:]
    assert switch.startswith("installed True | offload_shim: OFFLOAD_SHIM='2' is not a boolean: use one of"), switch
    assert switch.endswith("OFFLOAD_SHIM takes its default instead: unset (import torch switches nothing on; import "
                           "offload_shim installs)"), switch
    assert device.startswith("installed True | offload_shim: OFFLOAD_SHIM_STAGING_DEVICE='gpu:zero' is not a device"), device
    assert switched_off.startswith("installed False | offload_shim: OFFLOAD_SHIM_CHUNK_BYTES='lots' is not a size"), switched_off
    assert switched_off.endswith("OFFLOAD_SHIM_CHUNK_BYTES takes its default instead: 16MiB (16777216 bytes)")


def test_import_offload_shim_installs():
    out = python("import offload_shim, torch.distributed.tensor", REPORT)
    assert last_line(out) == ALL_WRAPPED
    assert "[rank" not in out.stderr and "offload_shim" not in out.stderr, out.stderr  # quiet without OFFLOAD_SHIM_LOG


def test_import_without_torch_says_torch_is_required():
    """``import offload_shim`` where torch cannot be imported (a finder that answers for torch as Python does for a
    module that is not installed): a ModuleNotFoundError for torch that says offload_shim requires it and how to
    install it, not a bare ``No module named 'torch'``."""
    out = python(
        """
        import sys
        class NotInstalled:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "torch":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, NotInstalled())
        try:
            import offload_shim
        except ModuleNotFoundError as error:
            print(error.name, "|", error)
        """
    )
    assert last_line(out) == (f"torch | offload_shim requires torch, which is not installed in this environment "
                              f"({sys.executable}): pip install torch (https://pytorch.org/get-started/locally/ gives "
                              "the command for your accelerator)"), out.stdout


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


def torchrun(tmp_path, env, source=TRAIN):
    """Two ranks of ``source`` (:data:`TRAIN` unless given) as ``tmp_path/train.py`` under torchrun: the ranks' lines
    of stdout (those starting ``rank ``, one a rank), sorted, and stderr."""
    script = tmp_path / "train.py"
    script.write_text(source)
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
    table (not rank 1, nor torchrun's own process, which imports the shim too). (Torch's own error without the shim:
    tests/test_errors.py; nothing printed without OFFLOAD_SHIM: test_import_offload_shim_installs.)"""
    lines, stderr = torchrun(tmp_path, {
        "OFFLOAD_SHIM": "1", "OFFLOAD_SHIM_LOG": "info", "OFFLOAD_SHIM_SUMMARY": "1",
        "OFFLOAD_SHIM_STAGING_DEVICE": "cpu", "OFFLOAD_SHIM_ALWAYS_STAGE": "1",
    })
    for rank, line in enumerate(lines):
        assert line.startswith(f"rank {rank} StagingError offload_shim: torch.distributed.all_reduce got a tensor on cpu")
        assert line.endswith("| tensor [1.0, 1.0, 1.0, 1.0]")
    site = f"{tmp_path / 'train.py'}:{TRAIN.splitlines().index('    dist.all_reduce(torch.ones(2), group=gloo)') + 1}"
    # torchrun's own process imports torch with the same environment, and does not switch the shim on: the two
    # ranks alone say they installed it, and every line names its rank.
    installed = re.findall(r"^\[rank (\d) pid \d+\] offload_shim \S+: installed", stderr, re.M)
    assert sorted(installed) == ["0", "1"] and "[rank -" not in stderr and "[pid " not in stderr, stderr
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


@pytest.mark.skipif(__import__("torch").accelerator.is_available(), reason="needs a machine without an accelerator")
def test_torchrun_warns_once_per_rank_at_the_scripts_line(tmp_path):
    """A malformed OFFLOAD_SHIM under torchrun: one warning in each rank (none from torchrun's own process), located
    at the script's import torch line, the line itself echoed (not a line of the shim's)."""
    _, stderr = torchrun(tmp_path, {"OFFLOAD_SHIM": "maybe"})
    warning = re.compile(rf"^{re.escape(str(tmp_path / 'train.py'))}:2: RuntimeWarning: offload_shim is not enabled: "
                         r"OFFLOAD_SHIM='maybe' is not a boolean: .*\n\s+import os, time, torch, torch\.distributed as dist$", re.M)
    assert len(warning.findall(stderr)) == 2 and stderr.count("offload_shim is not enabled") == 2, stderr


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


def site_python(site, *code, env=None, cwd=None):
    return python(*code, env={"PYTHONPATH": os.pathsep.join(site), **(env or {})}, cwd=cwd)


# A training script that never mentions offload_shim until it reports: what was imported before torch, whether
# importing torch installed the wrappers, and which offload_shim a script in this folder imports.
CLONE_SCRIPT = """
import sys
before = [m for m in ("wrapt", "offload_shim", "offload_shim_boot", "torch") if m in sys.modules]
import builtins, torch, wrapt
installed = isinstance(torch.distributed.all_reduce, wrapt.FunctionWrapper)
import offload_shim
print(before, installed, getattr(builtins, "SHADOWED_SITECUSTOMIZE_RAN", False), offload_shim.__file__)
"""


def test_clone_folder_named_offload_shim_does_not_shadow(tmp_path, install):
    """The layout of issue 9: a clone in a folder named ``offload_shim`` (no ``__init__.py`` there), and a script in
    the folder that holds it. ``OFFLOAD_SHIM=1``, the drop-in and ``import offload_shim`` all reach the installed
    package (an editable install puts the clone on sys.path, so the folder is a namespace portion and loses), and
    ``offload-shim doctor`` run there says so. Both installs: this tree's and the built wheel's."""
    clone = tmp_path / "offload_shim"
    (clone / "tests").mkdir(parents=True)
    (clone / "setup.cfg").write_text("[metadata]\nname = offload_shim\n")
    package = pathlib.Path(install or ROOT) / "offload_shim" / "__init__.py"
    script = str(tmp_path / "train.py")

    by_variable = python(CLONE_SCRIPT, env={"OFFLOAD_SHIM": "1"}, site=install, script=script, cwd=tmp_path)
    assert last_line(by_variable) == f"[] True False {package}", by_variable.stderr

    # The drop-in, written by the install's own command, ahead of another sitecustomize it must still run.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import builtins\nbuiltins.SHADOWED_SITECUSTOMIZE_RAN = True\n")
    cli = subprocess.run([sys.executable, "-c", "import sys, offload_shim_cli; sys.exit(offload_shim_cli.main())",
                          "dropin", str(tmp_path / "site")], env=environment(site=install), capture_output=True, text=True)
    assert cli.returncode == 0 and (tmp_path / "site" / "__pycache__").is_dir(), cli
    path = os.pathsep.join((str(tmp_path / "site"), str(theirs)))
    by_dropin = python(CLONE_SCRIPT, env={"PYTHONPATH": path}, site=install, script=script, cwd=tmp_path)
    assert last_line(by_dropin) == f"[] True True {package}", by_dropin.stderr

    # offload-shim doctor: for this tree, from there under torchrun, each rank staging through host copies (exit
    # status 0); for the wheel, its console script from a folder where a module named offload_shim.py shadows the
    # package for scripts run there (exit status 1, with that and, where there is no accelerator, nothing to stage
    # through as reasons).
    if install is None:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                   "offload_shim", "doctor", "--backend", "gloo"]
        env, cwd = {"OFFLOAD_SHIM_STAGING_DEVICE": "cpu", "OFFLOAD_SHIM_ALWAYS_STAGE": "1", "OMP_NUM_THREADS": "1"}, tmp_path
    else:
        command, cwd = [os.path.join(install, "bin", "offload-shim"), "doctor"], tmp_path / "shadow"
        env = {"OFFLOAD_SHIM_STAGING_DEVICE": "cuda:7", "OFFLOAD_SHIM_ALWAYS_STAGED": "1"}  # no such device; a typo
        cwd.mkdir()
        (cwd / "offload_shim.py").write_text("")
    doctor = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=240, env=environment(env, site=install))
    if install is None:
        assert f"a script here imports            {package}\n" in doctor.stdout, doctor
        assert doctor.returncode == 0 and doctor.stdout.endswith("doctor: ok\n"), doctor
        for rank in range(2):
            assert f"rank {rank}: backend 'gloo', serves ['cpu', 'cuda']" in doctor.stdout
            assert f"rank {rank}: a 1048576-byte CPU all_reduce: staged through cpu\n" in doctor.stdout
            assert f"rank {rank}: all_reduce of a CPU tensor: [3.0, 3.0, 3.0, 3.0] on cpu (ok)\n" in doctor.stdout
    else:
        assert doctor.returncode == 1 and doctor.stdout.endswith("doctor: the shim would not work here\n"), doctor
        assert f"a script here imports            {cwd / 'offload_shim.py'}\n" in doctor.stdout, doctor
        assert f"PROBLEM: a script or python -m run in {cwd} imports offload_shim from {cwd / 'offload_shim.py'}, " \
               f"not the installed package ({package})" in doctor.stdout, doctor
        assert "PROBLEM: OFFLOAD_SHIM_ALWAYS_STAGED is not a variable of offload_shim and is ignored (did you mean " \
               "OFFLOAD_SHIM_ALWAYS_STAGE?)\n" in doctor.stdout, doctor
        assert "PROBLEM: the configured staging device 'cuda:7' (OFFLOAD_SHIM_STAGING_DEVICE) is not usable from this " \
               "process" in doctor.stdout, doctor


def test_asked_for_but_not_installed_warns_once_with_cause_and_fix(tmp_path):
    """Every path that asks for the shim ends in ``offload_shim_boot.activate``: where the package cannot install,
    one RuntimeWarning per process names the cause and the fix, whichever paths asked (the entry point and the
    drop-in both do in one process). Each cause in turn, in one interpreter, the process state reset between."""
    (tmp_path / "offload_shim").mkdir()  # a clone's folder: a namespace package where nothing else is found
    (tmp_path / "other" / "offload_shim").mkdir(parents=True)
    (tmp_path / "other" / "offload_shim" / "__init__.py").write_text("")  # someone else's package of that name
    (tmp_path / "module").mkdir()
    (tmp_path / "module" / "offload_shim.py").write_text("print('a module of the user ran')\n")
    out = python(
        f"""
        import sys, warnings, torch.distributed, offload_shim_boot
        path = list(sys.path)
        def fresh(first=None):
            for name in [m for m in sys.modules if m == "offload_shim" or m.startswith("offload_shim.")]:
                del sys.modules[name]
            offload_shim_boot._warned = False
            sys.path[:] = [first] if first else path
            if first:
                import offload_shim  # resolved with nothing but that folder on the path
                sys.path[:] = path
        def ask(*by):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for who in by:
                    offload_shim_boot.activate(who)
            print(len(caught), *(str(w.message) for w in caught), sep=" | ")
        fresh({str(tmp_path)!r}); ask("OFFLOAD_SHIM='1'", "the drop-in")
        fresh({str(tmp_path / "other")!r}); ask("OFFLOAD_SHIM='1'")
        fresh(); sys.path.insert(0, {str(tmp_path / "module")!r}); ask("OFFLOAD_SHIM='1'"); sys.path.pop(0)
        fresh(); sys.modules["wrapt"] = None; ask("OFFLOAD_SHIM='1'"); del sys.modules["wrapt"]
        fresh(); torch.distributed.is_available = lambda: False; ask("OFFLOAD_SHIM='1'")
        """,
        env={"OFFLOAD_SHIM": "1"},
    )
    namespace, other, module, wrapt, distributed = out.stdout.strip().splitlines()[-5:]
    # someone's offload_shim.py is named, not run
    assert module == f"1 | offload_shim is not enabled: 'offload_shim' would be imported from " \
                     f"{tmp_path / 'module' / 'offload_shim.py'}, which is not the offload_shim package (not run): a " \
                     "module of that name comes first on sys.path; rename it or run from another folder " \
                     "[asked for by OFFLOAD_SHIM='1']", out.stdout
    assert "a module of the user ran" not in out.stdout
    assert namespace.startswith(f"1 | offload_shim is not enabled: 'offload_shim' was imported as an empty namespace "
                                f"package from {tmp_path / 'offload_shim'}: a folder of that name without __init__.py")
    assert namespace.endswith("reinstall the clone with pip install -e (since offload_shim 0.2.0 that puts it on "
                              "sys.path) [asked for by OFFLOAD_SHIM='1']"), namespace
    assert other.startswith(f"1 | offload_shim is not enabled: 'offload_shim' was imported from "
                            f"{tmp_path / 'other' / 'offload_shim' / '__init__.py'}, which is not the offload_shim package")
    assert wrapt == f"1 | offload_shim is not enabled: wrapt is not installed in this environment ({sys.executable}): " \
                    "pip install wrapt [asked for by OFFLOAD_SHIM='1']"
    assert distributed == "1 | offload_shim is not enabled: this torch has no distributed support " \
                          "(torch.distributed.is_available() is False): nothing to wrap [asked for by OFFLOAD_SHIM='1']"


def test_sitecustomize_with_its_directory_twice_on_the_path(site, tmp_path):
    """The same directory under another spelling (a link): the shadowed one still runs, once, no recursion."""
    link = tmp_path / "ours-link"
    link.symlink_to(site[0])
    out = site_python([site[0], str(link), site[1]], "import builtins; print(builtins.SHADOWED_SITECUSTOMIZE_RAN)")
    assert last_line(out) == "True" and out.stderr == ""


def test_sitecustomize_malformed_value_warns_once(site):
    """A malformed switch is read as unset, and the drop-in installs unless OFFLOAD_SHIM is false: the shim is on;
    the entry point, which sees the same value, leaves it to the drop-in: one warning."""
    out = site_python(site, IMPORT_TORCH, REPORT, env={"OFFLOAD_SHIM": "sometimes"})
    assert last_line(out) == ALL_WRAPPED
    assert out.stderr.count("RuntimeWarning") == 1 and "offload_shim is not enabled" not in out.stderr, out.stderr
    assert out.stderr.count("offload_shim: OFFLOAD_SHIM='sometimes' is not a boolean") == 1, out.stderr


@pytest.mark.parametrize("missing", ["offload_shim", "wrapt"])
def test_sitecustomize_never_breaks_start_up(site, tmp_path, missing):
    """Start-up imports neither (so neither can break it); torch still imports, and says once why the shim is off."""
    stubs = tmp_path / "stubs"
    (stubs / missing).mkdir(parents=True)
    (stubs / missing / "__init__.py").write_text(f"raise ImportError('{missing} is not installed (test stub)')\n")
    out = site_python([site[0], str(stubs), site[1]], "print('started')", env={"OFFLOAD_SHIM": "1"})
    assert last_line(out) == "started" and out.stderr == ""
    if missing == "offload_shim":
        # (run outside this tree: a `python -c` here would find the real package in the current directory first)
        out = site_python([site[0], str(stubs), site[1]], "import torch; print('torch imported')", cwd=tmp_path)
        assert last_line(out) == "torch imported"
        assert out.stderr.count("offload_shim is not enabled: importing offload_shim failed in this environment "
                                f"({sys.executable}): ImportError: offload_shim is not installed (test stub) "
                                f"[asked for by the drop-in {os.path.realpath(site[0])}") == 1, out.stderr


def test_drop_in_left_behind_warns_once_per_rank_at_the_program(site, tmp_path):
    """``pip uninstall offload_shim`` with the drop-in left on PYTHONPATH (its start-up module gone: a stub in its
    place): ``import torch`` works and warns once, at the program's line, naming the drop-in to remove; under torchrun
    once in each rank and not in torchrun's own process."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "offload_shim_boot.py").write_text("raise ModuleNotFoundError(\"No module named 'offload_shim_boot'\")\n")
    path = os.pathsep.join([site[0], str(stubs)])
    drop_in = os.path.realpath(os.path.join(site[0], "sitecustomize.py"))
    said = (rf"RuntimeWarning: offload_shim is not enabled: offload_shim is not installed in this environment "
            rf"\({re.escape(sys.executable)}\), but its start-up drop-in {re.escape(drop_in)} is still on PYTHONPATH "
            r"and asks for it at every import torch: remove that file \(or its folder from PYTHONPATH\), or pip "
            r"install offload_shim; OFFLOAD_SHIM=0 silences this")
    out = python("import os\nimport torch\nprint('torch imported')", env={"PYTHONPATH": path}, cwd=tmp_path)
    assert last_line(out) == "torch imported"
    # (Python 3.13 on prints the source line of ``python -c`` code under the warning too.)
    assert re.fullmatch(rf"<string>:2: {said}\n(  import torch\n)?", out.stderr), out.stderr
    _, stderr = torchrun(tmp_path, {"PYTHONPATH": path})
    at_line = re.compile(rf"^{re.escape(str(tmp_path / 'train.py'))}:2: {said}$", re.M)
    assert len(at_line.findall(stderr)) == 2 and stderr.count("offload_shim is not enabled") == 2, stderr


def _editable_site(tmp_path) -> tuple[pathlib.Path, pathlib.Path]:
    """An editable install of a copy of this tree, as ``pip install -e`` makes it (the build backend's editable
    wheel, installed): ``(source, site)``, ``site`` holding the metadata, the ``.pth`` line and the entry point's
    module."""
    source = copy_source(tmp_path / "clone")
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-c", "import sys; sys.path.insert(0, 'build_backend'); import offload_shim_build as b; "
         f"b.build_editable({str(wheels)!r})"],
        cwd=source, check=True, capture_output=True,
    )
    site = tmp_path / "site"
    (wheel,) = wheels.glob("offload_shim-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "-q", "install", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    return source, site


def _layout(name, tmp_path, wheel_site) -> pathlib.Path:
    """The site of an install in layout ``name``, as its user left it."""
    if name.startswith("editable"):
        source, site = _editable_site(tmp_path)
        if name == "editable, source removed":
            shutil.rmtree(source)
        elif name == "editable, start-up module broken":
            (source / "offload_shim_boot.py").write_text("def autoload(:\n")  # a syntax error
        return site
    site = tmp_path / "site"
    shutil.copytree(wheel_site, site)
    if name == "wheel, partly uninstalled":
        shutil.rmtree(site / "offload_shim")
        (site / "offload_shim_boot.py").unlink()
    return site


# Run with the layout's site first on sys.path, its .pth processed, and without this tree (which the suite's own
# editable install puts on sys.path): what a program of that environment imports.
IN_LAYOUT = """
import os, site, sys, wrapt
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != {root!r}]
site.addsitedir({site!r})
import torch
print("installed" if isinstance(torch.distributed.all_reduce, wrapt.FunctionWrapper) else "not installed")
"""


@pytest.mark.parametrize("layout", [
    "wheel", "wheel, partly uninstalled", "editable", "editable, source removed", "editable, start-up module broken",
])
def test_start_up_hook_never_breaks_import_torch(tmp_path, wheel_site, layout):
    """Whatever is left of an install, ``import torch`` works: the entry point's module lives beside the metadata
    in every layout (an editable install's too) and does nothing, or warns once where the shim was asked for,
    where the rest is gone or broken."""
    site = _layout(layout, tmp_path, wheel_site)
    code = IN_LAYOUT.format(root=str(ROOT), site=str(site))
    intact = layout in ("wheel", "editable")
    for value in ("", "1"):
        out = python(code, env={"OFFLOAD_SHIM": value, "PYTHONPATH": str(site)}, cwd=tmp_path)
        assert last_line(out) == ("installed" if value and intact else "not installed"), out.stdout
        messages = [line for line in out.stderr.splitlines() if "offload_shim" in line]
        if value and not intact:  # at the program's import torch (line 5 of the code), not a line of torch's
            assert len(messages) == 1 and messages[0].startswith(
                "<string>:5: RuntimeWarning: offload_shim is not enabled: its start-up module cannot run"), messages
            assert "pip uninstall offload_shim removes it" in messages[0], messages
        else:
            assert messages == [], out.stderr


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
    assert any(f"offload_shim {importlib.metadata.version('offload_shim')}: installed (torch" in line for line in lines), logged.stderr
    assert any("staging torch.distributed.all_reduce of a cpu tensor (3,) torch.float32 through cpu" in line
               for line in lines), logged.stderr


def test_log_variable_values():
    from offload_shim import _config

    values = ("", " INFO ", "debug", "Warning")
    assert [_config.read_environment({"OFFLOAD_SHIM_LOG": v}).log_level for v in values] == [None, 20, 10, 30]
    read = _config.read_environment({"OFFLOAD_SHIM_LOG": "verbose"})  # malformed: its default, nothing printed
    assert read.log_level is None and read.malformed == (
        "OFFLOAD_SHIM_LOG='verbose' is not a log level: use one of ['debug', 'info', 'warning'] (case-insensitive); "
        "OFFLOAD_SHIM_LOG takes its default instead: unset (nothing printed)",)


@pytest.mark.parametrize("path", ["import offload_shim", "OFFLOAD_SHIM=1, import torch", "drop-in, import torch"])
def test_start_up_warnings_point_at_the_programs_import(tmp_path, site, path):
    """A misspelt setting warns once, located at the program's own line that imported the package or torch (that
    line echoed), whichever path switched the shim on: never at a line of the shim's, the drop-in's or torch's."""
    script = tmp_path / "train.py"
    line = "import offload_shim" if path == "import offload_shim" else "import torch"
    script.write_text(f"import os\n{line}\nprint('ran')\n")
    environ = {k: v for k, v in os.environ.items() if k not in SHIM_VARIABLES and k != "PYTHONPATH"}
    environ.update({"OFFLOAD_SHIM_CHUNK_BYTE": "1048576", "PYTHONWARNINGS": "default"})
    if path.startswith("OFFLOAD_SHIM=1"):
        environ["OFFLOAD_SHIM"] = "1"
    if path.startswith("drop-in"):
        environ["PYTHONPATH"] = os.pathsep.join(site)
    result = subprocess.run([sys.executable, str(script)], env=environ, capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)
    assert result.returncode == 0 and result.stdout == "ran\n", result.stderr
    warning = re.compile(rf"^{re.escape(str(script))}:2: RuntimeWarning: offload_shim: .*OFFLOAD_SHIM_CHUNK_BYTE.*\n"
                         rf"\s+{line}$", re.M)
    assert len(warning.findall(result.stderr)) == 1 and result.stderr.count("OFFLOAD_SHIM_CHUNK_BYTE'") <= 1, (
        result.stderr)
