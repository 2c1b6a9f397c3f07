"""Named API keys and per-key rate limits (gateway/api_keys.py, gateway/rate_limits.py): the keys
file's `[NAME:] KEY [rpm=N] [tpm=N]` lines, the token buckets on an injected clock, the key
middleware's 429 at the ASGI level, and the engine client naming the key as the request's tenant
and charging it for tokens. No processes; the e2e check is tests/test_e2e_key_limits.py."""
from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import pytest

from ttserve.gateway import api_keys
from ttserve.gateway.api_keys import (KEY_NAME_STATE, ApiKeyConfigError, ApiKeyMiddleware, ApiKeys,
                                      load_api_keys)
from ttserve.gateway.metrics import REGISTRY
from ttserve.gateway.rate_limits import CURRENT_KEY, KeyAccount, Limits, TokenBucket, is_generation


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def write_keys(tmp_path, text: str) -> str:
    path = tmp_path / "keys"
    path.write_text(text)
    return str(path)


def names(keys: ApiKeys) -> list[str]:
    return [a.name for a in keys.accounts]


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# ---- the keys file ------------------------------------------------------------------------------

def test_named_and_bare_keys_with_limits_and_defaults(tmp_path):
    path = write_keys(tmp_path, "# team keys\nalice: sk-alice-1 rpm=60 tpm=100000\n\nsk-bare-2\n"
                                "bob.b_2-x: sk-bob-3 tpm=500\ncarol: sk-carol-4 rpm=0\n")
    keys = load_api_keys(["sk-flag-0"], path, environ={}, default_limits=Limits(7, 70))
    assert names(keys) == ["key-1", "alice", "key-3", "bob.b_2-x", "carol"]  # bare ones: by position
    assert [a.limits for a in keys.accounts] == [
        Limits(7, 70), Limits(60, 100000), Limits(7, 70), Limits(0, 500), Limits(0, 0)]  # rpm=0: unlimited
    assert keys.match("sk-alice-1").name == "alice" and keys.match("sk-bare-2").name == "key-3"
    assert keys.match("sk-flag-0").name == "key-1" and keys.match("alice") is None
    assert keys.match("sk-alice-1 rpm=60") is None and not keys.accepts("sk-alice-")
    assert keys.describe() == "5 key(s), 4 rate-limited"


def test_a_bare_key_file_keeps_working_and_the_variable_gets_a_name(tmp_path):
    keys = load_api_keys(None, write_keys(tmp_path, "k-one\n  k-two  \n"), environ={})
    assert names(keys) == ["key-1", "key-2"] and keys.accepts("k-two")
    assert names(load_api_keys(None, None, environ={"VLLM_API_KEY": "env-key"})) == ["key-1"]


@pytest.mark.parametrize("text, line, words", [
    ("a: k1\na: k2\n", 2, "the name 'a' is also --api-key-file .* line 1's"),
    ("k1\nkey-1: k2\n", 2, "the name 'key-1' is also .* line 1's .*key-N, N its position"),
    ("a: k1\n\nb: k1\n", 3, "the same key as --api-key-file .* line 1"),
    ("al/ice: k1\n", 1, "may hold only letters, digits"),
    ("al ice: k1\n", 1, "word 1 after the key is not rpm=N or tpm=N"),
    ("alice:\n", 1, "the name 'alice' has no key after it"),
    ("k1 rpm=ten\n", 1, "not rpm=N or tpm=N"),
    ("k1 rpm=-1\n", 1, "not rpm=N or tpm=N"),
    ("k1 burst=3\n", 1, "not rpm=N or tpm=N"),
    ("k1 rpm=1 rpm=2\n", 1, "rpm= is given twice"),
    ("k1: k1\n", 1, "a key's name must not be the key"),
    ("k2\nk2x: k3\nk1: k2x\n", 2, "a key's name must not be a key"),
])
def test_bad_lines_are_refused_naming_the_file_and_line_never_the_key(tmp_path, text, line, words):
    path = write_keys(tmp_path, text)
    with pytest.raises(ApiKeyConfigError, match=f"--api-key-file {path} line {line}: .*{words}") as error:
        load_api_keys(None, path, environ={})
    for secret in ("k1", "k2", "k3"):
        assert f"{secret}'" not in str(error.value) and f"{secret} " not in str(error.value)


def test_a_key_given_as_a_flag_and_in_the_file_is_refused(tmp_path):
    with pytest.raises(ApiKeyConfigError, match=r"line 1: the same key as --api-key \(key 1\)"):
        load_api_keys(["dup"], write_keys(tmp_path, "dup\n"), environ={})


def test_default_limits_without_keys_are_refused():
    with pytest.raises(ApiKeyConfigError, match="--key-requests-per-minute.*none is configured"):
        load_api_keys(None, None, environ={}, default_limits=Limits(requests_per_minute=5))


