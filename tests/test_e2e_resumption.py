"""A request resumed on a control plane (engine.proto Resumption: the output another control plane
produced and the client already has) goes on with exactly the tokens an uninterrupted run makes:
greedy, seeded, with a grammar; and one that could not have produced that output is refused.
This is the control plane's half of surviving its own loss (the gateway re-adds its requests so).
Real worker and control plane processes, SmolLM2 in float32."""
from __future__ import annotations

import re
import signal
import threading
import time

import pytest

from stack import metric, start_stack
from ttserve.control_client import ControlClient, Refused
from ttserve.v1 import engine_pb2

pytestmark = pytest.mark.e2e

PROMPT = [1, 504, 3458, 282, 260, 1345, 28, 2730, 314]  # any tokens: a fixed text
MAX_TOKENS = 24
SENT = 10  # tokens the client had when the first control plane was lost


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm2):
    s = start_stack(tmp_path_factory.mktemp("resume"), str(smollm2), gateway=False,
                    worker_flags=("--dtype", "float32"))
    yield s
    s.stop()


@pytest.fixture
def client(stack):
    c = ControlClient(stack.control_address)
    yield c
    c.close()


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 7}], ids=["greedy", "seeded"])
def test_a_resumed_request_goes_on_with_the_tokens_of_an_uninterrupted_run(client, stack, sampling):
    client.add("whole", PROMPT, MAX_TOKENS, eos_token_ids=(), **sampling)
    whole = client.collect({"whole"})["whole"]
    assert len(whole.token_ids) == MAX_TOKENS and whole.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    before = metric(stack.control_metrics_url, "ttserve_request_resumptions_total", outcome="admitted") or 0
    generated = metric(stack.control_metrics_url, "ttserve_request_generation_tokens_sum")
    client.add("resumed", PROMPT, MAX_TOKENS, eos_token_ids=(), resumed_from=whole.token_ids[:SENT], **sampling)
    resumed = client.collect({"resumed"})["resumed"]
    # Only what the client did not have, counted against the same max_tokens.
    assert resumed.token_ids == whole.token_ids[SENT:]
    assert resumed.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert metric(stack.control_metrics_url, "ttserve_request_resumptions_total", outcome="admitted") == before + 1
    # The request's metrics count what it generated here, not the tokens it arrived with.
    assert metric(stack.control_metrics_url, "ttserve_request_generation_tokens_sum") == generated + MAX_TOKENS - SENT


def test_a_resumed_request_with_a_grammar_goes_on_within_it(client, smollm2):
    from tokenizers import Tokenizer
    import re

    tokenizer = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    prompt = tokenizer.encode("The answer is").ids
    grammar = engine_pb2.StructuredOutput(regex="(red|green) [0-9]{2}")
    client.add("whole", prompt, 16, structured_output=grammar)
    whole = client.collect({"whole"})["whole"]
    assert whole.finish_reason == engine_pb2.FINISH_REASON_STOP and len(whole.token_ids) >= 3
    client.add("resumed", prompt, 16, structured_output=grammar, resumed_from=whole.token_ids[:2])
    resumed = client.collect({"resumed"})["resumed"]
    assert resumed.token_ids == whole.token_ids[2:] and resumed.finish_reason == whole.finish_reason
    assert re.fullmatch("(red|green) [0-9]{2}", tokenizer.decode(whole.token_ids[:2] + resumed.token_ids[:-1]))
    # Output the grammar never allowed: the request ends with an error naming the token.
    client.add("off-grammar", prompt, 16, structured_output=grammar, resumed_from=tokenizer.encode(" blue").ids)
    off = client.collect({"off-grammar"})["off-grammar"]
    assert off.finish_reason == engine_pb2.FINISH_REASON_ERROR and not off.token_ids
    assert "resumed output token 1" in off.error and "structured output" in off.error, off.error


