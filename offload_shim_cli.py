"""The ``offload-shim`` command (also ``python -m offload_shim``): its one parser and every subcommand.

    offload-shim run [--] CMD [ARG...]  run CMD with OFFLOAD_SHIM=1, e.g. offload-shim run torchrun --nproc_per_node 2 train.py
    offload-shim dropin DIR           write the sitecustomize drop-in as DIR/sitecustomize.py
    offload-shim info                 versions, accelerator, settings, start-up entry point, what is wrapped
    offload-shim doctor [--backend B] whether the shim would work here, and why not (exit status 1); under
                                      torchrun, each rank's group, backends, staging device and a staged all_reduce

A top-level module outside the package, so that ``run``, ``dropin``, ``--help``, ``run --help`` and ``--version``
import neither torch nor the package (importing the package installs the wrappers). ``info`` and ``doctor`` import
both when they run, and so describe their own process, as they say: a job's ranks say the same of themselves
(:data:`FOR_THE_JOB`). The start-up module, ``offload_shim_boot``, is the only other part that must stay import-free;
this one takes from it the reasons the shim is not enabled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import warnings

from offload_shim_boot import import_failure


def run_command(command: list) -> int:
    """Execute ``command`` (an argv list, optionally after ``--``) with ``OFFLOAD_SHIM=1``; returns only on error."""
    if command[:1] == ["--"]:
        command = command[1:]
    if not command or not command[0]:
        print("offload-shim run: give a command, e.g. offload-shim run torchrun --nproc_per_node 2 train.py",
              file=sys.stderr)
        return 2
    os.environ["OFFLOAD_SHIM"] = "1"
    if not autoload_enabled():
        print(f"offload-shim run: warning: {AUTOLOAD_OFF}", file=sys.stderr)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"offload-shim run: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127


AUTOLOAD_OFF = (
    "TORCH_DEVICE_BACKEND_AUTOLOAD is not 1, so torch runs no torch.backends entry point and OFFLOAD_SHIM=1 "
    "switches nothing on at import torch; unset it, import offload_shim in the script, or put the drop-in on "
    "PYTHONPATH (offload-shim dropin DIR)"
)


def autoload_enabled() -> bool:
    """Whether torch runs its ``torch.backends`` entry points at ``import torch`` (torch's own test, in
    ``torch._is_device_backend_autoload_enabled``: ``TORCH_DEVICE_BACKEND_AUTOLOAD`` unset or ``1``)."""
    return os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") == "1"


RUN_USAGE = "offload-shim run [--] CMD [ARG...]"


def parser():
    """The command line's parser. Building it and printing help or the version import neither torch nor the
    ``offload_shim`` package (``run``, ``dropin`` and ``--help`` stay cheap, and work where torch is broken)."""
    import argparse

    top = argparse.ArgumentParser(prog="offload-shim", description="Stage CPU tensors of collectives through the accelerator.")
    top.add_argument("--version", action="version", version=f"offload-shim {_version()}")
    sub = top.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="show versions, accelerator, settings and the start-up entry point")
    doctor = sub.add_parser(
        "doctor", help="check that the shim would work here; exit status 1 with the reasons where it would not",
        description="Check that offload_shim would work here: versions, the accelerator, which offload_shim a "
        "script in this directory imports, the start-up entry point and drop-in, the settings and their sources; "
        "under torchrun, on every rank, the default process group's backends, the device types it serves, the "
        "staging device and one all_reduce of a CPU tensor through the shim. Exit status 1 with the reasons "
        "where the shim would not work, 0 otherwise.",
    )
    doctor.add_argument(
        "--backend", help="backend of the default process group made under torchrun (default: the accelerator's "
        "own, e.g. nccl; gloo where there is no accelerator)",
    )
    dropin = sub.add_parser(
        "dropin", help="write the sitecustomize drop-in into DIR",
        description="Write the drop-in (sitecustomize_template.py) as DIR/sitecustomize.py; with DIR on "
        "PYTHONPATH, every Python process switches the shim on when it imports torch, unless OFFLOAD_SHIM is false.",
    )
    dropin.add_argument("directory", metavar="DIR")
    dropin.add_argument("--force", action="store_true", help="replace a different DIR/sitecustomize.py")
    run = sub.add_parser(
        "run", usage=RUN_USAGE, help="run a command with OFFLOAD_SHIM=1",
        description="Run CMD with OFFLOAD_SHIM=1 in its environment, e.g. offload-shim run torchrun "
        "--nproc_per_node 2 train.py. Everything after run (or after --) is the command; -h/--help right after "
        "run prints this.",
    )
    run.add_argument("argv", nargs="*", metavar="CMD [ARG...]", help="the command and its arguments")
    return top


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("offload_shim")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (not installed)"


def write_dropin(directory: str, force: bool = False) -> int:
    """``offload-shim dropin DIR``: copy the installed ``sitecustomize_template.py`` to ``DIR/sitecustomize.py``
    (``DIR`` made if missing), with its bytecode for this Python in ``DIR/__pycache__`` where it can be written.
    Refuses, exit status 1, to replace a different file there unless ``force``, and where ``DIR`` cannot be
    written."""
    import importlib.util
    import pathlib
    import py_compile
    import shlex

    spec = importlib.util.find_spec("sitecustomize_template")  # found, not imported (importing it would arm it)
    if spec is None or spec.origin is None:
        print("offload-shim dropin: sitecustomize_template is not installed with offload_shim", file=sys.stderr)
        return 1
    text = pathlib.Path(spec.origin).read_text()
    target = pathlib.Path(directory) / "sitecustomize.py"
    if target.exists() and target.read_text() != text and not force:
        print(f"offload-shim dropin: {target} exists and differs; the drop-in runs the sitecustomize it shadows "
              "from later on sys.path, so put that one in another directory, or pass --force", file=sys.stderr)
        return 1
    same = target.exists() and target.read_text() == text  # (the same drop-in again: a read-only DIR is fine)
    try:
        if not same:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
    except OSError as exc:
        print(f"offload-shim dropin: cannot write {target}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    try:
        # Its bytecode too, for this Python: where the directory is read-only or PYTHONDONTWRITEBYTECODE is set,
        # every start-up would otherwise compile the file again (about 2 ms).
        py_compile.compile(str(target), doraise=True)
    except OSError as exc:
        print(f"offload-shim dropin: note: its bytecode was not written ({exc.strerror or exc}): each start-up "
              "compiles it again, about 2 ms", file=sys.stderr)
    print(f"{'kept' if same else 'wrote'} {target}\nswitch it on with: export PYTHONPATH={shlex.quote(str(target.parent.resolve()))}"
          "${PYTHONPATH:+:$PYTHONPATH}")
    return 0


def main(argv=None) -> int:
    """``offload-shim run [--] CMD [ARG...]``, ``dropin DIR``, ``info`` or ``doctor``; ``--help``, ``run --help``
    and ``--version`` print and exit 0. ``info`` and ``doctor`` import the package: where that fails, one line
    says why (exit status 1; 2 for a ``ValueError``). A malformed variable is no failure: it takes its default, and
    both report it (doctor as a problem)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"] and argv[1:2] not in (["-h"], ["--help"]):
        return run_command(argv[1:])
    try:
        args = parser().parse_args(argv)  # help, the version and usage errors, before torch is imported
    except SystemExit as stop:  # argparse's: 0 after help or the version, 2 for a usage error
        return stop.code if isinstance(stop.code, int) else 2
    if args.command == "dropin":
        return write_dropin(args.directory, args.force)
    try:
        with warnings.catch_warnings():  # a malformed variable is reported below, in the output (this process is ours)
            warnings.simplefilter("ignore", RuntimeWarning)
            import offload_shim  # noqa: F401 - installs the wrappers, as in a training process
    except Exception as exc:
        print(f"offload-shim: {import_failure(exc)}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    return info() if args.command == "info" else doctor(args.backend)


# What info and doctor describe: their own process, which imported offload_shim to answer, and how to see the same of
# a job's ranks, each of which says it itself.
FOR_THE_JOB = (
    "each rank says it itself: with OFFLOAD_SHIM_LOG=info, a rank where the shim is on writes first "
    "'[rank R pid P] offload_shim VERSION: installed (torch ..., settings Settings(...))' (no such line: off there); "
    "with OFFLOAD_SHIM_SUMMARY=1, rank 0 prints at exit 'offload_shim: staged calls on rank 0 (pid P):' and its "
    "table, or 'offload_shim: no call was staged on rank 0 (pid P)'; a malformed variable is a RuntimeWarning in "
    "every rank; torchrun ... -m offload_shim doctor checks each rank's group"
)


def this_process(command: str) -> str:
    """The row saying which process ``command`` (``info``, ``doctor``) describes: its own."""
    rank = os.environ.get("RANK", "").strip()
    where = f"rank {rank} of the job torchrun started for it" if rank else "RANK unset: no rank of a job"
    return f"pid {os.getpid()}, offload-shim {command}'s own ({where}); these rows describe it, not your job's ranks"


def _info() -> int:
    import importlib.metadata

    import torch
    import wrapt

    import offload_shim
    from offload_shim import _config

    accelerator = torch.accelerator.current_accelerator()
    entry_points = [e.value for e in importlib.metadata.entry_points(group="torch.backends") if e.name == "offload_shim"]
    rows = [
        ("this process", this_process("info")),
        ("offload_shim", offload_shim.__version__),
        ("torch", torch.__version__),
        ("wrapt", getattr(wrapt, "__version__", "?")),
        ("accelerator", f"{accelerator} (available: {torch.accelerator.is_available()}, devices: {torch.accelerator.device_count()})"),
        ("torch.distributed available", torch.distributed.is_available()),
        ("torch.backends entry point", entry_points or "not registered (is the package installed?)"),
        (_config.ENV_ENABLE, os.environ.get(_config.ENV_ENABLE, "<unset>")),
        ("settings", offload_shim.settings()),
        ("installed", f"{offload_shim.is_installed()} in this process (pid {os.getpid()}: this command imported "
                      "offload_shim, which installs it)"),
        ("wrapped so far", ", ".join(sorted(offload_shim.wrapped_functions())) or "-"),
        ("", "(the functional collectives' Python functions are wrapped when torch imports their module; the "
             "collective ops of compiled code, the functional collectives and DTensor at install)"),
        ("your job's ranks", FOR_THE_JOB),
    ]
    rows += [("malformed", sentence) for sentence in _config.read_environment().malformed]
    for key, value in rows:
        print(f"{key:30s} {value}")
    return 0


def info() -> int:
    """``offload-shim info``: this process's versions, settings and wrappers, and each malformed variable (which
    takes its default). Exit status 0."""
    return _info()


def doctor(backend: str | None = None) -> int:
    """``offload-shim doctor``: print what decides whether the shim works in this environment, then, under
    torchrun (``RANK`` and ``WORLD_SIZE`` set), make the default process group (``backend``, default the
    accelerator's own) and check each rank. Returns 1 with the problems listed where the shim would not work, or
    would not as the environment asks (a malformed variable, which takes its default), 0 otherwise."""
    import torch.distributed as dist

    problems, notes = [], []
    rank = os.environ.get("RANK")
    if rank is None or int(rank) == 0:
        _print_rows(_environment_rows(problems, notes))
    else:
        _environment_rows(problems, notes)  # the same checks, printed once, by rank 0
    if rank is not None and "WORLD_SIZE" in os.environ and dist.is_available():
        problems += _check_ranks(backend)
    elif rank is not None:
        problems.append("torch.distributed is unavailable: no process group to check")
    if rank is None or int(rank) == 0:
        for note in notes:
            print(f"note: {note}")
        for problem in problems:
            print(f"PROBLEM: {problem}")
        print("doctor: " + ("the shim would not work here" if problems else "ok"))
    return 1 if problems else 0


def _print_rows(rows) -> None:
    for key, value in rows:
        print(f"{key:32s} {value}")


def _environment_rows(problems: list, notes: list) -> list:
    """What the environment decides: versions, the package a script here imports, activation, settings."""
    import importlib.metadata

    import torch
    import wrapt

    import offload_shim
    from offload_shim import _config, _devices

    accelerator = torch.accelerator.current_accelerator()
    available = torch.accelerator.is_available()
    rows = [
        ("this process", this_process("doctor")),
        ("python", f"{sys.version.split()[0]} ({sys.executable})"),
        ("offload_shim", f"{offload_shim.__version__} ({os.path.dirname(offload_shim.__file__)})"),
        ("torch", torch.__version__),
        ("wrapt", getattr(wrapt, "__version__", "?")),
        ("accelerator", f"{accelerator} (available: {available}, devices: {torch.accelerator.device_count()})"),
        ("torch.distributed available", torch.distributed.is_available()),
    ]
    if not torch.distributed.is_available():
        problems.append("this torch has no distributed support (torch.distributed.is_available() is False)")

    here = _script_view(os.getcwd())
    rows.append(("a script here imports", here))
    ours = os.path.realpath(offload_shim.__file__)
    if here != ours:
        problems.append(
            f"a script or python -m run in {os.getcwd()} imports offload_shim from {here}, not the installed "
            f"package ({ours}): run from another folder or rename the one that shadows it"
        )

    entry = [e.value for e in importlib.metadata.entry_points(group="torch.backends") if e.name == "offload_shim"]
    rows.append(("torch.backends entry point", entry[0] if entry else "not registered"))
    autoload = autoload_enabled()
    rows.append(("TORCH_DEVICE_BACKEND_AUTOLOAD", os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "<unset>: entry points run")))
    dropin = getattr(sys.modules.get("sitecustomize"), "__file__", None)
    has_dropin = hasattr(sys.modules.get("sitecustomize"), "_offload_shim_activate")
    rows.append(("sitecustomize drop-in", dropin if has_dropin else "none"))
    read = _config.read_environment()
    enabled = read.enabled
    switch_malformed = enabled is None and os.environ.get(_config.ENV_ENABLE, "").strip()
    if enabled and not has_dropin and not entry:
        problems.append("OFFLOAD_SHIM is set but the torch.backends entry point is not registered: install the package (pip install)")
    elif enabled and not has_dropin and not autoload:
        problems.append(AUTOLOAD_OFF)
    if enabled is None and not has_dropin and not switch_malformed:  # (malformed: a problem below)
        notes.append("OFFLOAD_SHIM is unset: import torch alone does not switch the shim on here (set OFFLOAD_SHIM=1, "
                     "use offload-shim run, import offload_shim, or the drop-in)")
    if enabled is False:
        at_import = "does nothing: OFFLOAD_SHIM is false"
    elif has_dropin:
        at_import = "switches the shim on (the sitecustomize drop-in)"
    elif enabled and entry and autoload:
        at_import = "switches the shim on (OFFLOAD_SHIM, through the torch.backends entry point)"
    elif enabled:
        at_import = "does nothing (see the problem below)"
    elif switch_malformed:
        at_import = "does nothing: OFFLOAD_SHIM is malformed, read as unset (see the problem below)"
    else:
        at_import = "does nothing: OFFLOAD_SHIM is unset (a script's own import offload_shim still switches it on)"
    rows.append(("import torch in a program here", at_import))
    rows.append(("installed in this process", f"yes, by this command, which imports offload_shim (pid {os.getpid()})"
                 if offload_shim.is_installed() else "no: OFFLOAD_SHIM is false"))
    rows.append(("your job's ranks", FOR_THE_JOB))

    defaults = _config.Settings()
    malformed = {sentence.partition("=")[0]: sentence for sentence in read.malformed}
    for name in _config.ENVIRONMENT:
        raw = os.environ.get(name)
        shown = "<unset>" if raw is None else f"{raw!r} (empty: as unset)" if not raw.strip() else (
            f"{raw!r} (malformed, so its default: {_config.DEFAULTS[name]})" if name in malformed
            else f"{raw!r} (environment)")
        rows.append((name, shown))
    settings = offload_shim.settings()
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        source = "default" if value == getattr(defaults, field.name) else "set"
        rows.append((f"  {field.name}", f"{value} ({source})"))
    notes += _config.inert_settings(settings, available)
    problems += list(read.malformed) + _config.unknown_variables()
    device = settings.staging_device
    if device is not None and device.type != "cpu" and not _devices._usable(device):
        problems.append(
            f"the configured staging device {str(device)!r} ({_config.ENV_STAGING_DEVICE}) is not usable from this "
            f"process (accelerator {accelerator}, available: {available}, devices: {torch.accelerator.device_count()})"
        )
    if settings.staging_device is None and not available:
        problems.append(
            "no device to stage through: no accelerator is available and OFFLOAD_SHIM_STAGING_DEVICE is unset "
            "(to run the staging path through host copies on a CPU-only machine: OFFLOAD_SHIM_STAGING_DEVICE=cpu "
            "with OFFLOAD_SHIM_ALWAYS_STAGE=1 on a Gloo group)"
        )
    return rows


