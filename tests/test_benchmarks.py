"""The CPU benchmark runs and reports its figures (a benchmark, not a test with a threshold: this only checks
that it keeps working)."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_served_path_benchmark_reports_each_case(tmp_path):
    out = tmp_path / "served.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_wrapper_cpu.py"), "--calls", "50", "--rounds", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    ops = {"all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor"}
    assert set(report["cases"]) == ops | {"all_reduce, CPU tensor, two-backend group"}
    for case in report["cases"].values():
        assert case["shim_on_cpu_us_per_call"] > 0 and case["shim_off_cpu_us_per_call"] > 0
        assert abs(case["added_cpu_us_per_call"] - (case["shim_on_cpu_us_per_call"] - case["shim_off_cpu_us_per_call"])) < 1e-9
        assert abs(case["added_cpu_us_per_call"] - case["wrapt_alone_added_cpu_us_per_call"]
                   - case["shim_beyond_wrapt_cpu_us_per_call"]) < 1e-9
        assert case["in_turn_calls"] == 50 * 2 // 3  # every turn timed once the warm-up is over
        assert all(isinstance(case[f"in_turn_{what}_cpu_us_per_call"], float) for what in (
            "shim_beyond_wrapt", "shim_beyond_torch", "wrapt_beyond_torch", "second_pass_through_beyond_wrapt"))
    assert result.stdout.count("added") == 5 and result.stdout.count("in turn") == 5
    assert report["counting_cpu_us_per_staged_call"] > 0 and "counting a staged call" in result.stdout
    decisions = report["accelerator_decision_beyond_wrapt_cpu_us_per_call"]
    assert sorted(decisions) == sorted(f"{name}, accelerator tensors (meta)" for name in ops), decisions
    assert all(isinstance(value, float) for value in decisions.values()) and result.stdout.count("(meta)") == 4


def test_cold_cache_probe_reports_each_case_and_size(tmp_path):
    out = tmp_path / "cold.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "probe_served_cold_cache.py"), "--turns", "50", "--thrash", "0,8",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(out.read_text())["figures"]
    assert [(f["case"], f["thrash_kib"], f["turns"]) for f in figures] == [
        (case, kib, 50) for case in ("all_reduce, CPU tensor, two-backend group", "reduce_scatter_tensor, meta tensors")
        for kib in (0, 8)]
    assert all(f["call_us"] > 0 and isinstance(f["shim_beyond_pass_through_us"], float)
               and isinstance(f["floor_beyond_pass_through_us"], float)
               and isinstance(f["made_here_beyond_pass_through_us"], float) for f in figures), figures
    assert result.stdout.count("beyond a pass-through") == 4


def test_host_decision_probe_reports_each_side():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "probe_served_host_decision.py"), "--blocks", "2", "--calls", "50"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "ns beyond the floor" in result.stdout and "'floor': 0.0" in result.stdout, result.stdout
    assert "'shim':" in result.stdout and "'pass_through':" in result.stdout, result.stdout