@pytest.mark.parametrize("resumed_from, max_tokens, eos, expected", [
    (list(range(100, 108)), 8, (), "nothing is left to generate"),
    ([100, 2, 101], 8, (2,), "resumed output token 2 (id 2) is a stop token"),
    ([100, 49152], 8, (), "resumed output token id 49152 is out of range"),
], ids=["max-tokens-reached", "ended-on-eos", "out-of-vocabulary"])
def test_a_resumption_no_run_could_have_made_is_refused_with_the_reason(client, stack, resumed_from, max_tokens,
                                                                        eos, expected):
    before = metric(stack.control_metrics_url, "ttserve_request_resumptions_total", outcome="invalid") or 0
    client.add("bad", PROMPT, max_tokens, eos_token_ids=eos, resumed_from=resumed_from)
    with pytest.raises(Refused, match=expected.replace("(", r"\(").replace(")", r"\)")):
        client.collect({"bad"})
    assert metric(stack.control_metrics_url, "ttserve_request_resumptions_total", outcome="invalid") == before + 1


def restart_control(stack) -> None:
    """SIGKILL the control plane and start it again at once, as Restart= or `ttserve up` would."""
    from stack import Service

    control = stack.services[1]
    assert control.name == "control"
    control.stop(signal.SIGKILL)
    stack.services[1] = Service(control.name, control.args, control.log_path).start()


def read_stream(open_stream, started=None) -> tuple[list[int], list[str], list[float]]:
    """A streamed completion's or chat completion's token ids (vLLM's `return_token_ids` field of
    each choice), finish reasons (an API error ends it as one) and the seconds between chunks;
    `started` is set at the first tokens."""
    import openai

    tokens, reasons, gaps, last = [], [], [], time.monotonic()
    try:
        for chunk in open_stream():
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            for choice in chunk.choices:
                tokens += getattr(choice, "token_ids", None) or []
                if choice.finish_reason:
                    reasons.append(choice.finish_reason)
            if started is not None and tokens:
                started.set()
    except openai.APIError as e:
        reasons.append(f"error: {e}")
    return tokens, reasons, gaps


def caught_by(stream, n: int, fault) -> dict:
    """Runs `stream(i, started, out)` for i < n on threads, calls `fault()` once every stream has
    its first tokens (each sets its `started`), and returns `out` when all have ended."""

    results: dict = {}
    started = [threading.Event() for _ in range(n)]
    threads = [threading.Thread(target=stream, args=(i, started[i], results)) for i in range(n)]
    for t in threads:
        t.start()
    for event in started:
        assert event.wait(120), "a stream did not start"
    fault()
    for t in threads:
        t.join(300)
    return results