def _script_view(directory: str) -> str:
    """Where ``import offload_shim`` leads in a script or ``python -m`` run in ``directory`` (``sys.path[0]`` is
    that directory there), as the import system would find it, without importing: the file of a regular
    package or module, or ``namespace package at [...]``."""
    import importlib.machinery

    path = [directory, *sys.path[1:]]
    for finder in sys.meta_path:
        try:
            if isinstance(finder, type) and issubclass(finder, importlib.machinery.PathFinder):
                spec = finder.find_spec("offload_shim", path)
            else:
                spec = finder.find_spec("offload_shim", None)
        except Exception:
            continue
        if spec is not None:
            if spec.origin is None or spec.origin == "namespace":
                return f"namespace package at {list(spec.submodule_search_locations or [])}"
            return os.path.realpath(spec.origin)
    return "nothing (not found)"


def _check_ranks(backend: str | None) -> list:
    """Make the default group and check this rank; rank 0 prints every rank's lines. Returns this rank's problems,
    and on rank 0 every rank's."""
    import torch
    import torch.distributed as dist

    import offload_shim
    from offload_shim import _devices, _plan, _table

    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = None
    if accelerator is not None:
        device = torch.device(accelerator.type, local % torch.accelerator.device_count())
        torch.accelerator.set_device_index(device.index)
    if backend is None:
        backend = dist.Backend.default_device_backend_map.get(accelerator.type, "gloo") if accelerator else "gloo"
    problems = []
    try:
        dist.init_process_group(backend, device_id=device if device is not None and backend != "gloo" else None)
    except Exception as exc:  # an unknown backend, or one this build lacks: each rank says so, without a group
        return [f"rank {os.environ.get('RANK')}: cannot make the default process group with backend {backend!r}: "
                f"{type(exc).__name__}: {exc}"]
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        group = dist.group.WORLD
        served = sorted(_devices.record(group).served)
        lines = [f"backend {_devices.backend_description(group)!r}, serves {served}, bound device "
                 f"{getattr(group, 'bound_device_id', None)}, accelerator device {device}"]
        for nbytes in sorted({4, offload_shim.settings().route_min_bytes or 4}):
            probe = torch.zeros(nbytes // 4)
            try:
                call = _plan.Call(_table.C10D["all_reduce"], _plan.C10D, group, {"tensor": probe}, op=dist.ReduceOp.SUM)
                plan = _plan.decide(call)  # what a CPU all_reduce of this size would do, decided as for any call
                through = None if plan is None else plan.device
                why = "the group serves cpu" if served else "its backend records no device types: passed through"
                lines.append(f"a {nbytes}-byte CPU all_reduce: " + (f"staged through {through}" if through else f"left to torch ({why})"))
            except offload_shim.StagingError:
                lines.append(f"a {nbytes}-byte CPU all_reduce: refused (StagingError)")
        tensor = torch.full((4,), float(rank + 1))
        try:
            dist.all_reduce(tensor)
            expected = world * (world + 1) / 2
            ok = tensor.device.type == "cpu" and tensor.tolist() == [expected] * 4
            lines.append(f"all_reduce of a CPU tensor: {tensor.tolist()} on {tensor.device} ({'ok' if ok else f'expected {expected}'})")
            if not ok:
                problems.append(f"rank {rank}: all_reduce of a CPU tensor gave {tensor.tolist()}, expected {expected}")
        except Exception as exc:  # the failure the shim exists to prevent, or the shim's own refusal
            why = f"{type(exc).__name__}: {str(exc).split('. Ways out')[0]}"
            lines.append(f"all_reduce of a CPU tensor: failed")
            problems.append(f"rank {rank}: all_reduce of a CPU tensor failed: {why}")
        # Every rank's report, printed by rank 0 in rank order (the ranks share one terminal).
        store = dist.distributed_c10d._get_default_store()
        store.set(f"offload_shim_doctor/{rank}", json.dumps({"lines": lines, "problems": problems}))
        if rank == 0:
            problems = []
            for other in range(world):
                report = json.loads(store.get(f"offload_shim_doctor/{other}"))
                print("\n".join(f"rank {other}: {line}" for line in report["lines"]))
                problems += report["problems"]
        store.add("offload_shim_doctor/done", 1)
        while store.add("offload_shim_doctor/done", 0) < world:  # no rank leaves while another may read
            time.sleep(0.01)
    finally:
        dist.destroy_process_group()
    return problems
