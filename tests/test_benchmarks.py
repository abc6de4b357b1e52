"""The CPU benchmark runs and reports its ratio (a benchmark, not a test with a threshold: this only checks
that it keeps working)."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_wrapper_cost_benchmark_reports_a_ratio(tmp_path):
    out = tmp_path / "wrapper.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_wrapper_cpu.py"), "--calls", "50", "--rounds", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["shim_on_us_per_call"] > 0 and report["shim_off_us_per_call"] > 0
    assert report["ratio_on_over_off"] == pytest.approx(report["shim_on_us_per_call"] / report["shim_off_us_per_call"], rel=1e-12)
    assert "ratio" in result.stdout
