"""The docs cannot drift from the code: README.md's CPU commands run as written, every variable and message the
docs name exists, links resolve, and the front door stays short and free of the maintainers' log (issue numbers,
commit hashes)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from interpreters import environment

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = {path: path.read_text() for path in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md",
                                            *sorted((ROOT / "docs").glob("*.md"))]}
# The pages a user reads through, whose lines stay readable in an editor and a diff (no table cell of a page's width).
USER_PAGES = ["docs/performance.md", "docs/operations.md", "docs/frameworks.md", "docs/faq.md", "docs/api.md",
              "docs/versions.md", "CHANGELOG.md"]
SOURCES = "\n".join(path.read_text() for path in [*ROOT.glob("offload_shim/*.py"), *ROOT.glob("offload_shim_*.py")])
# Adjacent string literals across lines, as the messages are written, read as one.
JOINED = re.sub(r"\"\s*\n\s*f?\"", "", SOURCES)


def _bash_blocks(text: str) -> list[list[str]]:
    """Each ```bash block of ``text``, as its commands: comments dropped, backslash continuations joined."""
    blocks = []
    for body in re.findall(r"```bash\n(.*?)```", text, re.S):
        commands, pending = [], ""
        for line in body.splitlines():
            line = re.sub(r"\s+#.*$", "", line) if not line.lstrip().startswith("#") else ""
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            if (pending + line).strip():
                commands.append((pending + line).strip())
            pending = ""
        blocks.append(commands)
    return blocks


def test_readme_is_a_short_front_door():
    lines = README.splitlines()
    assert len(lines) < 100, len(lines)
    assert [n for n, line in enumerate(lines, 1) if len(line) > 120] == []
    headings = {line: n for n, line in enumerate(lines, 1) if line.startswith("## ")}
    # The five questions: what it is, how to switch it on, what it costs, what to do about an error, its limits.
    for heading in ("## The problem", "## Quick start", "## What it costs", "## When something fails", "## Limits"):
        assert headings[heading] < 100, heading


FIGURE = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|us|GB/s|x)\b")  # a measured time, bandwidth or ratio


@pytest.mark.parametrize("path", list(DOCS), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_figure_names_its_run(path):
    """Every section (text between two headings) that gives a measured figure names the committed run in results/
    it comes from (a run that is no longer there cannot be checked)."""
    unnamed = []
    heading = "(the top)"
    for part in re.split(r"^(#+ .*)$", DOCS[path], flags=re.M):
        if re.match(r"#+ ", part):
            heading = part
        elif FIGURE.search(part):
            runs = re.findall(r"results/((?:gpu|cpu)/[\w.-]+)", part)
            if not runs:
                unnamed.append((heading, FIGURE.findall(part)[:3]))
            unnamed += [(heading, run) for run in runs if not (ROOT / "results" / run).is_dir()]
    assert unnamed == []


@pytest.mark.parametrize("path", list(DOCS), ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_name_no_issue_numbers_or_commit_hashes(path):
    text = DOCS[path]
    assert re.findall(r"\b[Ii]ssues? \d+|#\d+\b", text) == []
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"\d", w) and re.search(r"[a-f]", w)]
    assert hashes == []


@pytest.mark.parametrize("path", list(DOCS), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(path):
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", DOCS[path]):
        if "://" not in target:
            assert (path.parent / target).exists(), target


def _anchor(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", list(DOCS), ids=lambda p: str(p.relative_to(ROOT)))
def test_anchors_resolve(path):
    """A link to a heading of a page (``page.md#heading``, or ``#heading`` within the page) names one it has."""
    for target, anchor in re.findall(r"\]\(([^)#]*)#([^)]+)\)", DOCS[path]):
        page = (path.parent / target) if target else path
        if "://" in target or page.suffix != ".md":
            continue
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # (a '#' line in a code block is no heading)
        anchors = {_anchor(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}
        assert anchor in anchors, (target or path.name, anchor)


@pytest.mark.parametrize("page", USER_PAGES)
def test_user_pages_have_no_line_over_200_characters(page):
    long = [n for n, line in enumerate((ROOT / page).read_text().splitlines(), 1) if len(line) > 200]
    assert long == [], f"{page}: lines {long}"


def test_results_index_rows_are_short():
    """results/README.md is an index: one short row per run (its history is in results/history.md)."""
    rows = [line for line in (ROOT / "results" / "README.md").read_text().splitlines() if line.startswith("| `")]
    assert rows and [row[:60] for row in rows if len(row) > 300] == []
    listed = set(re.findall(r"\| `((?:gpu|cpu)/[\w.-]+)/`", "\n".join(rows)))
    runs = {f"{kind}/{p.name}" for kind in ("gpu", "cpu") for p in (ROOT / "results" / kind).iterdir() if p.is_dir()}
    series = {re.sub(r"-\d+$", "", run) for run in listed}  # (one row may name a series: `...-1/`, `-3/`)
    assert sorted(run for run in runs if re.sub(r"-\d+$", "", run) not in series) == []


