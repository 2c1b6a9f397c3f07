"""ttserve against vLLM CPU on the same prepared model folder and machine, one server at a time.

Each round starts one server, waits until it answers a completion (its start-up time, warmup
included), drives it with `vllm bench serve` (random 128-token prompts, 64 output tokens,
--ignore-eos) at each concurrency, records the RSS of every process of the server, stops it,
then does the same for the other. Rounds alternate which server goes first. Both servers get
the same KV budget, the same dtype and the whole machine: vLLM with VLLM_CPU_OMP_THREADS_BIND
over every core this process may use (docs/vllm-cpu.md), ttserve as `ttserve up`.

Prints output tok/s, TTFT p50 and TPOT p50 of both and the ratios ttserve / vLLM (tok/s: higher
is better for ttserve; TTFT, TPOT: lower is), each round's ratios as well as the medians, the CPU
time each process of a server, and the load's client, spent per output token at each concurrency
(on a machine of few cores, every process's time is time the model's threads wait for: a figure
that, unlike tok/s, moves little with the machine's memory bandwidth), ttserve's c=1 CPU floor
(its decode step in process plus every other process's CPU time per token spread over the cores:
no TPOT on this machine goes below it while the step holds every core),
start-up seconds, and per-process RSS at ready and after the load (and the processes' PSS
together, which counts a page they share once). The KV cache is allocated
zeroed (resident) by both; "non-KV" subtracts it. Each round also times the weight-read bound
of one decode step on this machine (weight_bound.py: a bf16 GEMV over the model's own weight
shapes, with nothing else running) and prints both servers' c=1 TPOT as a multiple of it, so
that machines of other memory bandwidth compare.

    python benchmarks/vs_vllm.py [--concurrency 1 8 32] [--rounds 1] [--dtype bfloat16]
    python benchmarks/vs_vllm.py --quick     # CI: tiny load, 256 MiB KV caches, vLLM --enforce-eager
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil
from control_stack import free_port

HERE = Path(__file__).resolve().parent
INPUT_LEN, OUTPUT_LEN = 128, 64
KV_BYTES = 1 << 30
# --quick: 8,192 tokens (SmolLM2-135M's max model length, which vLLM's cache must hold) take
# 180 MiB in bfloat16, and the quick load needs under 600. vLLM writes its whole cache at start-up
# (resident: its RSS at ready is 0.75 GiB lower with this), ~0.6 CPU-s of page faults per GiB.
QUICK_KV_BYTES = 256 << 20
GIB = float(1 << 30)
CLIENT = "vllm bench serve (client)"


@dataclass
class Server:
    """One server under test: its command line, and what was measured of it."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    def start(self, model_name: str, timeout: float) -> float:
        """Starts the server; returns seconds until it answered a one-token completion."""
        self.log_path = Path(tempfile.mkstemp(prefix=f"vs_vllm-{self.name}-", suffix=".log")[1])
        started = time.monotonic()
        with open(self.log_path, "wb") as log:
            # VLLM_CPU_KVCACHE_SPACE=0 (a gateway's setting: no KV) would starve vLLM's server.
            env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
            self.proc = subprocess.Popen(self.argv, env={**env, **self.env}, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        body = json.dumps({"model": model_name, "prompt": "Hello", "max_tokens": 1}).encode()
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", body,
                                                 {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=30) as response:
                    if response.status == 200:
                        return time.monotonic() - started
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"{self.name} did not serve within {timeout:.0f} s; see {self.log_path}")

    def _each_process(self, measure: Callable[[psutil.Process], float], by_pid: bool) -> dict[str, float]:
        """`measure` of the leader and every descendant still alive, by label (and pid)."""
        assert self.proc is not None
        leader = psutil.Process(self.proc.pid)
        out: dict[str, float] = {}
        for p in [leader, *leader.children(recursive=True)]:
            try:
                key = f"{_label(p)} ({p.pid})" if by_pid else _label(p)
                out[key] = out.get(key, 0.0) + measure(p)
            except psutil.NoSuchProcess:
                pass
        return out

    def rss(self) -> dict[str, float]:
        """GiB resident per process of the server (the leader and every descendant)."""
        return self._each_process(lambda p: p.memory_info().rss / GIB, by_pid=True)

    def pss(self) -> float:
        """GiB proportional set size of the server's processes together: each page shared between
        them (a library both map, libtorch above all) counted once, where RSS counts it in each."""
        return sum(self._each_process(lambda p: p.memory_full_info().pss / GIB, by_pid=True).values())

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far per process of the server."""
        return self._each_process(cpu_seconds, by_pid=False)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def cpu_seconds(p: psutil.Process) -> float:
    """CPU seconds (user + system) a process has spent so far."""
    return sum(p.cpu_times()[:2])


def _label(p: psutil.Process) -> str:
    cmd = p.cmdline()
    if "-m" in cmd and cmd.index("-m") + 1 < len(cmd):
        return cmd[cmd.index("-m") + 1]
    label = "" if len(cmd) < 2 else (Path(cmd[1]).name + (" " + cmd[2] if len(cmd) > 2 else "")).strip()
    # vLLM retitles its engine process (setproctitle: "VLLM::EngineCore", arguments blanked)
    return label or p.name()


def vllm_server(model: Path, name: str, dtype: str, eager: bool, kv_bytes: int,
                extra: list[str] | None = None) -> Server:
    cores = sorted(os.sched_getaffinity(0))
    port = free_port()
    argv = [sys.executable, str(HERE / "vllm_cli.py"), "serve", str(model), "--served-model-name", name,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--kv-cache-memory-bytes", str(kv_bytes), "--seed", "0"] + (["--enforce-eager"] if eager else []) \
        + list(extra or [])
    return Server("vllm", argv, port, env={"VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}"
                                           if cores == list(range(cores[0], cores[-1] + 1))
                                           else ",".join(map(str, cores)),
                                           "PYTHONWARNINGS": "ignore::DeprecationWarning"})


def ttserve_server(model: Path, dtype: str, kv_bytes: int, extra: list[str]) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "ttserve.cli", "up", "--port", str(port),
            "--control-port", str(free_port()), "--worker-port", str(free_port()),
            "--control-metrics-port", str(free_port()), "--worker-metrics-port", str(free_port()),
            "--model", str(model), "--dtype", dtype, "--kv-cache-memory-bytes", str(kv_bytes), *extra]
    return Server("ttserve", argv, port)


class BenchClient:
    """The `vllm bench serve` runs of this benchmark, each one the CLI's run with its arguments,
    all in one `vllm_cli.py --each` process: vLLM's import (~10 CPU-s) is paid once, not per run."""

    def __init__(self, log_dir: Path) -> None:
        self.log_path = log_dir / "vllm-bench.log"
        read_fd, write_fd = os.pipe()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(HERE / "vllm_cli.py"), "--each", str(write_fd)],
                                         stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                         pass_fds=(write_fd,), text=True,
                                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
        os.close(write_fd)
        self.replies = os.fdopen(read_fd)
        self._reply(0)  # {"ready": true}: imported before any server starts, so no start-up shares the CPU with it

    def _reply(self, log_from: int) -> dict:
        line = self.replies.readline()
        if not line:
            raise RuntimeError(f"the vllm bench client exited with {self.proc.wait()}:\n{self._tail(log_from)}")
        return json.loads(line)

    def _tail(self, log_from: int) -> str:
        with open(self.log_path, errors="replace") as log:
            log.seek(log_from)
            return log.read()[-6000:]

    def run(self, argv: list[str]) -> tuple[int, str]:
        """Runs `vllm ARGV...`; returns its exit status, and the output it wrote when non-zero."""
        log_from = self.log_path.stat().st_size
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        rc = self._reply(log_from)["rc"]
        return rc, (self._tail(log_from) if rc else "")

    def cpu_seconds(self) -> float:
        """CPU seconds so far of the client's process."""
        return cpu_seconds(psutil.Process(self.proc.pid))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the runner's loop ends on end of input
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.replies.close()


