"""Structured outputs: the control plane's grammars (llguidance with the model's tokenizer), the
scheduler's use of them, and the worker's bitmask on the logits."""
from __future__ import annotations

import json

import pytest
import torch

from ttserve.control.grammar import GrammarCompiler, GrammarError, GrammarSpec
from ttserve.control.request import FinishReason, Request, RequestStatus, SamplingParams
from lane_of_one import LaneOfOne
from ttserve.control.scheduler import Scheduler, SchedulerConfig
from ttserve.control.blocks import BlockPool
from ttserve.control.phase import PhasePolicy
from ttserve.control.step import StepKind
from ttserve.control.wire import request_from_pb, step_batch_to_pb
from ttserve.v1 import engine_pb2
from ttserve.worker.sampling import SamplingBatch, bitmask_allowed, sample

EOS = 2


@pytest.fixture(scope="module")
def compiler(smollm2) -> GrammarCompiler:
    config = json.loads((smollm2 / "config.json").read_text())
    return GrammarCompiler(smollm2, config["vocab_size"], [EOS])


def allowed(grammar, vocab: int) -> set[int]:
    return set(bitmask_allowed(grammar.bitmask(), vocab).nonzero().flatten().tolist())


# ---- worker: the bitmask on the logits ------------------------------------------------------
def mask_of(ids: list[int], vocab: int) -> bytes:
    words = [0] * ((vocab + 31) // 32)
    for i in ids:
        words[i // 32] |= 1 << (i % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)


def test_bitmask_bits_are_little_endian_int32_words_and_ids_past_the_end_are_banned():
    assert bitmask_allowed(mask_of([0, 31, 33, 40], 64), 64).nonzero().flatten().tolist() == [0, 31, 33, 40]
    assert bitmask_allowed(mask_of([1], 32), 40).nonzero().flatten().tolist() == [1]


def test_bitmask_rows_sample_only_allowed_tokens_and_leave_other_rows_alone():
    logits = torch.randn(3, 100)
    masks = [mask_of([5, 17], 100), None, mask_of([99], 100)]
    greedy = sample(logits, SamplingBatch([0.0] * 3, [0] * 3, [1.0] * 3, bitmasks=masks))
    assert greedy[0].item() == (5 if logits[0, 5] > logits[0, 17] else 17)
    assert greedy[1].item() == logits[1].argmax().item()
    assert greedy[2].item() == 99
    for seed in range(20):
        hot = sample(logits, SamplingBatch([2.0] * 3, [0] * 3, [1.0] * 3,
                                           generators=[torch.Generator().manual_seed(seed)] * 3, bitmasks=masks))
        assert hot[0].item() in (5, 17) and hot[2].item() == 99


# ---- control plane: grammars ----------------------------------------------------------------
def test_regex_grammar_allows_its_tokens_and_completes(compiler):
    grammar = compiler.compile(GrammarSpec("regex", "(yes|no)"))
    tokens = compiler.tokenizer.tokenize_str("yes")
    for token in tokens:
        assert token in allowed(grammar, compiler.vocab_size)
        assert grammar.accept(token)
    assert grammar.is_complete and allowed(grammar, compiler.vocab_size) == {EOS}


def test_a_token_outside_the_grammar_is_refused(compiler):
    grammar = compiler.compile(GrammarSpec("choice", '["alpha", "beta"]'))
    bad = compiler.tokenizer.tokenize_str("zzz")[0]
    assert bad not in allowed(grammar, compiler.vocab_size)
    assert not grammar.accept(bad) and grammar.error


def test_json_is_compact_unless_whitespace_is_flexible(compiler):
    space_tokens = set(compiler.tokenizer.tokenize_str(" ")) | set(compiler.tokenizer.tokenize_str("\n"))
    for flexible in (False, True):
        grammar = compiler.compile(GrammarSpec("json_object", "", whitespace_flexible=flexible))
        assert grammar.accept(compiler.tokenizer.tokenize_str("{")[0])
        assert bool(space_tokens & allowed(grammar, compiler.vocab_size)) is flexible


@pytest.mark.parametrize("spec", [GrammarSpec("regex", "(("), GrammarSpec("json", "{not json"),
                                  GrammarSpec("grammar", "start: undefined_rule"),
                                  GrammarSpec("xml", "<a/>")])
def test_invalid_specs_raise_a_grammar_error_that_names_the_kind(compiler, spec):
    with pytest.raises(GrammarError, match=spec.kind):
        compiler.compile(spec)


def test_missing_tokenizer_is_a_grammar_error(tmp_path):
    with pytest.raises(GrammarError, match="--tokenizer"):
        GrammarCompiler(tmp_path, 100, [EOS]).compile(GrammarSpec("regex", "a"))


def test_structured_output_travels_from_the_add_request():
    add = engine_pb2.AddRequest(request_id="r", prompt_token_ids=[1, 2],
                                sampling=engine_pb2.SamplingParams(max_tokens=4),
                                structured_output=engine_pb2.StructuredOutput(json='{"type": "object"}'))
    request, _ = request_from_pb(add, client_id=1)
    assert request.grammar_spec == GrammarSpec("json", '{"type": "object"}')
    assert request_from_pb(engine_pb2.AddRequest(request_id="p"), 1)[0].grammar_spec is None


# ---- control plane: the scheduler with grammars ---------------------------------------------
def scheduler() -> LaneOfOne:
    return LaneOfOne(Scheduler(SchedulerConfig(4, 32, 64), BlockPool(64, 4)), PhasePolicy(4))


def grammar_request(compiler, rid: str, spec: GrammarSpec, max_tokens: int = 16) -> Request:
    request = Request(rid, list(range(10, 15)), SamplingParams(max_tokens=max_tokens, eos_token_ids=frozenset({EOS})),
                      grammar_spec=spec)
    request.grammar = compiler.compile(spec)
    return request


def test_grammar_rows_carry_its_bitmask_and_a_complete_grammar_forces_eos(compiler):
    s = scheduler()
    request = grammar_request(compiler, "g", GrammarSpec("regex", "(yes|no)"))
    s.add(request)
    tokens = compiler.tokenizer.tokenize_str("yes")
    for token in tokens:
        plan = s.schedule()
        works = [w for w in plan.prefill if w.sample] + plan.decode
        assert len(works) == 1 and works[0].bitmask == request.grammar.bitmask()
        pb = step_batch_to_pb(1, plan.kind, plan.lanes, 4)
        assert (pb.prefill or pb.decode)[0].token_bitmask == works[0].bitmask
        s.update(plan, {"g": token})
    # Complete: only EOS is allowed, and the request ends on it (as vLLM's engine does).
    plan = s.schedule()
    assert bitmask_allowed(plan.decode[0].bitmask, compiler.vocab_size).nonzero().flatten().tolist() == [EOS]
    s.update(plan, {"g": EOS})
    assert request.finish_reason is FinishReason.STOP and request.status is RequestStatus.FINISHED
    assert request.output_token_ids == tokens + [EOS]


def test_a_token_the_grammar_refuses_ends_the_request_with_an_error(compiler):
    s = scheduler()
    request = grammar_request(compiler, "g", GrammarSpec("regex", "(yes|no)"))
    s.add(request)
    plan = s.schedule()
    s.update(plan, {"g": compiler.tokenizer.tokenize_str("zzz")[0]})
    assert request.finish_reason is FinishReason.ERROR and "does not allow" in request.error


def test_grammar_requests_are_never_pipelined(compiler):
    s = scheduler()
    s.add(grammar_request(compiler, "g", GrammarSpec("regex", "a{1,10}")))
    s.update(prefill := s.schedule(), {"g": compiler.tokenizer.tokenize_str("a")[0]})
    assert prefill.kind is StepKind.PREFILL
    decode = s.schedule()
    assert decode.kind is StepKind.DECODE and s.schedule_ahead(decode) is None


def test_a_compiling_request_waits_aside_without_blocking_the_queue(compiler):
    s = scheduler()
    compiling = grammar_request(compiler, "g", GrammarSpec("regex", "a"))
    compiling.ready = False
    plain = Request("p", [10, 11], SamplingParams(max_tokens=2))
    s.add(compiling)
    s.add(plain)
    plan = s.schedule()
    assert [w.request.request_id for w in plan.prefill] == ["p"]
    s.update(plan, {"p": 7})
    compiling.ready = True
    assert [w.request.request_id for w in s.schedule().prefill] == ["g"]
