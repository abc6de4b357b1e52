"""Table and plot of bench_staging.py's records (also: python benchmarks/report.py bench.json [bench.png])."""

from __future__ import annotations

import json
import sys

METHODS = ("gloo", "naive", "offload_shim", "gpu_resident")


def human(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def table(meta: dict, records: list[dict]) -> str:
    lines = [f"torch {meta['torch']}, NCCL {meta['nccl']}, {meta['world_size']} x {meta['device']}; "
             f"chunk {human(meta['chunk_bytes_default'])}, pageable path {meta['pageable_path_default']}; times in ms (median)"]
    for r in records:
        if r["kind"] == "copy_bandwidth":
            lines.append("copies, GB/s: " + ", ".join(f"{k[:-5]} {v:.1f}" for k, v in r.items() if k.endswith("GBps"))
                         + f"; H2D and D2H of {human(r['bytes'])} at once on both ranks: {ms(r['duplex_seconds'])} ms")
    lines.append("")
    lines.append("| op | dtype | host memory | size | floor | Gloo | naive staging | offload_shim | GPU-resident NCCL | shim / floor | Gloo / shim |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in records:
        if r["kind"] == "collective":
            lines.append(
                f"| {r['op']} | {r['dtype']} | {'pinned' if r['pinned'] else 'pageable'} | {human(r['bytes'])} | {ms(r['floor_seconds'])} | "
                + " | ".join(ms(r[f"{m}_seconds"]) for m in METHODS)
                + f" | {r['offload_shim_seconds'] / r['floor_seconds']:.2f} | {r['gloo_seconds'] / r['offload_shim_seconds']:.1f} |"
            )
    for r in records:
        if r["kind"] == "full_tensor":
            lines.append("")
            lines.append(
                f"full_tensor of a {human(r['bytes'])} FSDP2-offloaded weight: Gloo {ms(r['gloo_seconds'])}, naive staging "
                f"{ms(r['naive_seconds'])}, offload_shim {ms(r['offload_shim_seconds'])} (routed off the Gloo group: "
                f"{ms(r['offload_shim_routed_off_gloo_seconds'])}), GPU-resident {ms(r['gpu_resident_seconds'])}, floor "
                f"{ms(r['floor_seconds'])}; Gloo / offload_shim = {r['gloo_seconds'] / r['offload_shim_seconds']:.1f}x, "
                f"Gloo / routed = {r['gloo_seconds'] / r['offload_shim_routed_off_gloo_seconds']:.1f}x; peak extra accelerator "
                f"memory {human(r['peak_extra_bytes_offload_shim'])}"
            )
    sweep = [r for r in records if r["kind"] == "chunk_sweep"]
    if sweep:
        lines.append("")
        lines.append("all_reduce 256 MiB fp32, time over floor by chunk size: " + "; ".join(
            f"{human(r['chunk_bytes'])} {r['variant']} {r['over_floor']:.2f}" for r in sweep))
    for r in records:
        if r["kind"] == "peak_memory":
            lines.append(f"peak extra accelerator memory, all_reduce of {human(r['bytes'])}: {human(r['peak_extra_bytes'])} "
                         f"= {r['peak_extra_chunks']:.2f} chunks")
        if r["kind"] == "routing":
            lines.append(f"routing, all_reduce {human(r['bytes'])} pageable on the Gloo group: Gloo {ms(r['gloo_seconds'])}, "
                         f"through NCCL {ms(r['routed_seconds'])}")
        if r["kind"] == "small_calls":
            lines.append(f"{r['calls']} one-element all_reduces: Gloo {ms(r['gloo_seconds'])}, offload_shim {ms(r['offload_shim_seconds'])}")
    return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(op, pinned) for op in ("all_reduce", "broadcast") for pinned in (True, False)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), sharey=True)
    for ax, (op, pinned) in zip(axes, panels):
        rows = sorted((r for r in records if r["kind"] == "collective" and r["op"] == op and r["pinned"] == pinned
                       and r["dtype"] == "float32"), key=lambda r: r["bytes"])
        sizes = [r["bytes"] for r in rows]
        for method in METHODS:
            ax.loglog(sizes, [r[f"{method}_seconds"] * 1e3 for r in rows], marker="o", label=method)
        ax.loglog(sizes, [r["floor_seconds"] * 1e3 for r in rows], "k--", label="floor (pinned H2D)")
        ax.set_title(f"{op}, fp32, {'pinned' if pinned else 'pageable'} CPU tensor")
        ax.set_xlabel("bytes")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("ms (median)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    data = json.load(open(sys.argv[1]))
    print(table(data["meta"], data["records"]))
    if len(sys.argv) > 2:
        plot(data["records"], sys.argv[2])
