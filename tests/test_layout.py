"""The layout docs/design.md describes: what the top level holds, every module of the package named there, and
imports that go one way (the order of its table of modules), functions' own imports included."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
DESIGN = (ROOT / "docs" / "design.md").read_text()
# The design card's top level and the usual project files; anything else must say in docs/design.md why it is there.
PROJECT_FILES = {
    "setup.cfg", "pyproject.toml", "offload_shim", "sitecustomize_template.py", "tests", "README.md", "docs",
    "examples", "benchmarks", "results", ".ci", "CONTRIBUTING.md", "CHANGELOG.md", "LICENSE", "MANIFEST.in", ".gitignore",
}


def _tracked_top_level() -> set[str]:
    import subprocess

    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return {line.split("/", 1)[0] for line in listed.splitlines()}


def _modules() -> dict[str, pathlib.Path]:
    """Dotted name -> file, for the package's modules and the top-level ones."""
    modules = {"offload_shim" if p.stem == "__init__" else f"offload_shim.{p.stem}": p
               for p in (ROOT / "offload_shim").glob("*.py")}
    modules.update({p.stem: p for p in ROOT.glob("*.py")})
    return modules


def _imports(path: pathlib.Path, modules) -> set[str]:
    """The modules of ``modules`` that ``path`` imports anywhere (a function's own imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    return found & set(modules)


def test_top_level_holds_only_the_project_files_and_what_design_md_explains():
    tracked = _tracked_top_level()
    assert PROJECT_FILES - {".gitignore", ".ci"} <= tracked  # (sanity: the list is the repository's)
    unexplained = sorted(name for name in tracked - PROJECT_FILES if f"`{name}" not in DESIGN)
    assert not unexplained, f"top-level files docs/design.md does not explain: {unexplained}"


def test_every_module_of_the_package_is_in_design_md_in_import_order():
    modules = _modules()
    rows = re.findall(r"^\| `(\w+)\.py` \|", DESIGN, re.M)
    package = [p.stem for p in (ROOT / "offload_shim").glob("*.py")]
    missing = sorted(set(package) - set(rows))
    assert not missing, f"modules of offload_shim/ not in docs/design.md: {missing}"
    order = ["offload_shim" if r == "__init__" else f"offload_shim.{r}" for r in rows if r in package]
    position = {name: i for i, name in enumerate(order)}
    upward = [(name, imported) for name in order for imported in _imports(modules[name], modules)
              if imported in position and position[imported] <= position[name] and imported != name]
    assert not upward, f"imports against the order of docs/design.md's table: {upward}"


def test_no_import_cycle():
    modules = _modules()
    edges = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    cycles = []

    def visit(name, path):
        for imported in edges[name]:
            if imported in path:
                cycles.append(path[path.index(imported):] + [imported])
            elif not cycles:
                visit(imported, path + [imported])

    for name in edges:
        visit(name, [name])
    assert not cycles, " -> ".join(cycles[0])
