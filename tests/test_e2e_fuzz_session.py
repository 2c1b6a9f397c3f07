"""Random ClientMessages over a raw gRPC Session to a real control plane (sim worker): every add
gets exactly one Admission, accepted or refused with a message, nothing ends the session or the
service, no KV block leaks, and a plain request is served afterwards."""
from __future__ import annotations

import math
import os
import queue
import threading

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stack import start_stack, wait_until
from ttserve.protocol import CALL_METADATA
from ttserve.v1 import engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.e2e

U32 = st.integers(0, 2**32 - 1)
SMALL_IDS = st.integers(0, 300)
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 0.5, 1.0, -1.0]))


@st.composite
def add_messages(draw: st.DrawFn) -> engine_pb2.ClientMessage:
    ids = st.one_of(SMALL_IDS, U32)
    sampling = engine_pb2.SamplingParams(
        temperature=draw(FLOATS), top_p=draw(FLOATS), top_k=draw(st.integers(-5, 2**31 - 1)),
        min_p=draw(FLOATS), presence_penalty=draw(FLOATS), frequency_penalty=draw(FLOATS),
        repetition_penalty=draw(FLOATS), max_tokens=draw(st.one_of(st.integers(0, 6), U32)),
        min_tokens=draw(st.integers(0, 8)), stop_token_ids=draw(st.lists(ids, max_size=3)),
        ignore_eos=draw(st.booleans()),
        logit_bias={draw(ids): draw(FLOATS) for _ in range(draw(st.integers(0, 2)))},
        allowed_token_ids=draw(st.lists(ids, max_size=3)),
        bad_words=[engine_pb2.BadWords(token_ids=draw(st.lists(ids, max_size=3))) for _ in range(draw(st.integers(0, 2)))])
    if draw(st.booleans()):
        sampling.seed = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        sampling.logprobs = draw(st.integers(-3, 40))
    if draw(st.booleans()):
        sampling.prompt_logprobs = draw(st.integers(-1, 5))
    add = engine_pb2.AddRequest(request_id=draw(st.text(max_size=12)),
                                prompt_token_ids=draw(st.lists(ids, max_size=12)), sampling=sampling,
                                eos_token_ids=draw(st.lists(SMALL_IDS, max_size=2)),
                                cache_salt=draw(st.text(max_size=4)), priority=draw(st.one_of(st.just(0), st.integers(-2**31, 2**31 - 1))))
    if draw(st.integers(0, 9)) == 0:
        add.structured_output.CopyFrom(engine_pb2.StructuredOutput(json=draw(st.text(max_size=20))))
    return engine_pb2.ClientMessage(add=add)


ABORTS = st.builds(lambda ids: engine_pb2.ClientMessage(abort=engine_pb2.AbortRequests(request_ids=ids)),
                   st.lists(st.text(max_size=8), max_size=3))


class Session:
    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.outgoing: queue.Queue = queue.Queue()
        self.incoming: queue.Queue = queue.Queue()
        stream = engine_pb2_grpc.EngineStub(self.channel).Session(iter(self.outgoing.get, None), metadata=CALL_METADATA)
        threading.Thread(target=lambda: [self.incoming.put(m) for m in stream] and None, daemon=True).start()

    def admission(self, request_id: str) -> engine_pb2.Admission:
        while True:
            message = self.incoming.get(timeout=30)
            if message.HasField("admission") and message.admission.request_id == request_id:
                return message.admission


@pytest.fixture(scope="module")
def control(tmp_path_factory, smollm2):
    stack = start_stack(tmp_path_factory.mktemp("fuzz"), str(smollm2), gateway=False,
                        worker_flags=("--backend", "sim", "--sim-profile", "n150-llama-3.1-8b"))
    yield stack
    stack.stop()


# As test_e2e_gateway_fuzz: CI replays fixed examples; TTSERVE_FUZZ_RANDOM=1 draws new ones.
DERANDOMIZE = os.environ.get("TTSERVE_FUZZ_RANDOM") != "1"


def test_random_client_messages_get_an_admission_or_a_clean_refusal(control):
    session = Session(control.control_address)
    counter = iter(range(10**9))

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=DERANDOMIZE)
    @given(st.one_of(add_messages(), ABORTS))
    def one(message: engine_pb2.ClientMessage) -> None:
        if message.HasField("abort"):
            session.outgoing.put(message)
            return
        message.add.request_id = f"{next(counter)}-{message.add.request_id}"  # unique: refusals are per request
        session.outgoing.put(message)
        admission = session.admission(message.add.request_id)
        if admission.verdict != engine_pb2.Admission.VERDICT_ACCEPTED:
            assert admission.message, admission  # a refusal says what was wrong
        s = message.add.sampling
        top_p = s.top_p or 1.0  # proto3: 0 is unset, which engine.proto's "1 = off" fills (control/wire.py)
        if not (math.isfinite(s.temperature) and s.temperature >= 0) or not 0 < top_p <= 1:
            assert admission.verdict == engine_pb2.Admission.VERDICT_INVALID_ARGUMENT, (message, admission)

    one()
    session.outgoing.put(None)  # the client goes away: its requests end with it
    # The service still serves: a plain request on a fresh session completes.
    fresh = Session(control.control_address)
    fresh.outgoing.put(engine_pb2.ClientMessage(add=engine_pb2.AddRequest(
        request_id="plain", prompt_token_ids=[1, 2, 3], sampling=engine_pb2.SamplingParams(max_tokens=3))))
    assert fresh.admission("plain").verdict == engine_pb2.Admission.VERDICT_ACCEPTED
    tokens = []
    while True:
        message = fresh.incoming.get(timeout=60)
        done = [o for o in message.outputs.outputs if o.request_id == "plain"]
        for out in done:
            tokens += out.new_token_ids
        if any(o.finish_reason for o in done):
            break
    assert 1 <= len(tokens) <= 3
    fresh.outgoing.put(None)

    def idle() -> bool:
        with grpc.insecure_channel(control.control_address) as channel:
            info = engine_pb2_grpc.EngineStub(channel).GetServerInfo(engine_pb2.ServerInfoRequest(),
                                                                     metadata=CALL_METADATA, timeout=5)
        w = info.workers[0]
        return info.ready and (w.num_running, w.num_waiting, w.kv_blocks_used) == (0, 0, 0)

    wait_until(idle, 30, "every request to end and every KV block to be free")
