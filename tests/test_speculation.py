"""Speculative decoding in the control plane (control/speculation.py, the scheduler's verify rows):
vLLM's --speculative-config for method ngram, its proposals, and the step loop with drafts: the
same tokens as without them, fewer steps where text repeats, stops inside an accepted run, exact
block accounting."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttserve.control.blocks import BlockPool
from ttserve.control.lanes import LaneGroup
from ttserve.control.phase import PhasePolicy
from ttserve.control.request import FinishReason, Request, SamplingParams, TokenLogprobs
from ttserve.control.scheduler import Scheduler, SchedulerConfig
from ttserve.control.speculation import (SpeculativeConfig, SpeculativeConfigError, parse_speculative_config,
                                         propose)
from ttserve.control.step import StepKind

EOS = 2


# ---- the flag ---------------------------------------------------------------------------------
def test_the_flag_is_vllms_json_with_its_defaults():
    assert parse_speculative_config("") is None
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}') == SpeculativeConfig(4, 5, 5)
    assert parse_speculative_config('{"num_speculative_tokens": 3, "prompt_lookup_max": 4}') == SpeculativeConfig(3, 4, 4)
    assert parse_speculative_config('{"num_speculative_tokens": 3, "prompt_lookup_min": 2, '
                                    '"prompt_lookup_max": 6}') == SpeculativeConfig(3, 2, 6)


@pytest.mark.parametrize("text, words", [
    ("ngram", "must be a JSON object"),
    ("[1]", "must be a JSON object"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "'eagle' is not supported"),
    ('{"model": "/drafts/tiny", "num_speculative_tokens": 2}', "is not supported"),
    ('{"method": "ngram"}', "needs num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "needs num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}',
     "draft_tensor_parallel_size not supported"),
])
def test_a_config_it_cannot_serve_is_refused_saying_what_is_allowed(text, words):
    with pytest.raises(SpeculativeConfigError, match=words):
        parse_speculative_config(text)


# ---- proposals --------------------------------------------------------------------------------
CONFIG = SpeculativeConfig(3, 1, 3)


def test_the_longest_ngram_is_matched_at_its_first_occurrence():
    assert propose([1, 2, 3, 4, 5, 1, 2, 3], CONFIG, 3) == [4, 5, 1]
    # [2, 3] occurs twice before the end: the first occurrence proposes what followed it.
    assert propose([2, 3, 7, 2, 3, 8, 2, 3], CONFIG, 2) == [7, 2]
    # The 3-gram [9, 2, 3] is absent; the 2-gram [2, 3] matches.
    assert propose([1, 2, 3, 4, 5, 9, 2, 3], CONFIG, 3) == [4, 5, 9]
    assert propose([1, 2, 3], CONFIG, 3) == []        # nothing earlier matches
    assert propose([7, 7, 7], CONFIG, 3) == [7]        # what follows runs to the end
    assert propose([1, 2, 1, 2], CONFIG, 0) == []


def test_a_match_across_token_boundaries_is_not_a_match():
    # As bytes, 0x00000100 followed by 0x00000002 contains the word 0x00010000 at no word
    # boundary: only whole tokens match.
    tokens = [256, 2, 65536 * 256, 7, 65536]
    assert propose(tokens, SpeculativeConfig(2, 1, 1), 2) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.integers(1, 4), st.integers(1, 3),
       st.integers(0, 3))
def test_proposals_equal_a_plain_search(tokens, k, low, extra):
    config = SpeculativeConfig(k, low, low + extra)
    expected: list[int] = []
    for n in range(min(config.prompt_lookup_max, len(tokens) - 1), config.prompt_lookup_min - 1, -1):
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tokens[-n:]]
        if starts:
            expected = tokens[starts[0] + n:starts[0] + n + k]
            break
    assert propose(tokens, config, k) == (expected if len(tokens) > config.prompt_lookup_min else [])


# ---- the step loop with drafts ------------------------------------------------------------------
PATTERN = [11, 12, 13, 14, 15, 16, 17]


def truth(tokens: list[int]) -> int:
    """The fake model's greedy next token: the pattern continues, except after every 20th token."""
    n = len(tokens)
    return 30 + n % 5 if n % 20 == 0 else PATTERN[(PATTERN.index(tokens[-1]) + 1) % len(PATTERN)] \
        if tokens[-1] in PATTERN else PATTERN[0]


