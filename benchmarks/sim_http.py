"""The host path on the simulated Galaxy, through HTTP: how much TTFT and TPOT add to the device's
own prefill and decode step, at c=1 and c=32.

`ttserve up --backend sim --sim-profile galaxy-llama-3.3-70b` (the device's step times are the
profile's: a traced prefill of 128 tokens 53 ms, a decode step 1/72.5 s), driven by the openai
client with streamed completions of 128-token prompts (token ids: no chat template). Reported:
  - ttft_overhead_ms: client TTFT p50 - the profile's prefill of the padded prompt, split into the
    control plane's TTFT (arrival at the control plane to first token published, its histogram)
    minus the prefill, and the rest (HTTP, the gateway's frontend and its hop to the control plane);
  - tpot_ratio: the profile's decode step / client TPOT p50 (1.0: every step reaches the client
    at the device's pace), at c=1 and c=32 (c=32: its requests arrive together, so their TPOT
    includes the prefill steps of the others that follow their first token: a step is prefill or
    decode, never both, on a TT device as in the TT plugin);
  - itl_ratio: the profile's decode step / the median gap between consecutive tokens over every
    stream (the decode steps' pace through the host path, the prefill steps aside);
  - at c=1, server_overhead_ms: the same TTFT from a client that costs nothing (a raw socket:
    from the request's bytes written to the first token's event read) minus the prefill, and
    client_overhead_ms: what the openai client itself adds (building the request, parsing the
    stream: ~3-6 ms on a 2-core machine, more than the host path's goal).
Twice: with the TT plugin's default of sampling on the host (every decode step waits for the
round trip through the control plane: no async decode) and with tt.sample_on_device_mode
decode_only, under which decode steps are pipelined.

    python benchmarks/sim_http.py [--requests 16] [--quick]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import socket
import statistics
import sys
import time
import urllib.request

import openai
from control_stack import free_port
from vs_vllm import Server

PROFILE = "galaxy-llama-3.3-70b"
PROMPT_LEN = 128
RAW_SEEDS = 10_000  # the raw client's prompts: none the openai client sent


def prompt(seed: int) -> list[int]:
    """PROMPT_LEN token ids of its own for each seed (no prefix shared: a prefix-cache hit would
    change the host's work, not the sim's prefill time)."""
    return [1000 + (seed * 7 + i) % 30000 for i in range(PROMPT_LEN)]


def stream_one(client: openai.OpenAI, name: str, seed: int, max_tokens: int) -> tuple[float, float, list[float]]:
    """(TTFT, TPOT, the gaps between consecutive tokens) in seconds of one streamed completion."""
    started = time.perf_counter()
    arrivals = []
    for chunk in client.completions.create(model=name, prompt=prompt(seed), max_tokens=max_tokens, stream=True,
                                           extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text is not None:
            arrivals.append(time.perf_counter())
    assert len(arrivals) > 1
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return arrivals[0] - started, (arrivals[-1] - arrivals[0]) / len(gaps), gaps


def raw_ttft(port: int, name: str, seed: int, max_tokens: int) -> float:
    """TTFT in seconds of stream_one's completion sent as bytes on a fresh TCP connection: from
    the request written (after the connect, which the server's accept then follows: counted in
    the server's share) to the first event with text read, no HTTP library on the client."""
    body = json.dumps({"model": name, "prompt": prompt(seed), "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)) + body
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        started = time.perf_counter()
        sock.sendall(request)
        received, first = b"", None
        while chunk := sock.recv(65536):
            received += chunk
            if first is None and b'"text"' in received:
                first = time.perf_counter()
    assert first is not None and b" 200 OK" in received.split(b"\r\n", 1)[0], received[:300]
    return first - started


def control_ttft_mean(metrics_port: int, before: tuple[float, float]) -> tuple[float, tuple[float, float]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    total = float(re.search(r"^ttserve_time_to_first_token_seconds_sum ([0-9.e+-]+)$", text, re.M).group(1))
    count = float(re.search(r"^ttserve_time_to_first_token_seconds_count ([0-9.e+-]+)$", text, re.M).group(1))
    return (total - before[0]) / max(count - before[1], 1), (total, count)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="CI: 4 requests, 16 tokens")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.max_tokens = 4, 16
    from ttserve.worker.backends.sim.model import PROFILES
    from ttserve.worker.planning.model_prepare import resolve_model

    profile = PROFILES[PROFILE]
    model = resolve_model("smollm2")
    report: dict = {"profile": PROFILE, "prefill_ms": round(profile.prefill_s(profile.bucket(PROMPT_LEN)) * 1e3, 2),
                    "decode_step_ms": round(profile.decode_step_s * 1e3, 2)}
    for label, extra in (("host_sampling", []),
                         ("device_sampling", ["--additional-config.tt.sample_on_device_mode", "decode_only"])):
        report[label] = measure(model, profile, extra, args.requests, args.max_tokens)
    print(json.dumps(report))
    return 0


def measure(model, profile, extra: list[str], requests: int, max_tokens: int) -> dict:
    port, metrics = free_port(), free_port()
    argv = [sys.executable, "-m", "ttserve.cli", "up", "--port", str(port), "--control-port", str(free_port()),
            "--worker-port", str(free_port()), "--control-metrics-port", str(metrics),
            "--worker-metrics-port", str(free_port()), "--model", str(model), "--backend", "sim",
            "--sim-profile", PROFILE, "--max-num-seqs", "32", *extra]
    server = Server("ttserve-sim", argv, port)
    server.start(model.name, 600)
    prefill_ms = profile.prefill_s(profile.bucket(PROMPT_LEN)) * 1e3
    report: dict = {}
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        stream_one(client, model.name, 0, 4)  # warm
        _, counted = control_ttft_mean(metrics, (0.0, 0.0))
        for c in (1, 32):
            n = requests if c == 1 else max(requests, c)
            with concurrent.futures.ThreadPoolExecutor(c) as pool:
                runs = list(pool.map(lambda i: stream_one(client, model.name, i, max_tokens), range(n)))
            control_ttft, counted = control_ttft_mean(metrics, counted)
            ttft = statistics.median(r[0] for r in runs)
            tpot = statistics.median(r[1] for r in runs)
            itl = statistics.median(gap for r in runs for gap in r[2])
            level = {"ttft_p50_ms": round(ttft * 1e3, 2), "tpot_p50_ms": round(tpot * 1e3, 2),
                     "tpot_ratio": round(profile.decode_step_s / tpot, 3),
                     "itl_p50_ms": round(itl * 1e3, 2), "itl_ratio": round(profile.decode_step_s / itl, 3)}
            if c == 1:
                raw = statistics.median(raw_ttft(port, model.name, RAW_SEEDS + i, max_tokens) for i in range(n))
                _, counted = control_ttft_mean(metrics, counted)  # the raw requests' own
                level.update({"ttft_overhead_ms": round(ttft * 1e3 - prefill_ms, 2),
                              "of_which_control_and_worker_ms": round(control_ttft * 1e3 - prefill_ms, 2),
                              "of_which_http_and_gateway_ms": round((ttft - control_ttft) * 1e3, 2),
                              "server_overhead_ms": round(raw * 1e3 - prefill_ms, 2),
                              "client_overhead_ms": round((ttft - raw) * 1e3, 2)})
            report[f"c{c}"] = level
    finally:
        server.stop()
    return report


if __name__ == "__main__":
    sys.exit(main())