def test_the_gateway_flags_reach_the_keys(tmp_path):
    from ttserve.gateway import config
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    args = parser.parse_args(["--api-key-file", write_keys(tmp_path, "a: k1\nk2 tpm=9\n"),
                              "--key-requests-per-minute", "30", "--key-tokens-per-minute", "1000"])
    config.resolve_security(args)
    assert [(a.name, a.limits) for a in args.api_keys.accounts] == [("a", Limits(30, 1000)), ("key-2", Limits(0, 9))]
    with pytest.raises(SystemExit):
        parser.parse_args(["--key-tokens-per-minute", "-1"])


def test_matching_compares_every_digest_whichever_key_matches(monkeypatch):
    keys = ApiKeys([f"key-number-{i}" for i in range(5)])
    calls = []
    real = api_keys.hmac.compare_digest
    monkeypatch.setattr(api_keys.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    for presented, expected in [("key-number-0", "key-1"), ("key-number-4", "key-5"), ("nope", None)]:
        calls.clear()
        account = keys.match(presented)
        assert (account.name if account else None) == expected and len(calls) == 5


# ---- token buckets ------------------------------------------------------------------------------

def test_a_bucket_starts_full_refills_continuously_and_caps_at_its_size():
    clock = FakeClock()
    bucket = TokenBucket(60, clock)  # one a second
    assert bucket.level == 60 and all(bucket.take() for _ in range(60)) and not bucket.take()
    assert bucket.seconds_until(1) == 1
    clock.t += 0.5
    assert bucket.level == pytest.approx(0.5) and not bucket.take() and bucket.seconds_until(1) == 1
    clock.t += 0.5
    assert bucket.take() and bucket.level == pytest.approx(0)
    clock.t += 3600
    assert bucket.level == 60  # never more than a minute's worth


def test_a_debit_may_go_into_debt_and_the_refill_pays_it_back_first():
    clock = FakeClock()
    bucket = TokenBucket(120, clock)  # two a second
    bucket.debit(125)
    assert bucket.level == -5 and bucket.seconds_until_positive() == 3  # 2.5 s to 0, more than 0 after
    clock.t += 2.5
    assert bucket.level == 0 and bucket.seconds_until_positive() == 1
    clock.t += 0.1
    assert bucket.level > 0 and bucket.seconds_until_positive() == 0


def test_a_key_over_its_request_rate_is_refused_with_when_it_frees():
    clock = FakeClock()
    account = KeyAccount("rpm-key", Limits(requests_per_minute=2), clock)
    before = sample("ttserve_gateway_rate_limited_total", key="rpm-key", limit="requests")
    assert account.admit() is None and account.admit() is None
    clock.t += 10  # a third of a request back: 20 s to go
    refusal = account.admit()
    assert refusal.limit == "requests" and refusal.retry_after == 20
    assert "'rpm-key'" in refusal.message and "requests per minute" in refusal.message and "20s" in refusal.message
    clock.t += 20
    assert account.admit() is None and account.admit() is not None  # one came back, and only one
    assert sample("ttserve_gateway_key_requests_total", key="rpm-key") == 5
    assert sample("ttserve_gateway_rate_limited_total", key="rpm-key", limit="requests") - before == 2


def test_a_key_in_token_debt_is_refused_until_it_is_paid_back():
    clock = FakeClock()
    account = KeyAccount("tpm-key", Limits(tokens_per_minute=600), clock)  # ten a second
    assert account.admit() is None
    account.count_tokens(100, "prompt")
    account.count_tokens(550, "generation")  # 50 in debt: the request was admitted while it had some
    refusal = account.admit()
    assert refusal.limit == "tokens" and refusal.retry_after == 6 and "tokens per minute" in refusal.message
    assert "limit 600, used 650" in refusal.message
    clock.t += 5.01
    assert account.admit() is None
    assert sample("ttserve_gateway_key_tokens_total", key="tpm-key", kind="prompt") == 100
    assert sample("ttserve_gateway_key_tokens_total", key="tpm-key", kind="generation") == 550
    assert sample("ttserve_gateway_rate_limited_total", key="tpm-key", limit="tokens") == 1


def test_an_unlimited_key_is_counted_but_never_refused():
    account = KeyAccount("free-key")
    assert all(account.admit() is None for _ in range(1000))
    account.count_tokens(10**9, "generation")
    assert account.admit() is None


@pytest.mark.parametrize("method, path, counts", [
    ("POST", "/v1/chat/completions", True), ("POST", "/v1/completions", True), ("POST", "/v1/responses", True),
    ("POST", "/v1/messages", True), ("POST", "/invocations", True), ("POST", "/inference/v1/generate", True),
    ("POST", "/tokenize", False), ("POST", "/detokenize", False), ("POST", "/v1/chat/completions/render", False),
    ("POST", "/v1/responses/resp_1/cancel", False), ("GET", "/v1/models", False), ("GET", "/metrics", False),
])
def test_generation_routes_count_against_the_request_rate(method, path, counts):
    assert is_generation({"type": "http", "method": method}, path) == counts


# ---- the middleware -----------------------------------------------------------------------------

def _limited_keys(clock: FakeClock) -> ApiKeys:
    return ApiKeys([api_keys.KeyEntry("sk-a", "a", Limits(requests_per_minute=2)),
                    api_keys.KeyEntry("sk-b", "b")], clock=clock)


def _recording_app(seen: list):
    async def app(scope, receive, send) -> None:
        account = CURRENT_KEY.get()
        seen.append((scope.get("state", {}).get(KEY_NAME_STATE), account.name if account else None))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
    return app


def _requests(app, calls) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return [await client.request(method, path, headers={"Authorization": f"Bearer {key}"}, json={})
                    for method, path, key in calls]
    return asyncio.run(run())


def test_the_middleware_answers_429_with_retry_after_before_the_app_and_names_the_key():
    clock, seen = FakeClock(), []
    app = ApiKeyMiddleware(_recording_app(seen), _limited_keys(clock), rate_limit=True)
    first, second, third, other, tokenize = _requests(app, [
        ("POST", "/v1/chat/completions", "sk-a"), ("POST", "/v1/completions", "sk-a"),
        ("POST", "/v1/responses", "sk-a"), ("POST", "/v1/chat/completions", "sk-b"), ("POST", "/tokenize", "sk-a")])
    assert [r.status_code for r in (first, second, third, other, tokenize)] == [200, 200, 429, 200, 200]
    assert third.headers["retry-after"] == "30" and third.headers["content-type"] == "application/json"
    error = third.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests" and error["param"] is None
    assert "'a'" in error["message"] and "requests per minute" in error["message"] and "30s" in error["message"]
    assert "sk-a" not in third.text
    # The app saw the key's name in the scope and in the context, for every request it got.
    assert seen == [("a", "a"), ("a", "a"), ("b", "b"), ("a", "a")]
    assert CURRENT_KEY.get() is None  # reset after each request
    clock.t += 30
    assert [r.status_code for r in _requests(app, [("POST", "/v1/completions", "sk-a")] * 2)] == [200, 429]


def test_without_rate_limit_the_middleware_only_checks_keys():
    """The waiting responder's middleware: nothing is counted or refused there."""
    seen = []
    app = ApiKeyMiddleware(_recording_app(seen), _limited_keys(FakeClock()))
    responses = _requests(app, [("POST", "/v1/completions", "sk-a")] * 4 + [("POST", "/v1/completions", "bad")])
    assert [r.status_code for r in responses] == [200] * 4 + [401] and seen == [("a", "a")] * 4


def test_a_websocket_over_its_limit_is_closed_before_it_is_accepted():
    clock = FakeClock()
    keys = ApiKeys([api_keys.KeyEntry("sk-w", "w", Limits(requests_per_minute=1))], clock=clock)
    accepted: list[str] = []

    async def app(scope, receive, send) -> None:
        accepted.append(scope["state"][KEY_NAME_STATE])
        await send({"type": "websocket.accept"})

    async def connect() -> dict:
        sent: list[dict] = []

        async def send(message) -> None:
            sent.append(message)

        scope = {"type": "websocket", "path": "/v1/realtime", "headers": [(b"authorization", b"Bearer sk-w")]}
        await ApiKeyMiddleware(app, keys, rate_limit=True)(scope, None, send)
        return sent[0]

    assert asyncio.run(connect())["type"] == "websocket.accept"
    refused = asyncio.run(connect())
    assert refused["type"] == "websocket.close" and refused["code"] == 1013 and "'w'" in refused["reason"]
    assert accepted == ["w"]


# ---- the engine client --------------------------------------------------------------------------

def test_the_engine_client_sends_the_key_name_as_tenant_and_charges_its_tokens():
    from test_gateway_unit import core_request

    from ttserve.gateway.engine_client import GrpcEngineCoreClient
    from ttserve.v1 import engine_pb2

    account = KeyAccount("tenant-key", Limits(tokens_per_minute=1000), FakeClock())
    sent: list = []

    class FakeSession:
        def send(self, message) -> None:
            sent.append(message)

    async def run() -> None:
        client = GrpcEngineCoreClient("127.0.0.1:1")  # never reached
        try:
            client._session = FakeSession()
            for request_id, key in (("req-a", account), ("req-open", None)):
                token = CURRENT_KEY.set(key)
                try:
                    adding = asyncio.ensure_future(client.add_request_async(core_request(prompt=[1, 2, 3, 4],
                                                                                         request_id=request_id)))
                    await asyncio.sleep(0)
                finally:
                    CURRENT_KEY.reset(token)
                client._on_admission(engine_pb2.Admission(request_id=request_id,
                                                          verdict=engine_pb2.Admission.VERDICT_ACCEPTED))
                await adding
            client._on_step(engine_pb2.StepOutputs(outputs=[
                engine_pb2.RequestOutput(request_id="req-a", new_token_ids=[7, 8, 9]),
                engine_pb2.RequestOutput(request_id="req-open", new_token_ids=[7])]))
        finally:
            client._session = None
            client.shutdown()

    asyncio.run(run())
    assert [m.add.tenant for m in sent] == ["tenant-key", ""]
    assert sample("ttserve_gateway_key_tokens_total", key="tenant-key", kind="prompt") == 4
    assert sample("ttserve_gateway_key_tokens_total", key="tenant-key", kind="generation") == 3
    assert account.tokens.level == 1000 - 7