def bench(client: BenchClient, server: Server, model: Path, name: str, concurrency: int, prompts: int,
          output_len: int, result_dir: Path) -> dict:
    """One `vllm bench serve` run; returns its saved result."""
    filename = f"{server.name}-c{concurrency}-{time.monotonic_ns()}.json"
    argv = ["bench", "serve", "--backend", "vllm",
            "--base-url", f"http://127.0.0.1:{server.port}", "--model", name, "--tokenizer", str(model),
            "--dataset-name", "random", "--random-input-len", str(INPUT_LEN),
            "--random-output-len", str(output_len), "--ignore-eos", "--max-concurrency", str(concurrency),
            "--num-prompts", str(prompts), "--seed", "0", "--percentile-metrics", "ttft,tpot",
            "--metric-percentiles", "50", "--num-warmups", str(concurrency), "--disable-tqdm", "--save-result",
            "--result-dir", str(result_dir), "--result-filename", filename]
    rc, output = client.run(argv)
    if rc != 0:
        raise RuntimeError(f"vllm bench serve against {server.name} failed (exit status {rc}):\n{output}")
    result = json.loads((result_dir / filename).read_text())
    if result.get("completed") != prompts:
        raise RuntimeError(f"{server.name}: {result.get('completed')} of {prompts} requests completed")
    return result


