"""Service behaviour through real processes: the control plane's gRPC API, protocol checks,
start-up failures, a lost worker, and `ttserve up`."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys

import grpc
import openai
import pytest

from stack import free_port, start_stack, start_worker, ttserve_up, wait_until
from ttserve.control_client import ControlClient
from ttserve.protocol import CALL_METADATA, METADATA_KEY, PROTOCOL_VERSION
from ttserve.v1 import engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def control(tmp_path_factory, smollm2):
    s = start_stack(tmp_path_factory.mktemp("control"), str(smollm2), gateway=False,
                    control_flags=("--max-num-seqs", "4"), worker_flags=("--num-threads", "1"))
    yield s
    s.stop()


def test_tokenless_grpc_client_gets_outputs_batched_per_step(control):
    session = ControlClient(control.control_address)
    prompt = [1, 504, 3458, 282, 4649, 314]
    for i in range(3):
        session.add(f"r{i}", prompt, 10, ignore_eos=True)
    results = session.collect({"r0", "r1", "r2"})
    session.close()
    assert all(len(r.token_ids) == 10 for r in results.values())
    assert results["r0"].token_ids == results["r1"].token_ids == results["r2"].token_ids  # greedy
    assert {r.finish_reason for r in results.values()} == {engine_pb2.FINISH_REASON_LENGTH}
    # One message per step carries every request's delta.
    assert max(results["r0"].outputs_per_message) == 3


def test_grpc_logprobs_come_with_each_token_greedy_at_rank_one(control):
    session = ControlClient(control.control_address)
    session.add("lp", [1, 504, 3458, 282, 4649, 314], 6, ignore_eos=True, logprobs=3)
    session.add("plain", [1, 504, 3458, 282, 4649, 314], 6, ignore_eos=True)
    results = session.collect({"lp", "plain"})
    session.close()
    lp, plain = results["lp"], results["plain"]
    assert lp.token_ids == plain.token_ids and not plain.logprobs  # logprobs change nothing sampled
    assert len(lp.logprobs) == 6
    for token, entry in zip(lp.token_ids, lp.logprobs):
        assert entry.rank == 1 and list(entry.token_ids[:2]) == [token, token] and len(entry.token_ids) == 4
        top = list(entry.logprobs[1:])
        assert entry.logprobs[0] == top[0] and top == sorted(top, reverse=True)


def test_admission_refuses_with_a_message(control):
    session = ControlClient(control.control_address)
    session.add("long", [5] * 9000, 4)
    session.add("zero", [5], 0)
    session.add("vocab", [10**6], 4)
    session.add("too-many", [5] * 10, 9000)
    session.add("logprobs", [5], 4, logprobs=21)
    verdicts = {}
    for _ in range(5):
        a = session.next().admission
        verdicts[a.request_id] = (a.verdict, a.message)
    session.close()
    assert all(v == engine_pb2.Admission.VERDICT_INVALID_ARGUMENT for v, _ in verdicts.values())
    assert "maximum context length" in verdicts["long"][1]
    assert "max_tokens" in verdicts["zero"][1]
    assert "out of range" in verdicts["vocab"][1]
    assert "lower max_tokens" in verdicts["too-many"][1]
    assert "between 0 and 20" in verdicts["logprobs"][1]


def test_abort_stops_a_request_and_its_slot_is_reused(control):
    session = ControlClient(control.control_address)
    session.add("a", [1, 2, 3], 5000, ignore_eos=True)
    assert session.next().admission.verdict == engine_pb2.Admission.VERDICT_ACCEPTED
    assert session.next().outputs.outputs[0].request_id == "a"
    session.abort("a", "never-existed")
    for i in range(4):
        session.add(f"b{i}", [1, 2, 3], 3, ignore_eos=True)
    results = session.collect({f"b{i}" for i in range(4)})
    worker = session.server_info().workers[0]
    session.close()
    assert all(len(r.token_ids) == 3 for r in results.values())
    # The aborted request holds nothing: no row, no KV block.
    assert worker.num_running == 0 and worker.kv_blocks_used == 0


def test_protocol_mismatch_is_refused_naming_both_versions(control):
    with grpc.insecure_channel(control.control_address) as channel:
        with pytest.raises(grpc.RpcError) as e:
            engine_pb2_grpc.EngineStub(channel).GetServerInfo(
                engine_pb2.ServerInfoRequest(), metadata=((METADATA_KEY, "999"),), timeout=5)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "999" in e.value.details() and f"version {PROTOCOL_VERSION}" in e.value.details()


def test_model_info_reports_limits(control):
    with grpc.insecure_channel(control.control_address) as channel:
        info = engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.ModelInfoRequest(),
                                                                metadata=CALL_METADATA, timeout=5)
    assert info.max_num_seqs == 4 and info.vocab_size == 49152 and info.architecture == "LlamaForCausalLM"
    assert 0 < info.max_model_len <= 8192 and info.num_blocks * info.block_size >= info.max_model_len


@pytest.mark.parametrize("module, args, words", [
    ("ttserve.worker", ["--model", "/nonexistent/folder"], "/nonexistent/folder"),
    ("ttserve.worker", ["--model", "smollm2", "--additional-config", '{"tt": {"trace_mode": "sometimes"}}'],
     "decode_only"),
    ("ttserve.worker", ["--model", "smollm2", "--additional-config", '{"tt": {"no_such_key": 1}}'],
     "no_such_key"),
    ("ttserve.worker", ["--backend", "ttnn"], "ttnn backend"),
    ("ttserve.worker", ["--additional-config.tt.dispatch_core_axis", "diagonal"], "row, col"),
    ("ttserve.worker", ["--backend", "sim", "--sim-profile", "abacus"], "galaxy-llama-3.3-70b"),
    ("ttserve.control", ["--data-parallel-size", "0"], "--data-parallel-size"),
    ("ttserve.control", ["--max-num-seqs", "0"], "per-lane"),
    ("ttserve.control", ["--tensor-parallel-size", "2"], "MESH_DEVICE"),
    ("ttserve.control", ["--stall-timeout", "0"], "--stall-timeout"),
    ("ttserve.control", ["--metrics-port", "70000"], "--metrics-port"),
    ("ttserve.worker", ["--num-threads", "-1"], "--num-threads"),
    ("ttserve.worker", ["--metrics-port", "70000"], "--metrics-port"),
])
def test_bad_startup_exits_nonzero_with_one_clear_line(module, args, words):
    port = free_port()
    done = subprocess.run([sys.executable, "-m", module, "--port", str(port), *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and words in errors[0], done.stderr
    assert "Traceback" not in done.stderr


def test_lost_worker_gives_503_then_recovers(tmp_path, smollm2):
    stack = start_stack(tmp_path, str(smollm2))
    try:
        client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        assert client.completions.create(model=model, prompt="Hi", max_tokens=2).choices
        worker = stack.services[0]
        worker.stop(signal.SIGKILL)

        def refused() -> bool:
            try:
                client.completions.create(model=model, prompt="Hi", max_tokens=2)
            except openai.APIStatusError as e:
                return e.status_code == 503 and "worker" in str(e.body)
            return False

        wait_until(refused, 30, "a 503 naming the lost worker")
        port = int(stack.worker_address.rsplit(":", 1)[1])
        stack.services[0] = start_worker(tmp_path, str(smollm2), port)
        wait_until(lambda: client.completions.create(model=model, prompt="Hi", max_tokens=2).choices,
                   120, "service to recover after the worker restarts", stack)
    finally:
        stack.stop()


def test_ttserve_up_routes_flags_and_stops_cleanly_on_sigterm(tmp_path, smollm2):
    with ttserve_up(tmp_path, "--model", str(smollm2), "--max-num-seqs", "3", "--block-size", "32") as (proc, ports):
        with grpc.insecure_channel(f"127.0.0.1:{ports[1]}") as channel:
            info = engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.ModelInfoRequest(),
                                                                    metadata=CALL_METADATA, timeout=5)
        assert info.max_num_seqs == 3 and info.block_size == 32
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports[0]}/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model=smollm2.name, max_tokens=8,
                                             messages=[{"role": "user", "content": "Hello!"}])
        assert out.choices[0].message.content
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_up_refuses_a_flag_no_service_declares():
    done = subprocess.run([sys.executable, "-m", "ttserve.cli", "up", "--no-such-flag", "3"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--no-such-flag" in done.stderr


def test_grammar_is_enforced_for_a_tokenless_client_and_a_bad_one_ends_with_an_error(control, smollm2):
    """The control plane reads the worker's model folder for its tokenizer; a grammar that does
    not compile (a client without the gateway's validation) ends its request with an error."""
    import re

    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    session = ControlClient(control.control_address)
    prompt = tokenizer.encode("The answer is").ids
    session.add("regex", prompt, 16, structured_output=engine_pb2.StructuredOutput(regex="(red|green) [0-9]{2}"))
    session.add("bad", prompt, 16, structured_output=engine_pb2.StructuredOutput(regex="(unclosed"))
    finished = session.collect({"regex", "bad"})
    session.close()
    regex = finished["regex"].token_ids
    assert finished["regex"].finish_reason == engine_pb2.FINISH_REASON_STOP
    assert regex[-1] == 2 and re.fullmatch("(red|green) [0-9]{2}", tokenizer.decode(regex[:-1]))
    assert finished["bad"].finish_reason == engine_pb2.FINISH_REASON_ERROR and not finished["bad"].token_ids
    assert "regex" in finished["bad"].error



@pytest.mark.parametrize("busy_flag", ["--port", "--metrics-port"])
def test_a_busy_port_fails_start_up_with_one_line_naming_it(busy_flag):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = {"--port": str(free_port()), "--metrics-port": str(free_port()), busy_flag: str(busy)}
        done = subprocess.run([sys.executable, "-m", "ttserve.control", *[x for kv in ports.items() for x in kv]],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and f"cannot listen on 127.0.0.1:{busy}" in errors[0], done.stderr