def sixteen_streams_through(stack, model: str, lose) -> dict:
    """16 streams (greedy and seeded) run once undisturbed, then again with `lose(stack)` called
    once each has its first tokens. Every one must finish with its undisturbed tokens; returns
    the counts and the longest pause a client saw between two chunks."""

    import openai

    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)
    prompts = [f"Story {i}: once upon a time" for i in range(16)]
    extra = [{"seed": i} if i % 2 else {} for i in range(16)]

    def stream(i: int, started: threading.Event | None, out: dict) -> None:
        tokens, reasons, gaps = read_stream(lambda: client.completions.create(
            model=model, prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=0.8 if extra[i] else 0, stream=True,
            timeout=300, extra_body={"ignore_eos": True, "return_token_ids": True, **extra[i]}), started)
        out[i] = (tokens, reasons, max(gaps[1:], default=0.0))

    references: dict = {}
    threads = [threading.Thread(target=stream, args=(i, None, references)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r[1] == ["length"] and len(r[0]) == MAX_TOKENS for r in references.values()), references
    results = caught_by(stream, 16, lambda: lose(stack))
    failed = {i: r[1] for i, r in results.items() if r[1] != ["length"]}
    assert not failed, f"{failed}\n{stack.logs()}"
    mismatched = [i for i in range(16) if results[i][0] != references[i][0]]
    assert not mismatched, f"streams {mismatched} differ from an uninterrupted run"
    figures = {"completed": len(results) - len(failed), "identical": 16 - len(mismatched), "failed": len(failed),
               "longest_pause_s": round(max(r[2] for r in results.values()), 2)}
    print(f"16 streams: {figures}")
    return figures


def test_streams_survive_a_sigkilled_and_restarted_control_plane_with_the_tokens_of_an_uninterrupted_run(
        tmp_path, smollm2):
    """The gateway's half: 16 streams (greedy and seeded) in flight when the control plane is
    SIGKILLed and restarted at once (as Restart= or `ttserve up` would) all finish, each with the
    tokens an uninterrupted run gives; the clients see a pause, never an error."""
    stack = start_stack(tmp_path, str(smollm2), worker_flags=("--dtype", "float32"))
    try:
        sixteen_streams_through(stack, smollm2.name, restart_control)
        assert metric(stack.control_metrics_url, "ttserve_request_resumptions_total", outcome="admitted") >= 1
    finally:
        stack.stop()


def test_streams_survive_a_sigkilled_control_plane_on_a_standby_that_takes_its_workers(tmp_path, smollm2):
    """Two control planes over the same worker, the gateway listing both (--control A,B): B waits
    as a standby (not ready: the worker serves A, which answers its probes) while A serves. A is
    SIGKILLed and stays dead: the worker takes B's step stream at once, and the gateway fails
    over to B and resumes the 16 streams there with the tokens of an uninterrupted run."""
    from stack import control_ready

    stack = start_stack(tmp_path, str(smollm2), worker_flags=("--dtype", "float32"), standby_controls=1)
    (standby, standby_metrics), = stack.standbys
    try:
        time.sleep(3)  # the standby has described the worker and waits for its stream
        assert not control_ready(standby) and control_ready(stack.control_address)

        def kill_first(stack) -> None:
            control = stack.services[1]
            assert control.name == "control" and control.args[control.args.index("--port") + 1] == \
                stack.control_address.rpartition(":")[2]
            control.stop(signal.SIGKILL)

        sixteen_streams_through(stack, smollm2.name, kill_first)
        assert stack.services[1].proc.poll() is not None  # A stayed dead: B served the rest
        assert metric(standby_metrics, "ttserve_request_resumptions_total", outcome="admitted") >= 1
        worker_log = stack.services[0].output()
        assert "it is gone" not in worker_log  # A's death reset its connection: no probe needed
    finally:
        stack.stop()


def test_every_kind_of_request_resumes_through_a_restarted_control_plane(tmp_path, smollm2):
    """Non-streaming, n > 1 (seeded), logprobs and structured output all come back from a
    SIGKILLed and restarted control plane with what an uninterrupted run returns."""

    import openai

    from stack import Service, samples, get

    stack = start_stack(tmp_path, str(smollm2), worker_flags=("--dtype", "float32"))
    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)
    ask = {"model": smollm2.name, "max_tokens": 48, "timeout": 300}
    calls = {
        "plain": lambda: client.completions.create(prompt="The history of bread", temperature=0,
                                                   extra_body={"ignore_eos": True}, **ask),
        "n=2 seeded": lambda: client.completions.create(prompt="A short poem:", n=2, temperature=0.9, seed=11,
                                                        extra_body={"ignore_eos": True}, **ask),
        "logprobs": lambda: client.completions.create(prompt="List of colours:", temperature=0, logprobs=2,
                                                      extra_body={"ignore_eos": True}, **ask),
        "structured": lambda: client.completions.create(prompt="Say something:", temperature=0,
                                                        extra_body={"structured_outputs": {"regex": "[a-z ]{60}"}},
                                                        **ask),
    }

    def answer(response) -> list:
        return [(c.text, c.finish_reason, c.logprobs.token_logprobs if c.logprobs else None)
                for c in sorted(response.choices, key=lambda c: c.index)]

    def in_flight() -> tuple[float, float]:
        """(requests the control plane holds, tokens it has generated)"""
        text = get(f"{stack.control_metrics_url}/metrics")[1]
        return (sum(samples(text, "ttserve_num_requests_running")) + sum(samples(text, "ttserve_num_requests_waiting")),
                sum(samples(text, "ttserve_generation_tokens_total")))

    try:
        references = {name: answer(call()) for name, call in calls.items()}
        results: dict = {}

        def run(name: str) -> None:
            try:
                results[name] = answer(calls[name]())
            except openai.APIError as e:
                results[name] = f"error: {e}"

        threads = [threading.Thread(target=run, args=(name,)) for name in calls]
        for t in threads:
            t.start()
        # All five admitted (n=2 is two requests) and about 8 tokens each generated of their 48:
        # the kill finds them mid-output.
        generated = in_flight()[1]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            held, tokens = in_flight()
            if held >= 5 and tokens >= generated + 40:
                break
            time.sleep(0.05)
        control = stack.services[1]
        control.stop(signal.SIGKILL)
        stack.services[1] = Service(control.name, control.args, control.log_path).start()
        for t in threads:
            t.join(300)
        for name in calls:
            got, want = results[name], references[name]
            if name == "logprobs":  # the same tokens; logprobs within float noise of a recompute
                assert [g[:2] for g in got] == [w[:2] for w in want], (name, got, want)
                assert all(abs(a - b) < 1e-3 for g, w in zip(got, want) for a, b in zip(g[2], w[2])), name
            else:
                assert got == want, (name, got, want)
        assert metric(stack.control_metrics_url, "ttserve_request_resumptions_total", outcome="admitted") >= 1
    finally:
        stack.stop()


