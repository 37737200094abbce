"""The scheduler_overhead benchmark runs and writes its record (tiny settings; no timing asserted)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_scheduler_overhead_benchmark_smoke(tmp_path):
    out = tmp_path / "so.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scheduler_overhead.py"), "--num-requests", "8",
                          "--steps", "5", "--warmup-steps", "3", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("\n") == 1 and "8 running" in res.stdout
    record = json.loads(out.read_text())
    assert record["num_running"] == 8 and record["steps"] == 5 and record["cpu_mean_ms"] >= 0
