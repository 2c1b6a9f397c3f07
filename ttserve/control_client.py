"""A token-level client of the control plane (engine.proto), for tools, tests and benchmarks.

    client = ControlClient("127.0.0.1:50051")
    client.add("r1", [1, 2, 3], max_tokens=16)
    result = client.collect({"r1"})["r1"]   # tokens, finish reason, worker and lane

Blocking and thread-backed: one gRPC Session stream, messages read on a background thread.
"""
from __future__ import annotations

import collections
import queue
import threading
from dataclasses import dataclass, field

import grpc

from .protocol import CALL_METADATA, CHANNEL_OPTIONS
from .tls import PLAINTEXT, Tls, open_blocking_channel
from .v1 import engine_pb2, engine_pb2_grpc


class Refused(RuntimeError):
    """The control plane refused a request at admission."""


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: int = 0
    error: str = ""
    placements: set[tuple[int, int]] = field(default_factory=set)  # (worker, lane) per output
    logprobs: list = field(default_factory=list)   # engine_pb2.TokenLogprobs per token, if asked
    outputs_per_message: list[int] = field(default_factory=list)  # this request's messages' sizes

    def take(self, out: engine_pb2.RequestOutput) -> bool:
        """Append one output of this request; True when it is the last (a finish)."""
        self.token_ids += out.new_token_ids
        self.logprobs += out.logprobs
        self.placements.add((out.worker, out.lane))
        if out.finish_reason:
            self.finish_reason, self.error = out.finish_reason, out.error
        return bool(out.finish_reason)


class ControlClient:
    def __init__(self, address: str, tls: Tls = PLAINTEXT) -> None:
        """`tls`: TLS to a control plane that serves it (ttserve.tls.load_tls(cert, key, ca))."""
        self.channel = open_blocking_channel(address, tls, CHANNEL_OPTIONS)
        self.stub = engine_pb2_grpc.EngineStub(self.channel)
        self._outgoing: queue.Queue = queue.Queue()
        self.incoming: queue.Queue = queue.Queue()
        # Messages admissions() read past, served again first, in order, by next().
        self._held: collections.deque[engine_pb2.ServerMessage] = collections.deque()
        stream = self.stub.Session(iter(self._outgoing.get, None), metadata=CALL_METADATA)
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        # The stream's end is queued too, so that next() fails at once instead of waiting out
        # its timeout on a session that is gone.
        try:
            for message in stream:
                self.incoming.put(message)
            ended = "the control plane ended the session"
        except grpc.RpcError as e:
            ended = f"the session with the control plane failed: {e.code().name}: {e.details()}"
        self.incoming.put(ConnectionError(ended))

    def add(self, request_id: str, prompt: list[int], max_tokens: int, eos_token_ids=(2,),
            structured_output: engine_pb2.StructuredOutput | None = None,
            resumed_from: list[int] | None = None, **sampling) -> None:
        """`resumed_from`: the output so far of a request resumed here (engine.proto Resumption)."""
        self._outgoing.put(engine_pb2.ClientMessage(add=engine_pb2.AddRequest(
            request_id=request_id, prompt_token_ids=prompt, eos_token_ids=list(eos_token_ids),
            sampling=engine_pb2.SamplingParams(max_tokens=max_tokens, **sampling),
            structured_output=structured_output,
            resumption=None if resumed_from is None else engine_pb2.Resumption(output_token_ids=resumed_from))))

    def add_request(self, add: engine_pb2.AddRequest) -> None:
        """Send an AddRequest as built by the caller (images, cache salt, any field)."""
        self._outgoing.put(engine_pb2.ClientMessage(add=add))

    def abort(self, *request_ids: str) -> None:
        self._outgoing.put(engine_pb2.ClientMessage(abort=engine_pb2.AbortRequests(request_ids=request_ids)))

    def next(self, timeout: float = 120) -> engine_pb2.ServerMessage:
        """The next message; raises ConnectionError once the session has ended."""
        if self._held:
            return self._held.popleft()
        message = self.incoming.get(timeout=timeout)
        if isinstance(message, ConnectionError):
            self.incoming.put(message)  # for the calls after this one
            raise ConnectionError(*message.args)
        return message

    def admissions(self, request_ids: set[str] | list[str], timeout: float = 120) -> dict[str, engine_pb2.Admission]:
        """Each id's admission, as it arrives. Every other message read meanwhile (outputs of
        requests admitted early) is kept for next() and collect(), so none is lost."""
        wanted, verdicts, passed = set(request_ids), {}, []
        try:
            while len(verdicts) < len(wanted):
                message = self.next(timeout)
                if message.HasField("admission") and message.admission.request_id in wanted:
                    verdicts[message.admission.request_id] = message.admission
                else:
                    passed.append(message)
        finally:
            self._held.extendleft(reversed(passed))
        return verdicts

    def collect(self, request_ids: set[str], timeout: float = 600) -> dict[str, Result]:
        """Outputs until every id has finished; raises Refused for a refused one and
        ConnectionError if the session ends first. Messages for other ids are dropped."""
        results = {rid: Result() for rid in request_ids}
        unfinished = set(request_ids)
        while unfinished:
            message = self.next(timeout)
            if message.HasField("admission"):
                a = message.admission
                if a.request_id in results and a.verdict != engine_pb2.Admission.VERDICT_ACCEPTED:
                    raise Refused(f"{a.request_id}: {a.message}")
                continue
            for out in message.outputs.outputs:
                result = results.get(out.request_id)
                if result is None:
                    continue
                result.outputs_per_message.append(len(message.outputs.outputs))
                if result.take(out):
                    unfinished.discard(out.request_id)
        return results

    def server_info(self) -> engine_pb2.ServerInfo:
        return self.stub.GetServerInfo(engine_pb2.ServerInfoRequest(), metadata=CALL_METADATA, timeout=10)

    def model_info(self) -> engine_pb2.ModelInfo:
        return self.stub.GetModelInfo(engine_pb2.ModelInfoRequest(), metadata=CALL_METADATA, timeout=10)

    def close(self) -> None:
        self._outgoing.put(None)
        self.channel.close()
