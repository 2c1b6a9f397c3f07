"""Throughput of one greedy request and of N concurrent ones, against a baseline in the same run.

Starts the stack with `ttserve up` (the embedded default unless --model), streams completions
through the openai client, and reports vLLM-benchmark quantities (TTFT, TPOT, E2E latency, output
tokens/s). The baseline is Hugging Face transformers' greedy `generate` on the same folder in
this process, so the ratios hold across machines:
  ttserve single / transformers single, and ttserve concurrent / ttserve single.

    python benchmarks/throughput.py [--concurrency 8] [--max-tokens 128] [--model PATH] [--quick]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import openai

PROMPTS = ["Explain how a transformer language model generates text, step by step.",
           "Write a short story about a lighthouse keeper.",
           "List ten facts about the Moon.", "Describe the water cycle to a child.",
           "What are the trade-offs between tensor and data parallelism?",
           "Summarize the plot of Hamlet.", "How do bees communicate?",
           "Give advice to a new software engineer."]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _one(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    stamps = []
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    end = time.perf_counter()
    return {"ttft": stamps[0] - start, "e2e": end - start, "tokens": max_tokens,
            "tpot": (stamps[-1] - stamps[0]) / max(max_tokens - 1, 1)}


async def _load(url: str, model: str, concurrency: int, max_tokens: int) -> dict:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    await _one(client, model, "warm up", 4)
    start = time.perf_counter()
    results = await asyncio.gather(*(_one(client, model, PROMPTS[i % len(PROMPTS)], max_tokens)
                                     for i in range(concurrency)))
    wall = time.perf_counter() - start
    return {"concurrency": concurrency, "output_tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "ttft_ms_median": 1000 * statistics.median(r["ttft"] for r in results),
            "tpot_ms_median": 1000 * statistics.median(r["tpot"] for r in results),
            "e2e_s_median": statistics.median(r["e2e"] for r in results)}


def _transformers_baseline(model_path: str, max_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer(PROMPTS[0])["input_ids"]])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return {"concurrency": 1, "output_tokens_per_s": max_tokens / (time.perf_counter() - start)}


def _model_path(model: str) -> str:
    done = subprocess.run([sys.executable, "-m", "ttserve.cli", "model", "prepare", model], check=True,
                          capture_output=True, text=True) if not model.startswith("/") else None
    return done.stdout.strip().splitlines()[-1] if done else model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="CI: 2 concurrent requests of 8 tokens")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.max_tokens = 2, 8
    model_path = _model_path(args.model)
    port = _free_port()
    up = subprocess.Popen([sys.executable, "-m", "ttserve.cli", "up", "--port", str(port),
                           "--control-port", str(_free_port()), "--worker-port", str(_free_port()),
                           "--control-metrics-port", str(_free_port()),
                           "--worker-metrics-port", str(_free_port()),
                           "--model", model_path, "--max-num-seqs", str(max(args.concurrency, 1))],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(f"{url}/ready", timeout=2)  # a waiting gateway answers /health too
                break
            except OSError:
                if up.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the stack did not start; run `ttserve up` by hand to see why")
                time.sleep(0.5)
        name = model_path.rstrip("/").rsplit("/", 1)[-1]
        single = asyncio.run(_load(url, name, 1, args.max_tokens))
        concurrent = asyncio.run(_load(url, name, args.concurrency, args.max_tokens))
    finally:
        up.terminate()
        up.wait(timeout=60)
    baseline = _transformers_baseline(model_path, args.max_tokens)
    report = {"ttserve_single": single, "ttserve_concurrent": concurrent, "transformers_single": baseline,
              "ratio_single_vs_transformers": single["output_tokens_per_s"] / baseline["output_tokens_per_s"],
              "ratio_concurrent_vs_single": concurrent["output_tokens_per_s"] / single["output_tokens_per_s"]}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
