"""The reference's tables of what is wrapped (docs/reference.md) name every collective of the running torch, and
what they call staged is wrapped: a torch that adds a collective fails here until the table (and the shim) say what
happens to it. The docs' tables of variables name every variable the package, its scripts and its tests read."""

from __future__ import annotations

import inspect
import pathlib
import re

import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

import offload_shim

ROOT = pathlib.Path(__file__).parent.parent
REFERENCE = (ROOT / "docs" / "reference.md").read_text()
# Functions of distributed_c10d that take a group but move no tensor between ranks.
NOT_COLLECTIVES = {
    "destroy_process_group", "get_backend_config", "get_backend", "get_rank", "get_world_size", "new_subgroups",
    "get_group_rank", "get_global_rank", "get_process_group_ranks", "shrink_group", "split_group",
    "set_timeout", "get_backend_impl",  # torch 2.14
}


def _takes_group(function) -> bool:
    try:
        return "group" in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def c10d_collectives() -> set[str]:
    names = {n for n in c10d.__all__ if callable(getattr(c10d, n, None)) and not isinstance(getattr(c10d, n), type)}
    return {n for n in names if (_takes_group(getattr(c10d, n)) or n == "batch_isend_irecv")} - NOT_COLLECTIVES


def functional_collectives() -> set[str]:
    return {
        n for n, f in vars(funcol).items()
        if not n.startswith("_") and inspect.isfunction(f) and f.__module__ == funcol.__name__ and _takes_group(f)
    }


def table_rows(heading: str) -> dict[str, str]:
    """The rows of the reference's table whose first header cell is ``heading``: each backticked name of the first
    column, mapped to the second column."""
    start = REFERENCE.index(f"| `{heading}` |")
    rows = {}
    for line in REFERENCE[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        first, second = line.split("|")[1:3]
        for name in re.findall(r"`([A-Za-z_]+)`", first):
            rows[name] = second.strip()
    return rows


def test_every_c10d_collective_is_in_the_table():
    rows = table_rows("torch.distributed")
    assert sorted(c10d_collectives() - set(rows)) == []


def test_every_functional_collective_is_in_the_table():
    rows = table_rows("torch.distributed._functional_collectives")
    listed = set(rows) | {n for n in functional_collectives() if n.endswith("_autograd")}  # "the _autograd forms"
    assert sorted(functional_collectives() - listed) == []


def test_what_the_table_calls_staged_is_wrapped():
    offload_shim.install()
    wrapped = offload_shim.wrapped_functions()
    for name, what in table_rows("torch.distributed").items():
        if what.startswith("staged") and hasattr(c10d, name):
            assert f"{c10d.__name__}.{name}" in wrapped, name
    staged_functional = [n for n, what in table_rows("torch.distributed._functional_collectives").items()
                         if what.startswith("staged") and not n.endswith("_inplace")]
    autograd_forms = [n for n in functional_collectives() if n.endswith("_autograd")]
    for name in staged_functional + autograd_forms:
        if hasattr(funcol, name):
            assert f"{funcol.__name__}.{name}" in wrapped, name


def test_docs_tables_name_every_variable():
    """Every variable offload_shim reads (``_config.ENVIRONMENT``) and every one its tests, benchmarks, examples
    and CI read has a row (or a line) in the docs' tables of variables: docs/operations.md for users',
    CONTRIBUTING.md for the tests' and scripts'."""
    from offload_shim import _config

    sources = [*ROOT.glob("tests/**/*.py"), *ROOT.glob("benchmarks/*.py"), *ROOT.glob("examples/**/*.py"),
               *ROOT.glob("examples/*.sh"), ROOT / ".ci" / "run"]
    read = set(_config.ENVIRONMENT)
    for source in sources:
        text = source.read_text()
        if source.parent.name != "tests":  # (the tests also set misspelt names, to see them warned about)
            read |= set(re.findall(r"\b(OFFLOAD_SHIM\w*)", text))  # every variable of ours, wherever it is read
        read |= set(re.findall(r"environ(?:\.get)?\(?\[?\"([A-Z_]+)\"", text))  # os.environ reads in Python
        read |= set(re.findall(r"\$\{([A-Z_]+)", text))  # parameter expansions in shell scripts
    documented = set(re.findall(r"`([A-Z_]+)`", (ROOT / "docs" / "operations.md").read_text()))
    documented |= set(re.findall(r"`([A-Z_]+)`", (ROOT / "CONTRIBUTING.md").read_text()))
    # Python's, bash's, the device tool's, and torchrun's own (it sets them in every rank).
    commonplace = {"PYTHONPATH", "PIPESTATUS", "OUT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "GROUP_RANK"}
    assert sorted(read - documented - commonplace) == []