def lane(speculative: SpeculativeConfig | None, num_blocks: int = 64) -> LaneGroup:
    config = SchedulerConfig(4, 64, 128, speculative=speculative)
    return LaneGroup([Scheduler(config, BlockPool(num_blocks, 4))], PhasePolicy(2))


def run(g: LaneGroup, requests: list[Request]) -> int:
    """Steps until every request ends, answering each verify row as a greedy model would: the
    drafts agreeing with `truth`, then truth's next token. Returns the steps taken."""
    for r in requests:
        g.lanes[0].add(r)
    steps = 0
    while g.has_work:
        steps += 1
        assert steps < 1000
        plan = g.schedule()
        sampled, accepted = {}, {}
        for p in plan.lanes:
            for w in p.prefill:
                if w.sample:
                    sampled[w.request.request_id] = truth(w.request.all_token_ids)
            for w in p.decode:
                assert w.token_id is not None, "verify steps are never pipelined"
                tokens = w.request.all_token_ids
                count = 0
                for draft in w.draft_token_ids:
                    if truth(tokens) != draft:
                        break
                    tokens = tokens + [draft]
                    count += 1
                sampled[w.request.request_id], accepted[w.request.request_id] = truth(tokens), count
        g.update(plan, sampled, accepted=accepted)
        g.lanes[0].pool.check()
    assert g.lanes[0].pool.num_free == g.lanes[0].pool.num_blocks
    return steps


def make(rid: str, max_tokens: int, prompt: list[int] | None = None, **sampling) -> Request:
    return Request(rid, prompt or PATTERN * 2, SamplingParams(max_tokens=max_tokens, eos_token_ids=frozenset({EOS}),
                                                              **sampling))


def test_drafts_change_no_token_and_save_steps_where_text_repeats():
    plain = [make(str(i), 40 + i) for i in range(3)]
    spec = [make(str(i), 40 + i) for i in range(3)]
    plain_steps = run(lane(None), plain)
    g = lane(SpeculativeConfig(4, 1, 3))
    spec_steps = run(g, spec)
    assert [r.output_token_ids for r in spec] == [r.output_token_ids for r in plain]
    assert all(r.finish_reason is FinishReason.LENGTH for r in spec)
    assert spec_steps * 2 < plain_steps
    tally = g.lanes[0].spec
    assert tally.drafts > 0 and 0 < tally.accepted_tokens <= tally.draft_tokens
    assert tally.accepted_per_position[0] >= tally.accepted_per_position[-1]


def test_max_tokens_inside_an_accepted_run_ends_there_and_drafts_never_pass_it():
    r = make("a", 7)
    run(lane(SpeculativeConfig(4, 1, 3)), [r])
    assert len(r.output_token_ids) == 7 and r.finish_reason is FinishReason.LENGTH


def test_a_stop_token_inside_an_accepted_run_ends_the_request_on_it():
    plain, spec = make("a", 30, stop_token_ids=frozenset({14})), make("a", 30, stop_token_ids=frozenset({14}))
    run(lane(None), [plain])
    run(lane(SpeculativeConfig(4, 1, 3)), [spec])
    assert spec.output_token_ids == plain.output_token_ids and spec.output_token_ids[-1] == 14
    assert spec.finish_reason is FinishReason.STOP and spec.stop_token_id == 14


def test_requests_whose_sampling_reads_more_than_the_logits_get_no_drafts():
    g = lane(SpeculativeConfig(4, 1, 3))
    penalised = make("p", 10, presence_penalty=0.5)
    held = make("m", 10, min_tokens=5)
    logprobs = make("l", 10, logprobs=2)
    for r in (penalised, held, logprobs):
        g.lanes[0].add(r)
    step = g.schedule()
    sampled = {w.request.request_id: truth(w.request.all_token_ids) for w in step.lanes[0].prefill}
    g.update(step, sampled, logprobs={"l": TokenLogprobs([sampled["l"]], [0.0], 1)})
    plan = g.schedule()
    assert plan.kind is StepKind.DECODE
    drafts = {w.request.request_id: w.draft_token_ids for w in plan.lanes[0].decode}
    assert drafts["p"] == [] and drafts["m"] == [] and drafts["l"]


def test_speculation_never_pipelines_decode_steps():
    g = lane(SpeculativeConfig(4, 1, 3))
    g.lanes[0].add(make("a", 20))
    plan = g.schedule()
    g.update(plan, {"a": truth(plan.lanes[0].prefill[0].request.all_token_ids)})
    decode = g.schedule()
    assert decode.kind is StepKind.DECODE and g.lanes[0].pipelined_rows(decode.lanes[0]) is None
