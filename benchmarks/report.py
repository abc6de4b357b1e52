"""Table and plot of bench_staging.py's records (also: python benchmarks/report.py bench.json [bench.png])."""

from __future__ import annotations

import json
import sys

ROUTES = ("gloo", "hand_staging", "offload_shim", "gpu_resident")


def human(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.3g}"


def _first(records, kind, **match):
    for r in records:
        if r["kind"] == kind and all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def targets(records: list[dict]) -> list[tuple[str, str, str, str]]:
    """(target, measured, references, met) for each target that the records hold."""
    rows = []
    for r in records:
        if r["kind"] == "small":
            shim, hand = r["offload_shim_seconds"], r["hand_staging_seconds"]
            rows.append((f"{r['case']} {r.get('op', 'all_reduce')}, pageable: <= 0.5x hand staging",
                         f"{us(shim)} us = {shim / hand:.2f}x hand",
                         f"hand {us(hand)}, Gloo {us(r['gloo_seconds'])}, GPU-resident {us(r['gpu_resident_seconds'])} us; "
                         f"shim modes {'/'.join(r.get('shim_modes', []))}", "yes" if shim <= 0.5 * hand else "no"))
            if "bare_graph_seconds" in r:
                bare = r["bare_graph_seconds"]
                lean = r.get("lean_graph_seconds")
                rows.append((f"{r['case']} {r.get('op', 'all_reduce')}, pageable: <= 1.15x the bare graph",
                             f"{us(shim)} us = {shim / bare:.2f}x the bare graph", f"bare graph {us(bare)} us"
                             + ("" if lean is None else f"; the same graph with the shim's copies and wait "
                                f"{us(lean)} us (the shim {us(shim - lean)} us beyond it)"),
                             "yes" if shim <= 1.15 * bare else "no"))
    for r in records:
        if r["kind"] == "served":
            paired = r.get("paired_added_beyond_wrapt_cpu_seconds")
            if paired is not None:  # each round's on - wrapt, the median over rounds
                rows.append((f"served path, {r['case']}: <= 0.5 us CPU beyond a wrapt pass-through",
                             f"{us(paired)} us (median over " + (f"{r['turns']} turns of the difference in a turn)"
                                                                 if "turns" in r else  # (paired blocks, before)
                                                                 f"{r['rounds']} rounds' differences)"),
                             f"{us(r['median_shim_on_cpu_seconds'])} on, {us(r['median_shim_off_cpu_seconds'])} off, "
                             f"{us(r['median_wrapt_cpu_seconds'])} wrapt (medians per call); a wrapt pass-through adds "
                             f"{us(r['paired_wrapt_pass_through_added_cpu_seconds'])}"
                             + ("" if "paired_second_pass_through_beyond_wrapt_cpu_seconds" not in r else
                                f"; a second pass-through beyond the first (the method's own spread) "
                                f"{us(r['paired_second_pass_through_beyond_wrapt_cpu_seconds'])}"),
                             "yes" if paired <= 0.5e-6 else "no"))
            else:  # a run from before the paired rounds
                added = r.get("added_beyond_wrapt_cpu_seconds")
                if added is None:  # a run from before the wrapt reference was a route of its own
                    added = r["added_cpu_seconds"] - r["wrapt_pass_through_added_cpu_seconds"]
                median = r.get("median_added_beyond_wrapt_cpu_seconds")
                rows.append((f"served path, {r['case']}: <= 0.5 us CPU beyond a wrapt pass-through", f"{us(added)} us"
                             + ("" if median is None else f" (median {us(median)})"),
                             f"{us(r['shim_on_cpu_seconds'])} on, {us(r['shim_off_cpu_seconds'])} off (min per call); "
                             f"a wrapt pass-through wrapper adds {us(r['wrapt_pass_through_added_cpu_seconds'])}",
                             "yes" if added <= 0.5e-6 else "no"))
            floor = r.get("paired_floor_beyond_wrapt_cpu_seconds")
            if floor is not None:
                rows.append((f"served path, {r['case']}: beyond the floor (the reads any decision makes)",
                             f"{us(r['paired_added_beyond_floor_cpu_seconds'])} us",
                             f"the floor {us(floor)} beyond a wrapt pass-through", "-"))
                rows.append((f"served path, {r['case']}: the shim's wrapper made beside the references, <= 0.5 us CPU "
                             "beyond a wrapt pass-through", f"{us(r['paired_made_here_beyond_wrapt_cpu_seconds'])} us",
                             f"{us(r['paired_made_here_beyond_floor_cpu_seconds'])} us beyond the floor",
                             "yes" if r["paired_made_here_beyond_wrapt_cpu_seconds"] <= 0.5e-6 else "no"))
            decision = r.get("decision_beyond_pass_through_cpu_seconds")
            if decision is not None:
                rows.append((f"served path, {r['case']}: the decision alone <= 0.5 us beyond a pass-through wrapper",
                             f"{us(decision)} us (median {us(r['median_decision_beyond_pass_through_cpu_seconds'])})",
                             "both around a function that does nothing", "yes" if decision <= 0.5e-6 else "no"))
    r = _first(records, "pageable")
    if r:
        shim, floor, limit = r["offload_shim_bounce_seconds"], r["floor_seconds"], r["pageable_limit_seconds"]
        rows.append((f"pageable all_reduce {human(r['bytes'])}, as a storage's first call (not registered): <= 1.1x "
                     "the pageable limit", f"{ms(shim)} ms = {shim / limit:.2f}x limit, {shim / floor:.2f}x floor",
                     f"floor {ms(floor)}, limit {ms(limit)}, driver path {ms(r['offload_shim_driver_seconds'])}, pinned "
                     f"{ms(r['offload_shim_pinned_seconds'])}, hand {ms(r['hand_staging_seconds'])} ms",
                     "yes" if shim <= 1.1 * limit else "no"))
        if "offload_shim_registered_seconds" in r:
            registered, pinned = r["offload_shim_registered_seconds"], r["offload_shim_pinned_beside_registered_seconds"]
            rows.append((f"pageable all_reduce {human(r['bytes'])} reused, default settings: <= 1.05x pinned",
                         f"{ms(registered)} ms = {registered / pinned:.2f}x pinned",
                         f"pinned {ms(pinned)} ms; registered: {r.get('registered_is_pinned')}",
                         "yes" if registered <= 1.05 * pinned else "no"))
        rows.append(("pageable async_op=True returns before the copies are done",
                     f"returns in {ms(r['async_returned_seconds'])} ms", f"done in {ms(r['async_done_seconds'])} ms",
                     "yes" if r["async_returned_seconds"] < r["async_done_seconds"] else "no"))
    for r in records:
        if r["kind"] == "async":
            sync, returned, completed = r["sync_seconds"], r["async_returned_seconds"], r["async_completed_seconds"]
            staging = r["sync_input_seconds"]
            memory = "pinned" if r["pinned"] else "pageable"
            references = (f"the sync call {ms(sync)} ms, its input staged at {ms(staging)} ms; a sync broadcast from "
                          f"this rank alone {ms(r['input_staging_broadcast_seconds'])} ms")
            if r["pinned"]:
                rows.append((f"async all_reduce {human(r['bytes'])}, pinned: returns in <= 1 ms", f"{ms(returned)} ms",
                             references, "yes" if returned <= 1e-3 else "no"))
            else:
                rows.append((f"async all_reduce {human(r['bytes'])}, pageable: returns no later than the sync call has "
                             f"its input staged", f"{ms(returned)} ms = {returned / staging:.2f}x", references,
                             "yes" if returned <= staging else "no"))
            rows.append((f"async all_reduce {human(r['bytes'])}, {memory}: completes in <= 1.1x the sync call",
                         f"{ms(completed)} ms = {completed / sync:.2f}x", references,
                         "yes" if completed <= 1.1 * sync else "no"))
    r = _first(records, "full_tensor", shards="even")
    if r:
        rows.append((f"full_tensor {human(r['bytes'])}: <= 12 ms, peak extra <= 4 chunks",
                     f"{ms(r['offload_shim_seconds'])} ms, {r['peak_extra_chunks']:.2f} chunks",
                     f"floor {ms(r['floor_seconds'])}, Gloo {ms(r['gloo_seconds'])} ({r['gloo_seconds'] / r['offload_shim_seconds']:.0f}x), "
                     f"hand {ms(r['hand_staging_seconds'])} ms",
                     "yes" if r["offload_shim_seconds"] <= 12e-3 and r["peak_extra_chunks"] <= 4 else "no"))
    r = _first(records, "full_tensor", shards="uneven")
    if r:
        rows.append((f"full_tensor, uneven shards {r['shape']}", f"{ms(r['offload_shim_seconds'])} ms, "
                     f"{r['peak_extra_chunks']:.2f} chunks", f"hand {ms(r['hand_staging_seconds'])} ms", "works"))
    r = _first(records, "weight_sync")
    if r:
        ratio = r["gloo_seconds"] / r["offload_shim_seconds"]
        rows.append((f"weight sync, {human(r['bytes'])} bf16 model: >= 35x Gloo", f"{ms(r['offload_shim_seconds'])} ms, {ratio:.1f}x",
                     f"Gloo {ms(r['gloo_seconds'])} ms; {r['offload_shim_seconds'] / r['copy_once_each_way_seconds']:.2f}x the "
                     f"model's bytes copied once each way ({ms(r['copy_once_each_way_seconds'])} ms)", "yes" if ratio >= 35 else "no"))
    for r in records:
        if r["kind"] == "duplex":
            ratio = r["offload_shim_seconds"] / r["duplex_seconds"]
            rows.append((f"pinned all_reduce {human(r['bytes'])}: <= 1.05x duplex limit", f"{ms(r['offload_shim_seconds'])} ms, "
                         f"{ratio:.3f}x duplex", f"duplex {ms(r['duplex_seconds'])} ms, {r['offload_shim_seconds'] / r['floor_seconds']:.2f}x "
                         f"one direction (floor {ms(r['floor_seconds'])} ms)", "yes" if ratio <= 1.05 else "no"))
    return rows