def test_a_gateway_stopped_while_its_requests_wait_to_resume_ends_them_and_exits_0(tmp_path, smollm2):

    import openai

    stack = start_stack(tmp_path, str(smollm2), worker_flags=("--backend", "sim", "--sim-profile", "t3k-llama-3.3-70b"),
                        gateway_flags=("--shutdown-timeout", "1"))
    try:
        client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)
        chunks = iter(client.completions.create(model=smollm2.name, prompt="Once upon a time", max_tokens=2000,
                                                stream=True, extra_body={"ignore_eos": True}, timeout=60))
        assert next(chunks).choices
        stack.services[1].stop(signal.SIGKILL)  # gone for good: the request waits to resume
        gateway = stack.services[-1]
        gateway.proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        ended = []
        try:
            for chunk in chunks:
                ended += [c.finish_reason for c in chunk.choices if c.finish_reason]
        except openai.APIError as e:
            ended.append(f"error: {e}")
        assert ended, "the stream ended without a finish reason or an error"
        # Ended by the gateway's shutdown (--shutdown-timeout 1), not by the client's own timeout
        # or the 120-s resume deadline.
        assert time.monotonic() - stopped < 20 and not any("timed out" in str(e) for e in ended), ended
        assert gateway.proc.wait(timeout=30) == 0, gateway.output()[-3000:]
    finally:
        stack.stop()


def test_a_step_stream_that_leaves_a_probe_unanswered_is_ended_for_the_next_control_plane(tmp_path, smollm2):
    """The probe alone, without the race against keepalive a frozen process runs: the stream is
    held by a client whose HTTP/2 layer lives (it answers keepalive pings, so keepalive never ends
    the stream) but which sends nothing, as a control plane whose event loop is gone. A second
    stream takes the worker once the probe goes unanswered, and the first ends with ABORTED
    saying why (worker/server.py PROBE_TIMEOUT_S)."""

    import grpc

    from stack import free_port, start_worker, wait_until
    from ttserve.protocol import CALL_METADATA, CHANNEL_OPTIONS
    from ttserve.v1 import device_pb2, device_pb2_grpc

    port = free_port()
    worker = start_worker(tmp_path, str(smollm2), port)
    never = threading.Event()

    def silent():  # sends nothing, ever
        never.wait()
        yield from ()

    channels = [grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) for _ in range(2)]
    try:
        stubs = [device_pb2_grpc.DeviceStub(c) for c in channels]
        wait_until(lambda: stubs[0].Describe(device_pb2.DescribeRequest(), metadata=CALL_METADATA, timeout=2), 120,
                   "the worker")
        held = stubs[0].Step(silent(), metadata=CALL_METADATA)
        held.initial_metadata()  # the worker holds this stream
        contender = stubs[1].Step(silent(), metadata=CALL_METADATA)
        contender.initial_metadata()  # ... and now this one
        assert "sent nothing for 5 s after a probe: it is gone" in worker.output()
        seen = []
        with pytest.raises(grpc.RpcError) as ended:
            for message in held:
                seen.append(message)
        assert [m.probe for m in seen] == [True]
        assert ended.value.code() == grpc.StatusCode.ABORTED
        assert "now serves another control plane" in ended.value.details()
        contender.cancel()
    finally:
        never.set()
        for channel in channels:
            channel.close()
        worker.stop()


