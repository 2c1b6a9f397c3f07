"""The worker set's rules without processes: entries, the workers file's edits as the control
plane follows them, and a moved request's --migration-timeout."""
from __future__ import annotations

import asyncio

import pytest

from ttserve.control.engine import Engine, EngineConfig
from ttserve.control.request import FinishReason, Request, SamplingParams
from ttserve.control.worker_set import WorkerSetError, WorkerSpec, combine, follow_file, parse_entry


def test_entries_name_workers_by_name_or_by_address():
    assert parse_entry("w0=host-0.ttserve-worker:50061") == WorkerSpec("w0", "host-0.ttserve-worker:50061")
    assert parse_entry("10.0.0.5:50061") == WorkerSpec("10.0.0.5:50061", "10.0.0.5:50061")
    assert parse_entry("[::1]:50061").address == "[::1]:50061"
    for bad in ("host", "host:0", "host:70000", "=host:1", "bad name=host:1", "w=::1:5"):
        with pytest.raises(WorkerSetError, match="expected HOST:PORT|a worker name"):
            parse_entry(bad)
    with pytest.raises(WorkerSetError, match="given twice"):
        combine([parse_entry("a=h:1"), parse_entry("a=h:2")])
    with pytest.raises(WorkerSetError, match="listed twice"):
        combine([parse_entry("a=h:1"), parse_entry("b=h:1")])
    assert combine([parse_entry("a=h:1"), parse_entry("a=h:1")]) == (WorkerSpec("a", "h:1"),)


def test_the_workers_file_is_applied_once_settled_and_never_emptied(tmp_path):
    path = tmp_path / "workers"
    a, b = WorkerSpec("a", "h:1"), WorkerSpec("b", "h:2")
    applied: list[tuple[WorkerSpec, ...]] = []

    async def scenario() -> None:
        path.write_text("a=h:1\n")
        reread = asyncio.Event()
        task = asyncio.create_task(follow_file(path, (), (a,), applied.append, reread,
                                               poll_s=0.05, settle_s=0.05))
        await asyncio.sleep(0.3)
        assert applied == []                    # unchanged: nothing applied
        path.write_text("a=h:1\nb=h:2  # joins\n")
        await asyncio.sleep(0.3)
        assert applied == [(a, b)]
        for edit in ("", "# every line a comment\n", "a=h:1\nb=h:\n"):  # empty, or half-written
            path.write_text(edit)
            await asyncio.sleep(0.3)
        assert applied == [(a, b)]              # the set stays as it is
        path.unlink()
        await asyncio.sleep(0.3)
        path.write_text("b=h:2\n")
        reread.set()                            # SIGHUP
        await asyncio.sleep(0.3)
        assert applied == [(a, b), (b,)]
        task.cancel()

    asyncio.run(scenario())


def test_a_request_that_moves_again_waits_its_whole_migration_timeout_again():
    async def scenario() -> None:
        engine = Engine(EngineConfig(workers=(), migration_timeout_s=0.4))
        request = Request("r", [1, 2, 3], SamplingParams(max_tokens=4))
        engine.requests["r"] = request
        engine._migrate([request], "worker a lost", handed_off=True)
        await asyncio.sleep(0.3)
        engine._migrating.remove(request)       # placed (what _place_migrating does) ...
        engine._stop_migrating(request)
        engine._migrate([request], "worker b lost")   # ... and lost again
        await asyncio.sleep(0.3)                # past the first move's timeout, within the second's
        assert not request.is_finished and request in engine._migrating
        await asyncio.sleep(0.2)
        assert request.finish_reason is FinishReason.ERROR and "worker b lost" in request.error
        assert request.num_migrations == 1       # the hand-off spent none

    asyncio.run(scenario())