def test_readme_answers_a_newcomer():
    """Within the README: how to remove the shim (without a prompt that stops a script), and the pages behind it."""
    assert "pip uninstall -y offload_shim" in README
    for page in ("docs/faq.md", "docs/api.md", "docs/versions.md", "CHANGELOG.md", "docs/troubleshooting.md"):
        assert f"]({page})" in README, page


def test_api_page_names_every_public_name():
    import offload_shim

    page = (ROOT / "docs" / "api.md").read_text()
    assert [name for name in offload_shim.__all__ if f"**`{name}" not in page] == []


def test_every_variable_the_docs_name_exists():
    from offload_shim import _config

    named = set()
    for text in DOCS.values():
        named |= set(re.findall(r"\bOFFLOAD_SHIM\w*", text))
    misspelt_on_purpose = {"OFFLOAD_SHIM_STAGING_DEVCE", "OFFLOAD_SHIMM"}  # the troubleshooting page's examples of warned misspellings
    assert sorted(named - set(_config.ENVIRONMENT) - {"OFFLOAD_SHIM_TEST_INDUCTOR"} - misspelt_on_purpose) == []
    assert "OFFLOAD_SHIM_TEST_INDUCTOR" in (ROOT / "tests" / "test_compile.py").read_text()


def _fragments(message: str) -> list[str]:
    """The literal parts of a message as the docs quote it, between their placeholders (``...``, ``<name>``, a
    quoted example value, a parenthesised detail, a variable's name, the package's name where torch names it)."""
    parts = re.split(r"\.\.\.|<[^>]+>|'[^']*'|\([^)]*\)|\[[^\]]*\]|OFFLOAD_SHIM\w*|\boffload_shim\b", message)
    return [p.strip(" :.,") for p in parts if len(p.strip(" :.,")) >= 12]


def _torch_message(kind: str) -> str:
    """One of the messages torch itself raises, raised here."""
    if kind == "leaf":
        probe = torch.zeros(1, requires_grad=True)
    else:
        with torch.inference_mode():
            probe = torch.zeros(1)
    with pytest.raises(RuntimeError) as raised:
        probe.zero_()
    return str(raised.value)


def test_every_message_the_troubleshooting_page_names_exists():
    """Each message heading of docs/troubleshooting.md is raised by the shim (its literal parts are in the code),
    by torch (raised here, or in torch's own source), or by the README's commands (test_readme_cpu_commands)."""
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    torch_source = (pathlib.Path(torch.__file__)).read_text()
    torch_raised = _torch_message("leaf") + "\n" + _torch_message("inference")
    run_by_readme = {"No backend type associated with device type cpu"}
    others = {
        "this nccl communicator is created to work on cuda:0, but the input tensor is on cpu",  # vLLM's own
        "Tensors must be CUDA and dense",  # NCCL's own check (ProcessGroupNCCL), which older torch reached with CPU tensors
    }
    messages = re.findall(r"^\*\*`(.+?)`\*\*", page, re.M) + re.findall(r"^\*\*`[^`]+`\*\* \((.+?)\)", page, re.M)
    assert len(messages) >= 12, messages
    for message in re.findall(r"^\*\*`(.+?)`\*\*", page, re.M):
        for fragment in _fragments(message):
            fragment = re.sub(r"^(RuntimeError|ValueError|AssertionError|RuntimeWarning|AttributeError|"
                              r"offload_shim\.StagingError|offload_shim\.ConfigError): ", "", fragment)
            if any(fragment in text for text in (JOINED, torch_raised, torch_source, *run_by_readme, *others)):
                continue
            raise AssertionError(f"{fragment!r} (from {message!r}) is in neither offload_shim's code nor torch's")


def test_readme_cpu_commands_run_as_written(tmp_path):
    """README's CPU try-out and doctor's CPU forms, as written, from the repository's root, with this
    environment's commands first on PATH (the install block is what .ci/run does before this suite)."""
    if torch.accelerator.is_available():
        pytest.skip("the CPU try-out's expectations are a CPU-only machine's")
    (commands,) = [block for block in _bash_blocks(README) if any("train_fsdp2_offload.py" in c for c in block)]
    assert len(commands) == 4, commands
    env = environment()
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    outputs = []
    for command in commands:
        result = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, f"{command}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        assert "Failed to initialize NumPy" not in result.stderr, "the README's set-up installs NumPy"
        outputs.append(result.stdout)
    failure, staged, doctor, doctor_ranks = outputs
    assert "  RuntimeError: No backend type associated with device type cpu\n" in failure
    assert "run with OFFLOAD_SHIM=1" in failure and "staged" not in failure
    assert "  RuntimeError: No backend type associated with device type cpu\n" in staged
    assert re.search(r"^staged \d+ calls of \d+ collectives, [\d.]+ MiB of FSDP2's tensors, through host copies$", staged, re.M)
    assert "losses, gradient norms and parameters bitwise equal with and without the shim" in staged
    assert doctor.endswith("doctor: ok\n") and doctor_ranks.endswith("doctor: ok\n")
    assert "rank 1: all_reduce of a CPU tensor: [3.0, 3.0, 3.0, 3.0] on cpu (ok)" in doctor_ranks