def test_streams_survive_a_frozen_control_plane_on_a_standby_the_worker_probes_it_for(tmp_path, smollm2):
    """A control plane whose host vanished leaves its connections open (no reset) until keepalive
    ends them (~30 s); SIGSTOP gives the same. The worker probes the frozen one's step stream for
    the waiting standby and ends it when the probe goes unanswered (worker/server.py
    PROBE_TIMEOUT_S); the gateway, finding its control plane unreachable and the standby ready,
    moves the 16 streams there. Let go again, the frozen one learns it lost the worker."""
    from stack import control_ready

    stack = start_stack(tmp_path, str(smollm2), worker_flags=("--dtype", "float32"), standby_controls=1)
    (standby, standby_metrics), = stack.standbys
    first = stack.services[1]
    try:
        time.sleep(7)  # the standby waits for the stream; the live first control plane answers its probes
        assert not control_ready(standby) and "it is gone" not in stack.services[0].output()
        assert metric(standby_metrics, "ttserve_worker_standby", worker="0") == 0  # still asking
        sixteen_streams_through(stack, smollm2.name, lambda stack: first.proc.send_signal(signal.SIGSTOP))
        assert metric(standby_metrics, "ttserve_request_resumptions_total", outcome="admitted") >= 1
        # The worker ended the frozen one's stream by its probe (the usual case: "it is gone" in
        # its log) or by keepalive, whichever came first (a ping due just before the freeze ends
        # the stream 10 s after it); the test above runs the probe alone.
        first.proc.send_signal(signal.SIGCONT)
        # It learns on its next step's write or read, or, idle (its requests aborted with the
        # session: their releases wait for a next step), from the stream's end itself.
        lost = re.compile(r"worker at \S+ (ended the step stream|failed|went away)")
        deadline = time.monotonic() + 30
        while not lost.search(first.output()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert lost.search(first.output()), first.output()[-3000:]
    finally:
        first.proc.send_signal(signal.SIGCONT)
        stack.stop()


def test_requests_with_images_resume_with_their_images_through_a_restarted_control_plane(tmp_path, tiny_vlm):
    """A chat request with images is re-added with them (the gateway keeps the AddRequest it sent,
    images and all): after a SIGKILLed and restarted control plane, each stream ends with the tokens
    of an uninterrupted run. The tiny random-weight Qwen2.5-VL: its output depends on the image."""
    import base64
    import io

    import openai

    from conftest import sample_image

    def data_url(seed: int) -> str:
        buffer = io.BytesIO()
        sample_image(56 + 28 * seed, 56, seed).save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()

    stack = start_stack(tmp_path, str(tiny_vlm), worker_flags=("--dtype", "float32"))
    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)

    def stream(i: int, started: threading.Event | None, out: dict) -> None:
        content = [{"type": "text", "text": f"Picture {i}:"}, {"type": "image_url", "image_url": {"url": data_url(i)}},
                   {"type": "text", "text": "describe it."}]
        tokens, reasons, _ = read_stream(lambda: client.chat.completions.create(
            model=tiny_vlm.name, messages=[{"role": "user", "content": content}], temperature=0,
            max_tokens=1200, stream=True, timeout=300,  # long enough to be caught by the kill
            extra_body={"ignore_eos": True, "return_token_ids": True}), started)
        out[i] = (tokens, reasons)

    try:
        references: dict = {}
        for i in range(3):
            stream(i, None, references)
        assert all(len(r[0]) == 1200 and r[1] == ["length"] for r in references.values()), references
        # Different images, different tokens: a resumption without its image would show.
        assert len({tuple(r[0]) for r in references.values()}) == 3, references
        results = caught_by(stream, 3, lambda: restart_control(stack))
        assert results == references, f"{results}\n{stack.logs()}"
        assert metric(stack.control_metrics_url, "ttserve_request_resumptions_total", outcome="admitted") >= 1
    finally:
        stack.stop()
