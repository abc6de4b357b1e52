"""The names of offload_shim's environment variables, and the check for names that look like them: a module that
imports nothing of offload_shim (nor torch), so that the start-up module (``offload_shim_boot``) can name a misspelt
variable at ``import torch`` without importing the package, which imports torch and installs the wrappers; the
package reads the same list (``offload_shim._config`` names each as a constant from it)."""

import os

# Every variable offload_shim reads.
VARIABLES = (
    "OFFLOAD_SHIM", "OFFLOAD_SHIM_STAGING_DEVICE", "OFFLOAD_SHIM_ALWAYS_STAGE", "OFFLOAD_SHIM_CHUNK_BYTES",
    "OFFLOAD_SHIM_ROUTE_MIN_BYTES", "OFFLOAD_SHIM_HOST_STAGING", "OFFLOAD_SHIM_GRAPHS", "OFFLOAD_SHIM_REGISTER_BYTES",
    "OFFLOAD_SHIM_LOG", "OFFLOAD_SHIM_SUMMARY",
)

# The spellings of a boolean variable (any case, surrounding blanks ignored), and what a malformed OFFLOAD_SHIM,
# the switch, means: its default, unset (start-up names it while the package is not imported).
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
SWITCH_DEFAULT = "unset (import torch switches nothing on; import offload_shim installs)"


def not_a_boolean(name: str, raw: str) -> str:
    """What is wrong with the value ``raw`` of the boolean variable ``name``, and the values it takes."""
    return (f"{name}={raw!r} is not a boolean: use one of {sorted(TRUE)} to enable or {sorted(FALSE)} to disable "
            "(case-insensitive)")


def malformed(name: str, problem: str, default: str) -> str:
    """The sentence for a malformed variable: ``problem`` (which names the variable, the value given and what it
    takes), then the default the variable takes instead."""
    return f"{problem}; {name} takes its default instead: {default}"


def look_alikes(environ=os.environ) -> list[str]:
    """Sentences naming each variable of ``environ`` that looks like one of offload_shim's (:data:`VARIABLES`) but is
    none of them, with the nearest name: one that holds ``SHIM`` in any case and starts with ``OFFLOAD_SHIM``, or is
    within a letter or two of one of them (``OFFLOAD_SHIMM``, ``OFLOAD_SHIM``, ``offload_shim``). The test suite's own
    ``OFFLOAD_SHIM_TEST_*`` are not named. Cheap where nothing looks alike: it runs at every ``import torch``."""
    suspects = [
        name for name in environ
        if name not in VARIABLES and not name.startswith("OFFLOAD_SHIM_TEST_")
        and "SHIM" in name.upper()  # (the entry point's own test before it hands over: the same)
    ]
    if not suspects:
        return []
    import difflib

    sentences = []
    for name in sorted(suspects):
        near = difflib.get_close_matches(name.upper().replace("-", "_"), VARIABLES, n=1, cutoff=0.8)
        if near or name.startswith("OFFLOAD_SHIM"):
            sentences.append(f"{name} is not a variable of offload_shim and is ignored"
                             + (f" (did you mean {near[0]}?)" if near else ""))
    return sentences
