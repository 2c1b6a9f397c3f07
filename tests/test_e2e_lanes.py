"""Lanes through real processes: a 4-lane group in one worker and two independent workers under
one control plane give exactly a 1-lane run's greedy outputs, whichever lane serves them; load
spreads across lanes and a request stays on its lane."""
from __future__ import annotations

import re
import urllib.request

from collections import Counter

import pytest

from stack import start_stack
from ttserve.control_client import ControlClient

pytestmark = pytest.mark.e2e

# float32: "exactly the same greedy outputs" across topologies needs batch-invariant arithmetic.
# In bf16 (the CPU default) a row's logits round differently with the batch it shares a GEMM
# with (oneDNN blocks by batch size), so greedy outputs may part at near-ties, as in vLLM.
KV = ("--kv-cache-memory-bytes", str(256 << 20), "--dtype", "float32")
PROMPTS = [[1, 9690, 314, 253 + i, 2185, 282, 3000 + 7 * i] for i in range(8)]


def run(address: str, prompts: list[list[int]]) -> dict:
    client = ControlClient(address)
    try:
        for i, prompt in enumerate(prompts):
            client.add(f"r{i}", prompt, 16, ignore_eos=True)
        return client.collect({f"r{i}" for i in range(len(prompts))})
    finally:
        client.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, smollm2) -> dict:
    stack = start_stack(tmp_path_factory.mktemp("one-lane"), str(smollm2), gateway=False, worker_flags=KV)
    try:
        return {rid: r.token_ids for rid, r in run(stack.control_address, PROMPTS).items()}
    finally:
        stack.stop()


def test_four_lane_group_matches_one_lane_and_spreads_load(tmp_path, smollm2, reference):
    stack = start_stack(tmp_path, str(smollm2), gateway=False, worker_flags=KV,
                        control_flags=("--data-parallel-size", "4", "--max-num-seqs", "2"))
    try:
        client = ControlClient(stack.control_address)
        assert client.model_info().num_lanes == 4
        assert client.server_info().workers[0].num_lanes == 4
        client.close()
        results = run(stack.control_address, PROMPTS)
        assert "runs 4 lane(s) x 2 seqs in one process" in stack.services[1].output()
    finally:
        stack.stop()
    assert {rid: r.token_ids for rid, r in results.items()} == reference
    assert all(len(r.placements) == 1 for r in results.values()), "a request moved lanes"
    per_lane = Counter(next(iter(r.placements)) for r in results.values())
    assert per_lane == {(0, 0): 2, (0, 1): 2, (0, 2): 2, (0, 3): 2}


def test_two_independent_workers_match_one_lane(tmp_path, smollm2, reference):
    stack = start_stack(tmp_path, str(smollm2), gateway=False, worker_flags=KV, workers=2,
                        control_flags=("--max-num-seqs", "4"))
    try:
        client = ControlClient(stack.control_address)
        info = client.server_info()
        assert [w.ready for w in info.workers] == [True, True]
        assert client.model_info().num_lanes == 2
        client.close()
        results = run(stack.control_address, PROMPTS)
        steps = [w.num_steps for w in ControlClient(stack.control_address).server_info().workers]
    finally:
        stack.stop()
    assert {rid: r.token_ids for rid, r in results.items()} == reference
    workers = Counter(next(iter(r.placements))[0] for r in results.values())
    assert workers == {0: 4, 1: 4} and all(s > 0 for s in steps)


def test_async_decode_with_device_sampling_matches_one_lane(tmp_path, smollm2, reference):
    stack = start_stack(tmp_path, str(smollm2), gateway=False,
                        worker_flags=(*KV, "--additional-config", '{"tt": {"sample_on_device_mode": "all"}}'),
                        control_flags=("--data-parallel-size", "2", "--max-num-seqs", "4"))
    try:
        results = run(stack.control_address, PROMPTS)
        log = stack.services[1].output()
        # A request the host samples (logprobs) is never pipelined: no empty flush step per
        # decode, no drain counted for it.
        counts = lambda: {(m.group(1), m.group(2)): float(m.group(3)) for m in re.finditer(
            r'ttserve_(steps|async_drains)_total\{[^}]*?(?:kind|reason)="(\w+)"[^}]*\} (\S+)',
            urllib.request.urlopen(f"{stack.control_metrics_url}/metrics").read().decode())}
        before = counts()
        client = ControlClient(stack.control_address)
        client.add("host-sampled", [1, 504, 3458, 282], 12, logprobs=1, ignore_eos=True)
        assert len(client.collect({"host-sampled"})["host-sampled"].token_ids) == 12
        client.close()
        after = counts()
    finally:
        stack.stop()
    assert "async decode on" in log
    assert {rid: r.token_ids for rid, r in results.items()} == reference
    grew = {key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)}
    assert (grew[("steps", "prefill")], grew[("steps", "decode")]) == (1, 11), grew
    assert not [key for key in grew if key[0] == "async_drains"], grew
