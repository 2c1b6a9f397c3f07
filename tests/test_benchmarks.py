"""Benchmarks must not rot: each one in benchmarks/ runs in its --quick mode, completes and
prints the ratios it exists to report. Nothing here bounds a wall-clock time or a ratio's value
(a shared CI machine's load would make that a coin toss); a crash, a missing figure or a
non-finite ratio fails."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

# benchmark -> what its output must contain (regexes); ratios must be finite numbers.
EXPECTED = {
    "scheduler_cost.py": [r'"ratio": [0-9.]+', r'"ratio_with_step_proto": [0-9.]+'],
    "phase_policy.py": [r'"worst_itl_ratio": [0-9.]+', r'"burst_ttft_ratio": [0-9.]+'],
    "metrics_cost.py": [r'"ttserve_over_baseline": [0-9.]+', r'"naive_over_baseline": [0-9.]+',
                        r'"tracing_off_over_baseline": [0-9.]+', r'"tracing_off_ns_per_request": -?[0-9.]+'],
    "sim_decode.py": [r'"ratio_to_limit": [0-9.]+'],
    "lanes.py": [r'"ratio_vs_1_lane": [0-9.]+'],
    "throughput.py": [r'"ratio_single_vs_transformers": [0-9.]+', r'"ratio_concurrent_vs_single": [0-9.]+'],
    "differential.py": [r'"agree_ratio": [0-9.]+'],
    # The soak exits 1 on anything lost or leaked; its report says so too.
    "soak.py": [r'"worker_kills": [1-9]', r'"completed": [1-9]', r'"lost": 0,', r'"leaked_kv_blocks": 0,'],
    # Exits 1 on a failed or migrated step, a step message past 64 MiB, or no held-bytes refusal.
    "payload_memory.py": [r"\| largest step message, MiB\s+\| [0-9.]+", r"\| step failures\s+\| 0\s+\| 0\s+\|",
                          r"\| refused\s+\| 0\s+\| [1-9]"],
    # Exits 1 when a request's tokens differ with speculation.
    "spec_decode.py": [r'"copy_speedup_ratio": [0-9.]+', r'"open_speedup_ratio": [0-9.]+',
                       r'"random_speedup_ratio": [0-9.]+', r'"identical_tokens": true',
                       r'"acceptance_per_position": \[\s*[0-9.]'],
    "cuda_graph_decode.py": [r'"skipped": "no CUDA device here"|"graph_speedup": [0-9.]+'],
    "weight_bound.py": [r'"bound_ms": [0-9.]+', r'"gb_per_s": [0-9.]+', r'"step_over_bound": [0-9.]+|"skipped"'],
    # A CPU without AVX512-BF16 cannot run ttserve's GEMM: the benchmark says so.
    "gemm.py": [r'"onednn_over_ttserve": [0-9.]+|"skipped": "'],
    "decode_attention.py": [r'"kernel_ratio": [0-9.]+', r'"step_ratio": [0-9.]+'],
    # A CPU without AVX512-BF16 cannot run ttserve's prefill kernel: the benchmark says so.
    "prefill_attention.py": [r'"kernel_ratio": [0-9.]+|"skipped": "', r'"step_ratio": [0-9.]+|"skipped": "'],
    "sampling.py": [r'"vllm_over_ttserve": [0-9.]+|"skipped": "'],
    "sim_http.py": [r'"ttft_overhead_ms": -?[0-9.]+', r'"server_overhead_ms": -?[0-9.]+', r'"tpot_ratio": [0-9.]+',
                    r'"itl_ratio": [0-9.]+'],
    "vs_vllm.py": [r"\| 1 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|", r"\| 4 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|",
                   r"c=1 TPOT p50 / bound: vLLM [0-9.]+, ttserve [0-9.]+", r"round 1 ratios ttserve / vLLM",
                   r"ratio start-up ttserve / vLLM: [0-9.]+", r"ttserve: start-up to serving [0-9.]+ s",
                   r"CPU ms per output token: ttserve\.worker [0-9.]+"],
}


def test_every_benchmark_has_a_quick_check():
    scripts = {p.name for p in BENCHMARKS.glob("*.py")}
    helpers = {"control_stack.py", "vllm_cli.py"}  # imported or run by the benchmarks
    assert scripts - helpers == set(EXPECTED), "a benchmark without a quick check (or a stale entry)"


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_benchmark_quick_mode_completes_and_prints_its_ratios(script):
    # The gateway modules this session imported set VLLM_CPU_KVCACHE_SPACE=0 for a frontend that
    # holds no KV (gateway/vllm_compat.py); a vLLM server started from here must not inherit it.
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--quick"], capture_output=True,
                          text=True, cwd=BENCHMARKS.parent, timeout=1200, env=env)
    assert done.returncode == 0, f"{script} --quick failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    for pattern in EXPECTED[script]:
        assert re.search(pattern, done.stdout), f"{script} printed no {pattern!r}:\n{done.stdout[-3000:]}"
    for value in re.findall(r'"[a-z_]*ratio[a-z_]*": ([^,}\n]+)', done.stdout):
        assert math.isfinite(float(value)), f"{script}: a ratio is {value}"
    if script == "differential.py":
        assert "error" not in json.loads(done.stdout), done.stdout[-3000:]
