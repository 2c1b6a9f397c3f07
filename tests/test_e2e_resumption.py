"""A request resumed on a control plane (engine.proto Resumption: the output another control plane
produced and the client already has) goes on with exactly the tokens an uninterrupted run makes:
greedy, seeded, with a grammar; and one that could not have produced that output is refused.
This is the control plane's half of surviving its own loss (the gateway re-adds its requests so).
Real worker and control plane processes, SmolLM2 in float32."""
from __future__ import annotations

import signal

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


def test_streams_survive_a_sigkilled_and_restarted_control_plane_with_the_tokens_of_an_uninterrupted_run(
        tmp_path, smollm2):
    """The gateway's half: 16 streams (greedy and seeded) in flight when the control plane is
    SIGKILLed and restarted at once (as Restart= or `ttserve up` would) all finish, each with the
    tokens an uninterrupted run gives; the clients see a pause, never an error."""
    import threading
    import time

    import openai

    from stack import Service

    stack = start_stack(tmp_path, str(smollm2), worker_flags=("--dtype", "float32"))
    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)
    prompts = [f"Story {i}: once upon a time" for i in range(16)]
    extra = [{"seed": i} if i % 2 else {} for i in range(16)]

    def stream(i: int, started: threading.Event | None, out: dict) -> None:
        chunks = client.completions.create(model=smollm2.name, prompt=prompts[i], max_tokens=MAX_TOKENS,
                                           temperature=0.8 if extra[i] else 0, stream=True, timeout=300,
                                           extra_body={"ignore_eos": True, "return_token_ids": True, **extra[i]})
        tokens, reasons, gaps, last = [], [], [], time.monotonic()
        try:
            for chunk in chunks:
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                for choice in chunk.choices:
                    tokens += choice.token_ids or []
                    if choice.finish_reason:
                        reasons.append(choice.finish_reason)
                if started is not None and tokens:
                    started.set()
        except openai.APIError as e:
            reasons.append(f"error: {e}")
        out[i] = (tokens, reasons, max(gaps[1:], default=0.0))

    try:
        references: dict = {}
        threads = [threading.Thread(target=stream, args=(i, None, references)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r[1] == ["length"] and len(r[0]) == MAX_TOKENS for r in references.values()), references
        results: dict = {}
        started = [threading.Event() for _ in range(16)]
        threads = [threading.Thread(target=stream, args=(i, started[i], results)) for i in range(16)]
        for t in threads:
            t.start()
        for event in started:
            assert event.wait(120), "a stream did not start"
        control = stack.services[1]
        assert control.name == "control"
        control.stop(signal.SIGKILL)
        stack.services[1] = Service(control.name, control.args, control.log_path).start()
        for t in threads:
            t.join(300)
        failed = {i: r[1] for i, r in results.items() if r[1] != ["length"]}
        assert not failed, f"{failed}\n{stack.logs()}"
        mismatched = [i for i in range(16) if results[i][0] != references[i][0]]
        assert not mismatched, f"streams {mismatched} differ from an uninterrupted run"
        assert metric(stack.control_metrics_url, "ttserve_request_resumptions_total", outcome="admitted") >= 1
        print("longest pause a client saw: %.2f s" % max(r[2] for r in results.values()))
    finally:
        stack.stop()


def test_every_kind_of_request_resumes_through_a_restarted_control_plane(tmp_path, smollm2):
    """Non-streaming, n > 1 (seeded), logprobs and structured output all come back from a
    SIGKILLed and restarted control plane with what an uninterrupted run returns."""
    import threading
    import time

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
    import time

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
