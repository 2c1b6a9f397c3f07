"""The soak's one-minute version (benchmarks/soak.py --quick): mixed load with aborts and dropped
sessions while the sole worker is SIGKILLed and restarted every 15 s; nothing lost, nothing
leaked, and no failure without a reason."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def test_a_minute_of_load_through_worker_kills_loses_and_leaks_nothing():
    done = subprocess.run([sys.executable, "soak.py", "--quick"], cwd=BENCHMARKS, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["worker_kills"] >= 2 and report["completed"] > 0, report
    assert (report["lost"], report["leaked_kv_blocks"], report["left_running"]) == (0, 0, 0), report
    assert all(reason for reason in report["failure_reasons"]), report