def run_server(client: BenchClient, server: Server, model: Path, name: str, levels: list[int],
               prompts_per: dict[int, int], output_len: int, result_dir: Path, timeout: float) -> dict:
    try:
        startup = server.start(name, timeout)
        at_ready = server.rss()
        runs = {}
        for c in levels:
            before, client_before = server.cpu_seconds(), client.cpu_seconds()
            r = bench(client, server, model, name, c, prompts_per[c], output_len, result_dir)
            after, client_after = server.cpu_seconds(), client.cpu_seconds()
            # Warmups included: what every process spent per token the server generated.
            tokens = max(r["total_output_tokens"] * (prompts_per[c] + c) / prompts_per[c], 1)
            cpu = {proc: round((after[proc] - before.get(proc, 0.0)) / tokens * 1e3, 2) for proc in after}
            # The load's own client shares the cores too: with the server's processes, it makes the
            # CPU time the machine spends per token, whose share of the cores bounds TPOT from below.
            cpu[CLIENT] = round((client_after - client_before) / tokens * 1e3, 2)
            runs[c] = {"output_tok_s": r["output_throughput"], "ttft_p50_ms": r["median_ttft_ms"],
                       "tpot_p50_ms": r["median_tpot_ms"], "cpu_ms_per_token": cpu}
            print(f"  {server.name} c={c}: {runs[c]['output_tok_s']:.1f} tok/s, TTFT p50 "
                  f"{runs[c]['ttft_p50_ms']:.0f} ms, TPOT p50 {runs[c]['tpot_p50_ms']:.1f} ms; CPU ms per output "
                  f"token: {', '.join(f'{proc} {ms:g}' for proc, ms in cpu.items() if ms)}", flush=True)
        return {"startup_s": startup, "rss_ready_gib": at_ready, "rss_after_gib": server.rss(),
                "pss_after_gib": server.pss(), "runs": runs}
    finally:
        server.stop()