def table(meta: dict, records: list[dict]) -> str:
    lines = [f"torch {meta['torch']}, NCCL {meta['nccl']}, {meta['world_size']} x {meta['device']}; commit "
             f"{meta.get('commit')}; chunk {human(meta['chunk_bytes_default'])}, pageable path "
             f"{meta['pageable_path_default']}, {meta.get('copy_threads')} copy threads; each route's minimum over rounds"]
    r = _first(records, "copy_limits")
    if r:
        lines.append(f"copies of {human(r['bytes'])}, both ranks at once: H2D {r['h2d_GBps']:.1f} GB/s, D2H {r['d2h_GBps']:.1f} GB/s, "
                     f"both directions at once {ms(r['duplex_seconds'])} ms, threaded host copies in and out "
                     f"{ms(r['host_copies_seconds'])} ms, both beside the DMA {ms(r['pageable_limit_seconds'])} ms")
        if "host_traffic_duplex_GBps" in r:
            lines.append(f"host memory traffic (bytes read + written): DMA both directions {r['host_traffic_duplex_GBps']:.0f} GB/s, "
                         f"threaded host copy {r['host_traffic_copy_GBps']:.0f} GB/s, copies in and out at once "
                         f"{r['host_traffic_copies_GBps']:.0f} GB/s, copies beside the DMA (the pageable limit) "
                         f"{r['host_traffic_pageable_limit_GBps']:.0f} GB/s")
    lines += ["", "| target | measured | references (same run) | met |", "| --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(row)} |" for row in targets(records)]
    lines += ["", "| op | host memory | size | floor | Gloo | hand staging | offload_shim | GPU-resident NCCL | shim / floor | Gloo / shim |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        if r["kind"] == "collective":
            lines.append(
                f"| {r['op']} | {'pinned' if r['pinned'] else 'pageable'} | {human(r['bytes'])} | {ms(r['floor_seconds'])} | "
                + " | ".join(ms(r[f"{m}_seconds"]) for m in ROUTES)
                + f" | {r['offload_shim_seconds'] / r['floor_seconds']:.2f} | {r['gloo_seconds'] / r['offload_shim_seconds']:.1f} |"
            )
    lines.append("")
    for r in records:
        if r["kind"] == "full_tensor":
            lines.append(f"full_tensor ({r['shards']} shards, {human(r['bytes'])}), ms: " + ", ".join(
                f"{k[:-8]} {ms(v)}" for k, v in r.items() if k.endswith("_seconds")))
        if r["kind"] == "peak_memory":
            lines.append(f"peak extra accelerator memory, all_reduce of {human(r['bytes'])}: {human(r['peak_extra_bytes'])} "
                         f"= {r['peak_extra_chunks']:.2f} chunks")
        if r["kind"] == "routing":
            lines.append(f"routing, all_reduce {human(r['bytes'])} pageable on the Gloo group: Gloo {ms(r['gloo_seconds'])}, "
                         f"through NCCL {ms(r['routed_seconds'])} ms")
        if r["kind"] == "chunk_sweep":
            lines.append(f"chunk {human(r['chunk_bytes'])}: all_reduce {human(r['bytes'])} over floor, pinned "
                         f"{r['pinned_over_floor']:.2f}, pageable {r['pageable_over_floor']:.2f}")
    return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(op, pinned) for op in ("all_reduce", "broadcast") for pinned in (True, False)]
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5 * (len(panels) + 1), 4.2))
    for ax, (op, pinned) in zip(axes, panels):
        rows = sorted((r for r in records if r["kind"] == "collective" and r["op"] == op and r["pinned"] == pinned),
                      key=lambda r: r["bytes"])
        sizes = [r["bytes"] for r in rows]
        for route in ROUTES:
            ax.loglog(sizes, [r[f"{route}_seconds"] * 1e3 for r in rows], marker="o", label=route)
        ax.loglog(sizes, [r["floor_seconds"] * 1e3 for r in rows], "k--", label="floor (pinned H2D)")
        ax.set_title(f"{op}, fp32, {'pinned' if pinned else 'pageable'} CPU tensor")
        ax.set_xlabel("bytes")
        ax.set_ylabel("ms (minimum)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    small = [r for r in records if r["kind"] == "small"]
    ax = axes[-1]
    width = 0.2
    for i, route in enumerate(ROUTES):
        key = "hand_staging" if route == "hand_staging" else route
        ax.bar([j + i * width for j in range(len(small))], [r[f"{key}_seconds"] * 1e6 for r in small], width, label=route)
    ax.set_xticks([j + 1.5 * width for j in range(len(small))], [r["case"] for r in small], fontsize=8)
    ax.set_ylabel("us per call (minimum)")
    ax.set_title("small all_reduces, pageable CPU tensor")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    data = json.load(open(sys.argv[1]))
    print(table(data["meta"], data["records"]))
    if len(sys.argv) > 2:
        plot(data["records"], sys.argv[2])
