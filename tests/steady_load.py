"""A steady load on a control plane for fault tests: a fixed number of greedy requests always in
flight, each prompt's tokens checked against an uninterrupted run of the same prompt."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ttserve.control_client import ControlClient, Result
from ttserve.tls import PLAINTEXT, load_tls
from ttserve.v1 import engine_pb2


@dataclass
class Outcome:
    """What the load saw: every request it added, by id, with the prompt it carried."""
    results: dict[str, Result] = field(default_factory=dict)
    prompts: dict[str, int] = field(default_factory=dict)   # request id -> prompt index
    refused: list[str] = field(default_factory=list)        # "id: message" of refused admissions

    def mismatches(self, references: list[Result]) -> list[str]:
        """Requests that did not finish with their prompt's reference tokens (lost, cut, or with
        a token lost or doubled), each with what it got."""
        wrong = []
        for rid, result in self.results.items():
            reference = references[self.prompts[rid]]
            if result.finish_reason != reference.finish_reason or result.token_ids != reference.token_ids:
                wrong.append(f"{rid}: finish {result.finish_reason} error {result.error!r}, "
                             f"{len(result.token_ids)} tokens (reference {len(reference.token_ids)})")
        return wrong + self.refused


class SteadyLoad:
    """`concurrency` requests in flight on `client` from start() to stop(), cycling `prompts`;
    greedy, `max_tokens` each, EOS ignored. One thread reads the session (it owns `client`)."""

    def __init__(self, client: ControlClient, prompts: list[list[int]], max_tokens: int,
                 concurrency: int) -> None:
        self.client, self.prompts, self.max_tokens, self.concurrency = client, prompts, max_tokens, concurrency
        self.outcome = Outcome()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="steady-load", daemon=True)
        self._error: BaseException | None = None
        self._next = 0

    def references(self) -> list[Result]:
        """Each prompt alone, before any fault: the tokens every later run must give."""
        ids = {f"reference-{i}": i for i in range(len(self.prompts))}
        for rid, i in ids.items():
            self.client.add(rid, self.prompts[i], self.max_tokens, eos_token_ids=())
        results = self.client.collect(set(ids))
        return [results[f"reference-{i}"] for i in range(len(self.prompts))]

    def start(self) -> "SteadyLoad":
        self._thread.start()
        return self

    def finished(self) -> int:
        return sum(1 for r in self.outcome.results.values() if r.finish_reason)

    def stop(self, timeout: float = 300) -> Outcome:
        """Add nothing more, wait for what is in flight to finish, and return what was seen."""
        self._stopping.set()
        self._thread.join(timeout)
        if self._error is not None:
            raise self._error
        assert not self._thread.is_alive(), f"requests still unfinished after {timeout:.0f} s"
        return self.outcome

    def _add(self) -> None:
        rid, prompt = f"load-{self._next}", self._next % len(self.prompts)
        self._next += 1
        self.outcome.results[rid], self.outcome.prompts[rid] = Result(), prompt
        self.client.add(rid, self.prompts[prompt], self.max_tokens, eos_token_ids=())

    def _run(self) -> None:
        try:
            in_flight = set()
            while in_flight or not self._stopping.is_set():
                while not self._stopping.is_set() and len(in_flight) < self.concurrency:
                    self._add()
                    in_flight.add(f"load-{self._next - 1}")
                for rid in self._read_once():
                    in_flight.discard(rid)
        except BaseException as e:  # noqa: BLE001 - re-raised by stop() on the test's thread
            self._error = e

    def _read_once(self) -> list[str]:
        """One message's worth of news; returns the ids that ended (finished or refused)."""
        message = self.client.next(timeout=180)
        ended = []
        if message.HasField("admission"):
            a = message.admission
            if a.verdict != engine_pb2.Admission.VERDICT_ACCEPTED:
                self.outcome.refused.append(f"{a.request_id}: refused: {a.message}")
                self.outcome.results.pop(a.request_id, None)
                ended.append(a.request_id)
            return ended
        for out in message.outputs.outputs:
            result = self.outcome.results.get(out.request_id)
            if result is None:
                continue
            if result.take(out):
                ended.append(out.request_id)
        return ended


# Any fixed ids: greedy decoding makes every run of a prompt reproducible.
PROMPTS = [[1, 9690, 314, 253, 1932, 30, 2], [1, 4093, 282, 260, 3575, 284, 2], [1, 504, 3458, 28, 2]]


def main() -> None:
    """The load as its own process, for a control plane the test process cannot reach (one in
    another network namespace): runs until --stop-file exists, reporting to --report (JSON,
    rewritten every half second: finished requests, then the mismatches once stopped)."""
    import argparse
    import json
    import time
    from pathlib import Path

    parser = argparse.ArgumentParser()
    parser.add_argument("--control", required=True)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--stop-file", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--tls", nargs=3, metavar=("CERT", "KEY", "CA"), default=None,
                        help="mutual TLS to a control plane that serves it")
    args = parser.parse_args()

    def report(**fields) -> None:
        args.report.with_suffix(".tmp").write_text(json.dumps(fields))
        args.report.with_suffix(".tmp").replace(args.report)

    client = ControlClient(args.control, load_tls(*args.tls) if args.tls else PLAINTEXT)
    load = SteadyLoad(client, PROMPTS, args.max_tokens, args.concurrency)
    references = load.references()
    load.start()
    while not args.stop_file.exists():
        report(finished=load.finished(), placements=_placements(load.outcome))
        time.sleep(0.5)
    outcome = load.stop()
    report(finished=load.finished(), placements=_placements(outcome), requests=len(outcome.results),
           mismatches=outcome.mismatches(references), stopped=True)
    client.close()


def _placements(outcome: Outcome) -> list[int]:
    """Worker ids that have served some request."""
    return sorted({worker for r in list(outcome.results.values()) for worker, _ in r.placements})


if __name__ == "__main__":
    main()
