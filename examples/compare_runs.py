"""Compare the example's runs: the shim on a NCCL-only group against its two references.

    python examples/compare_runs.py DIR

DIR holds what ``train_fsdp2_offload.py --out DIR`` wrote for the runs ``shim-nccl`` (offload, NCCL-only group,
OFFLOAD_SHIM=1), ``ref-gloo`` (offload, ``cpu:gloo,cuda:nccl`` group, no shim) and ``ref-no-offload`` (no offload).
Prints a table and writes ``DIR/compare.json``.
"""

import json
import os
import sys

import torch


def load(directory, name):
    with open(os.path.join(directory, f"{name}.json")) as f:
        record = json.load(f)
    return record, torch.load(os.path.join(directory, f"{name}.pt"))


def max_abs_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


def compare(directory):
    shim, shim_params = load(directory, "shim-nccl")
    result = {"steps": len(shim["losses"])}
    for ref_name in ("ref-gloo", "ref-no-offload"):
        ref, ref_params = load(directory, ref_name)
        worst = max(
            ((n, (shim_params[n].double() - ref_params[n].double()).abs().max().item()) for n in shim_params),
            key=lambda item: item[1],
        )
        result[ref_name] = {
            "losses_bitwise_equal": shim["loss_bits"] == ref["loss_bits"],
            "grad_norms_bitwise_equal": shim["grad_norm_bits"] == ref["grad_norm_bits"],
            "params_bitwise_equal": all(
                torch.equal(shim_params[n].view(torch.uint8), ref_params[n].view(torch.uint8)) for n in shim_params
            ),
            "loss_max_abs_diff": max_abs_diff(shim["losses"], ref["losses"]),
            "grad_norm_max_abs_diff": max_abs_diff(shim["grad_norms"], ref["grad_norms"]),
            "grad_norm_max_rel_diff": max(abs(x - y) / abs(y) for x, y in zip(shim["grad_norms"], ref["grad_norms"])),
            "param_max_abs_diff": worst[1],
            "param_max_abs_diff_at": worst[0],
            "first_step_loss_equal": shim["loss_bits"][0] == ref["loss_bits"][0],
        }
    with open(os.path.join(directory, "compare.json"), "w") as f:
        json.dump(result, f, indent=1)
    for ref_name in ("ref-gloo", "ref-no-offload"):
        print(f"shim-nccl vs {ref_name}:")
        for key, value in result[ref_name].items():
            print(f"  {key:28s} {value}")
    return result


if __name__ == "__main__":
    compare(sys.argv[1])