def weight_read_bound(model: Path, quick: bool) -> dict:
    """weight_bound.py's figures, measured in a process of its own with the machine idle, with
    ttserve's one-row decode step in process against it (--step)."""
    argv = [sys.executable, str(HERE / "weight_bound.py"), "--model", str(model), "--step"] + (["--quick"] if quick else [])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"weight_bound.py failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def round_ratios(vllm: dict, ttserve: dict, levels: list[int], bound_ms: float) -> dict:
    """One round's ratios ttserve / vLLM at each concurrency, and each c=1 TPOT / the bound."""
    out: dict = {}
    for c in levels:
        v, t = vllm["runs"][c], ttserve["runs"][c]
        out[c] = {k: round(t[k] / v[k], 3) for k in ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms")}
    if 1 in levels:
        out["tpot_c1_over_bound"] = {"vllm": round(vllm["runs"][1]["tpot_p50_ms"] / bound_ms, 3),
                                     "ttserve": round(ttserve["runs"][1]["tpot_p50_ms"] / bound_ms, 3)}
    return out


def _median(rounds: list[dict], c: int, key: str) -> float:
    return statistics.median(r["runs"][c][key] for r in rounds)


def report(results: dict[str, list[dict]], levels: list[int], kv_bytes: int) -> dict:
    v, t = results["vllm"], results["ttserve"]
    rows = []
    print("\n| concurrency | vLLM out tok/s | ttserve out tok/s | ratio | TTFT p50 ms vLLM / ttserve (ratio) "
          "| TPOT p50 ms vLLM / ttserve (ratio) |")
    print("|---|---|---|---|---|---|")
    for c in levels:
        row = {k: (_median(v, c, k), _median(t, c, k)) for k in ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms")}
        ratios = {k: b / a for k, (a, b) in row.items()}
        rows.append({"concurrency": c, **{k: {"vllm": a, "ttserve": b, "ratio": ratios[k]}
                                          for k, (a, b) in row.items()}})
        (tv, tt), (fv, ft), (pv, pt) = row["output_tok_s"], row["ttft_p50_ms"], row["tpot_p50_ms"]
        print(f"| {c} | {tv:.1f} | {tt:.1f} | {ratios['output_tok_s']:.2f} | {fv:.0f} / {ft:.0f} "
              f"({ratios['ttft_p50_ms']:.2f}) | {pv:.1f} / {pt:.1f} ({ratios['tpot_p50_ms']:.2f}) |")
    summary = {"table": rows}
    for name, rounds in results.items():
        startup = statistics.median(r["startup_s"] for r in rounds)
        last = rounds[-1]
        total_ready, total_after = sum(last["rss_ready_gib"].values()), sum(last["rss_after_gib"].values())
        summary[name] = {"startup_s": startup, "rss_ready_gib": last["rss_ready_gib"],
                         "rss_after_gib": last["rss_after_gib"], "rss_total_after_gib": total_after,
                         "rss_non_kv_after_gib": total_after - kv_bytes / GIB,
                         "pss_non_kv_after_gib": last["pss_after_gib"] - kv_bytes / GIB}
        print(f"\n{name}: start-up to serving {startup:.1f} s; RSS at ready {total_ready:.2f} GiB, after load "
              f"{total_after:.2f} GiB ({total_after - kv_bytes / GIB:.2f} GiB without the "
              f"{kv_bytes / GIB:g} GiB KV cache; PSS, shared pages once: "
              f"{last['pss_after_gib'] - kv_bytes / GIB:.2f} GiB)")
        for proc, gib in last["rss_after_gib"].items():
            print(f"  {proc}: {gib * 1024:.0f} MiB")
    print(f"\nratio start-up ttserve / vLLM: {summary['ttserve']['startup_s'] / summary['vllm']['startup_s']:.2f}")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="an embedded model name or a prepared folder")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=1, help="rounds; each alternates which server goes first")
    parser.add_argument("--dtype", default="bfloat16", help="both servers' --dtype")
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile")
    parser.add_argument("--quick", action="store_true",
                        help="CI: concurrency 1 and 4, 4 prompts each, 16 output tokens, 256 MiB KV, vLLM eager")
    parser.add_argument("--only", choices=("vllm", "ttserve"), default=None,
                        help="run one server (no ratios): for profiling one side")
    parser.add_argument("--ttserve-arg", action="append", default=[], metavar="ARG",
                        help="one more `ttserve up` argument (repeat for several)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a server may take to serve")
    args = parser.parse_args()
    levels, output_len = args.concurrency, OUTPUT_LEN
    prompts_per = {c: max(8, 3 * c) for c in levels}
    kv_bytes = KV_BYTES
    if args.quick:
        levels, output_len, args.enforce_eager, args.rounds, kv_bytes = [1, 4], 16, True, 1, QUICK_KV_BYTES
        prompts_per = {c: 4 for c in levels}
    from ttserve.worker.planning.model_prepare import resolve_model

    model = resolve_model(args.model)
    name = model.name
    results: dict[str, list[dict]] = {"vllm": [], "ttserve": []}
    bounds: list[dict] = []
    per_round: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="vs_vllm-") as tmp:
        client = BenchClient(Path(tmp))
        try:
            for i in range(args.rounds):
                bounds.append(weight_read_bound(model, args.quick))
                step = bounds[-1].get("step", {})
                print(f"round {i + 1}: weight-read bound {bounds[-1]['bound_ms']:.2f} ms per step "
                      f"({bounds[-1]['gb_per_s']:.1f} GB/s, {bounds[-1]['kernel']}); ttserve's decode step in "
                      f"process {step.get('step_over_bound', step.get('skipped'))} of it ({step.get('step_over_pass')} of "
                      "the passes' median, alternating)",
                      flush=True)
                order = ["vllm", "ttserve"] if i % 2 == 0 else ["ttserve", "vllm"]
                order = [args.only] if args.only else order
                for which in order:
                    server = (vllm_server(model, name, args.dtype, args.enforce_eager, kv_bytes) if which == "vllm"
                              else ttserve_server(model, args.dtype, kv_bytes, args.ttserve_arg))
                    print(f"round {i + 1}: {which}", flush=True)
                    results[which].append(run_server(client, server, model, name, levels, prompts_per,
                                                     output_len, Path(tmp), args.timeout))
                if not args.only:
                    per_round.append(round_ratios(results["vllm"][-1], results["ttserve"][-1], levels,
                                                  bounds[-1]["bound_ms"]))
                    print(f"round {i + 1} ratios ttserve / vLLM: {json.dumps(per_round[-1])}", flush=True)
        finally:
            client.close()
    if args.only:
        print(json.dumps(results[args.only], indent=2, default=str))
        return 0
    summary = report(results, levels, kv_bytes)
    summary["rounds"] = results
    summary["round_ratios"] = per_round
    summary["weight_read_bound"] = bounds
    if 1 in levels:
        bound = statistics.median(b["bound_ms"] for b in bounds)
        tpot = {k: _median(results[k], 1, "tpot_p50_ms") for k in results}
        print(f"\nweight-read bound {bound:.2f} ms per step (median of {len(bounds)}); c=1 TPOT p50 / bound: "
              f"vLLM {tpot['vllm'] / bound:.2f}, ttserve {tpot['ttserve'] / bound:.2f}")
        summary["tpot_c1_over_bound"] = {k: round(v / bound, 3) for k, v in tpot.items()}
        in_process = [b["step"]["step_over_bound"] for b in bounds if "step_over_bound" in b.get("step", {})]
        if in_process:
            print(f"ttserve's one-row decode step in process (median) / bound: "
                  f"{statistics.median(in_process):.2f} (rounds {', '.join(f'{x:.2f}' for x in in_process)}); "
                  "the rest of its c=1 TPOT is serving")
            summary["step_in_process_over_bound"] = in_process
            # While the step runs it holds every core; whatever else the machine does per token
            # (the control plane, the gateway, the load's client, none of it overlappable with a
            # step on every core) adds its CPU time spread over the cores, at best.
            cores = len(os.sched_getaffinity(0))
            others = statistics.median(sum(ms for proc, ms in r["runs"][1]["cpu_ms_per_token"].items()
                                           if proc != "ttserve.worker") for r in results["ttserve"])
            step_ms = statistics.median(b["step"]["step_ms"] for b in bounds if "step_ms" in b.get("step", {}))
            floor = step_ms + others / cores
            print(f"ttserve's c=1 CPU floor: its decode step in process {step_ms:.2f} ms + the other processes' "
                  f"{others:.2f} CPU-ms per token (control plane, gateway, load client) over {cores} cores = "
                  f"{floor:.2f} ms, {floor / bound:.2f} of the bound (TPOT p50 {tpot['ttserve']:.2f} ms)")
            summary["c1_cpu_floor"] = {"step_ms": step_ms, "others_cpu_ms_per_token": others, "cores": cores,
                                       "floor_ms": floor, "floor_over_bound": round(floor / bound, 3)}
    summary["settings"] = {"input_len": INPUT_LEN, "output_len": output_len, "prompts": prompts_per,
                           "dtype": args.dtype, "vllm_enforce_eager": args.enforce_eager,
                           "kv_cache_bytes": kv_bytes, "cores": sorted(os.sched_getaffinity(0))}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
