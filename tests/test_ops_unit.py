"""The operations endpoint's HTTP behaviour and the control plane's metric arithmetic."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Counter

from stack import free_port
from ttserve.control.blocks import BlockPool
from ttserve.control.lanes import LaneGroup
from ttserve.control.metrics import ControlMetrics
from ttserve.control.request import FinishReason, Request, RequestStatus, SamplingParams
from ttserve.control.scheduler import Scheduler, SchedulerConfig
from ttserve.control.worker_set import WorkerSpec
from ttserve.control.engine_config import EngineConfig
from ttserve.control.serving_plan import plan_warmup
from ttserve.control.worker_group import LaneTotals, Warm, WorkerGroup
from ttserve.ops_http import OpsEndpoints, start_ops_server


async def _exchange(port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


def test_ops_server_answers_metrics_probes_and_refuses_the_rest():
    registry = CollectorRegistry()
    Counter("ttserve_example", "An example.", registry=registry).inc(3)
    state = {"ready": (False, "warming up")}

    async def scenario() -> dict[str, bytes]:
        port = free_port()
        server = await start_ops_server("127.0.0.1", port, OpsEndpoints(
            registry, health=lambda: (True, ""), ready=lambda: state["ready"]), "test")
        try:
            out = {}
            for name, raw in {"metrics": b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
                              "health": b"GET /health HTTP/1.1\r\n\r\n",
                              "ready": b"GET /ready?verbose=1 HTTP/1.1\r\n\r\n",
                              "head": b"HEAD /health HTTP/1.1\r\n\r\n",
                              "post": b"POST /metrics HTTP/1.1\r\n\r\n",
                              "missing": b"GET /v1/models HTTP/1.1\r\n\r\n",
                              "garbage": b"NONSENSE\r\n\r\n"}.items():
                out[name] = await _exchange(port, raw)
            state["ready"] = (True, "")
            out["ready_later"] = await _exchange(port, b"GET /ready HTTP/1.0\r\n\r\n")
            return out
        finally:
            await server.close()

    out = asyncio.run(scenario())
    assert out["metrics"].startswith(b"HTTP/1.1 200 OK") and b"ttserve_example_total 3.0" in out["metrics"]
    assert out["health"].startswith(b"HTTP/1.1 200") and out["health"].endswith(b'{"ok": true}\n')
    assert out["ready"].startswith(b"HTTP/1.1 503") and b'"reason": "warming up"' in out["ready"]
    assert out["head"].startswith(b"HTTP/1.1 200") and out["head"].endswith(b"\r\n\r\n")
    assert out["post"].startswith(b"HTTP/1.1 405")
    assert out["missing"].startswith(b"HTTP/1.1 404") and b"/metrics" in out["missing"]
    assert out["garbage"].startswith(b"HTTP/1.1 400")
    assert out["ready_later"].startswith(b"HTTP/1.1 200")


def test_a_busy_port_fails_with_the_address():
    async def scenario() -> None:
        port = free_port()
        endpoints = OpsEndpoints(CollectorRegistry(), lambda: (True, ""), lambda: (True, ""))
        first = await start_ops_server("127.0.0.1", port, endpoints, "test")
        try:
            with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
                await start_ops_server("127.0.0.1", port, endpoints, "test")
        finally:
            await first.close()

    asyncio.run(scenario())


def value(metrics: ControlMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_request_timings_follow_the_tokens_as_they_arrive():
    m = ControlMetrics()
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), received_time=10.0)
    r.record_scheduled(10.5)
    r.record_scheduled(10.7)       # only the first send counts
    r.output_token_ids = [7]
    m.progressed(r, r.record_tokens(11.0), "w0")
    r.output_token_ids += [8, 9]   # a pipelined pair arrives together
    m.progressed(r, r.record_tokens(12.0), "w0")
    assert r.record_tokens(12.5) == 0  # nothing new: nothing to count
    r.status, r.finish_reason = RequestStatus.FINISHED, FinishReason.LENGTH
    m.finished(r, 12.0)
    assert value(m, "ttserve_time_to_first_token_seconds_sum") == 1.0
    assert value(m, "ttserve_request_queue_time_seconds_sum") == 0.5
    assert value(m, "ttserve_request_prefill_time_seconds_sum") == 0.5
    assert (sum(m.itl.counts), m.itl.sum) == (2, 1.0)   # exported with the engine's state
    assert value(m, "ttserve_request_time_per_output_token_seconds_sum") == 0.5
    assert value(m, "ttserve_request_decode_time_seconds_sum") == 1.0
    assert value(m, "ttserve_e2e_request_latency_seconds_sum") == 2.0
    assert (m.prompt_tokens["w0"], m.generation_tokens["w0"]) == (3, 3)
    assert value(m, "ttserve_request_success_total", finished_reason="length") == 1


def test_lane_counters_survive_the_lane_group_being_rebuilt():
    def lane_group(queries: int, hits: int, preemptions: int) -> LaneGroup:
        scheduler = Scheduler(SchedulerConfig(2, 16, 64), BlockPool(16, 4, enable_caching=True))
        scheduler.pool.record_query(queries, hits)
        scheduler.num_preemptions = preemptions
        return LaneGroup([scheduler])

    g = WorkerGroup(0, "w:0", EngineConfig(workers=(WorkerSpec("w:0", "w:0"),)))
    g.lane_group = lane_group(5, 2, 1)
    assert g.totals() == LaneTotals(20, 8, 1)          # tokens = blocks x block size
    g._retired.add(g.lane_group)                            # what a reconnect does
    g.lane_group = lane_group(1, 1, 0)
    assert g.totals() == LaneTotals(24, 12, 1)


def test_token_histogram_exports_cumulative_buckets_like_prometheus_client():
    from prometheus_client import Histogram

    from ttserve.control.metrics import TokenHistogram

    buckets = (0.1, 0.5, 1.0)
    ours = TokenHistogram("ours_seconds", "Ours.", buckets)
    registry = CollectorRegistry()
    theirs = Histogram("theirs_seconds", "Theirs.", buckets=buckets, registry=registry)
    for value, times in ((0.05, 1), (0.1, 2), (0.7, 1), (3.0, 1)):   # 0.1 sits on a bound: le is <=
        ours.observe(value, times)
        for _ in range(times):
            theirs.observe(value)
    exported = {(s.name, s.labels.get("le")): s.value for s in ours.family().samples}
    for le in ("0.1", "0.5", "1.0", "+Inf"):
        assert exported["ours_seconds_bucket", le] == registry.get_sample_value(
            "theirs_seconds_bucket", {"le": le})
    assert exported["ours_seconds_count", None] == 5
    assert exported["ours_seconds_sum", None] == pytest.approx(registry.get_sample_value("theirs_seconds_sum"))


def test_requests_a_step_finished_before_a_fault_in_its_update_still_reach_their_clients():
    from ttserve.control.engine import Engine
    from ttserve.control.wire import WorkerDescription

    async def scenario() -> None:
        engine = Engine(EngineConfig(workers=(WorkerSpec("w0", "w:0"),), reconnect_interval_s=3600))
        client, queue = engine.open_session()
        done = Request("done", [1, 2, 3], SamplingParams(max_tokens=4))
        done.client_id = client
        warm = WorkerDescription("w", "torch", "cpu", "/m", "X", 100, 64, [2], True, True,
                                 single_execute_lanes=True, num_blocks_per_lane=16, block_size=4)
        worker = engine.workers[0]

        async def connect(num_workers=1):
            return Warm(warm, plan_warmup(engine.config, warm, num_workers))

        async def steps():
            engine.requests["done"] = done
            done.finish(FinishReason.LENGTH)  # what an update did before it raised
            raise KeyError("a fault later in the same update")
            yield

        async def close():
            pass

        worker.connect, worker.steps, worker.close = connect, steps, close
        task = asyncio.create_task(engine.run())
        message = await asyncio.wait_for(queue.get(), 10)
        assert [o.request_id for o in message.outputs] == ["done"]
        assert message.outputs[0].finish_reason and "done" not in engine.requests
        task.cancel()

    asyncio.run(scenario())


def test_a_fault_in_one_workers_loop_takes_only_its_link_and_its_requests_move():
    """An unexpected exception in a worker's step loop (here a KeyError from its results) is
    that worker's failure: its requests migrate to the other worker, it reconnects, and the
    engine goes on (no zombie: nothing cancelled, `fatal` unset)."""
    from ttserve.control.engine import Engine
    from ttserve.control.worker_group import Stepped
    from ttserve.control.wire import WorkerDescription

    async def scenario() -> None:
        engine = Engine(EngineConfig(workers=(WorkerSpec("w0", "w:0"), WorkerSpec("w1", "w:1")),
                                     reconnect_interval_s=0.01))
        connects = {0: 0, 1: 0}
        warm = WorkerDescription("w", "torch", "cpu", "/m", "X", 100, 64, [2], True, True,
                                 single_execute_lanes=True, num_blocks_per_lane=16, block_size=4)

        for worker in engine.workers.values():
            async def connect(num_workers=1, worker=worker):
                connects[worker.index] += 1
                return Warm(warm, plan_warmup(engine.config, warm, num_workers))

            async def steps(worker=worker):
                if worker.index == 0 and connects[0] == 1:
                    worker.lane_group.lanes[0].add(held)   # what it held when the fault came
                    engine.requests["r"] = held
                    raise KeyError("a result without the token of request r")
                await asyncio.sleep(3600)  # serves, with nothing to report
                yield Stepped(0, [])

            async def close():
                pass

            worker.connect, worker.steps, worker.close = connect, steps, close

        held = Request("r", [1, 2, 3], SamplingParams(max_tokens=4))
        task = asyncio.create_task(engine.run())
        while not all(w.ready for w in engine.workers.values()) or connects[0] < 2:
            await asyncio.sleep(0.01)
        assert held.num_migrations == 1 and held in engine.workers[held.worker].lane_group.lanes[0].waiting
        assert not held.is_finished and not engine.fatal.done() and not task.done()
        task.cancel()

    asyncio.run(scenario())


def test_a_grammar_that_compiles_while_its_request_migrates_makes_it_schedulable_where_it_lands():
    """Issue 22 item 3: the request waits aside while its grammar compiles; its worker is lost
    meanwhile and the request migrates. The compiled grammar must stay with the request (it was
    delivered to the lost worker's lane and dropped: the request never became ready, its stream
    hung holding a queue slot); once a worker takes it, it is planned."""
    import threading

    from ttserve.control.engine import Engine
    from ttserve.control.step import StepKind
    from ttserve.control.wire import WorkerDescription
    from ttserve.control.worker_group import WorkerLost
    from ttserve.control.session import Verdict
    from ttserve.control.wire import request_from_pb
    from ttserve.v1 import engine_pb2

    class GatedCompiler:
        def __init__(self) -> None:
            self.gate = threading.Event()

        def compile(self, spec):
            self.gate.wait(30)
            return FakeGrammar()

    class FakeGrammar:
        is_complete = False

        def bitmask(self):
            return None

    async def scenario() -> None:
        engine = Engine(EngineConfig(workers=(WorkerSpec("w0", "w:0"),), reconnect_interval_s=0.01))
        warm = WorkerDescription("w", "torch", "cpu", "/m", "X", 100, 64, [2], True, True,
                                 single_execute_lanes=True, num_blocks_per_lane=16, block_size=4)
        worker = engine.workers[0]
        lose, back = asyncio.Event(), asyncio.Event()
        planned: list = []
        compiler = GatedCompiler()

        async def connect(num_workers=1):
            if worker.index in connected:
                await back.wait()
            connected.add(worker.index)
            return Warm(warm, plan_warmup(engine.config, warm, num_workers))

        async def steps():
            if not planned:
                planned.append(None)
                await lose.wait()
                raise WorkerLost("worker w0 went away", worker.release())
            plan = worker.lane_group.schedule()
            planned.append(plan)
            await asyncio.sleep(3600)
            yield

        async def close():
            pass

        connected: set[int] = set()
        worker.connect, worker.steps, worker.close = connect, steps, close
        task = asyncio.create_task(engine.run())
        while not worker.ready:
            await asyncio.sleep(0.01)
        engine.grammars = compiler
        client, queue = engine.open_session()
        engine.add(*request_from_pb(engine_pb2.AddRequest(
            request_id="g", prompt_token_ids=[1, 2, 3], sampling=engine_pb2.SamplingParams(max_tokens=4),
            structured_output=engine_pb2.StructuredOutput(regex="[ab]+")), client))
        assert (await queue.get()).verdict is Verdict.ACCEPTED
        request = engine.requests["g"]
        assert not request.ready  # compiling
        lose.set()
        while request not in engine._migrating:
            await asyncio.sleep(0.01)
        compiler.gate.set()      # the grammar compiles while the request migrates
        while not request.ready:
            await asyncio.sleep(0.01)
        back.set()               # the worker is back: the request lands on its lane
        while len(planned) < 2:
            await asyncio.sleep(0.01)
        plan = planned[1]
        assert plan.kind is StepKind.PREFILL and [w.request for w in plan.prefill] == [request]
        assert request.grammar is not None and not request.is_finished
        task.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 30))
