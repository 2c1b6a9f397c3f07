"""Speculative decoding end to end: openai client -> gateway -> control plane (n-gram drafts,
--speculative-config) -> worker (verify steps on the torch SmolLM2), against the same stack
without it. Greedy output is identical token for token: copying answers (where drafts are
accepted), stop strings and max_tokens landing inside an accepted run, logprobs of accepted
tokens, and a request whose worker is SIGKILLed mid-run. The workers run bf16 with
--batch-invariant, under which identity holds by construction."""
from __future__ import annotations

import concurrent.futures
import json
import signal

import openai
import pytest

from stack import Stack, metric, start_stack
from ttserve.control_client import ControlClient
from ttserve.v1 import engine_pb2

pytestmark = pytest.mark.e2e

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
# bf16 with batch invariance: a verify row's logits are the bits the single-token decode (or a
# migrated request's re-prefill) computes for that position, so greedy output is identical by
# construction, not by the luck of no near-tie (without it, bf16 GEMMs of 1 + k rows round
# otherwise than GEMMs of 1 and flip near-ties; float32's plain GEMMs differ too, less often).
WORKER_FLAGS = ("--dtype", "bfloat16", "--batch-invariant")
TEXT = ("The lighthouse stood on the northern cliff for two hundred years. Every night the keeper climbed the "
        "one hundred and twelve steps, trimmed the wick, polished the great lens and watched the ships pass.")
COPY = [f"Repeat the following text exactly:\n\n{TEXT}", f"Quote this passage in full:\n\n{TEXT}",
        "Copy this list and keep its order: apples, pears, plums, apples, pears, plums, apples, pears."]


@pytest.fixture(scope="module")
def stacks(tmp_path_factory, smollm2):
    plain = start_stack(tmp_path_factory.mktemp("plain"), str(smollm2), worker_flags=WORKER_FLAGS)
    spec = start_stack(tmp_path_factory.mktemp("spec"), str(smollm2), worker_flags=WORKER_FLAGS,
                       control_flags=("--speculative-config", SPEC))
    yield plain, spec
    plain.stop()
    spec.stop()


def clients(stacks: tuple[Stack, Stack]) -> tuple[openai.OpenAI, openai.OpenAI]:
    return tuple(openai.OpenAI(base_url=f"{s.http_url}/v1", api_key="unused", max_retries=0) for s in stacks)


def chat(client: openai.OpenAI, model: str, content: str, **kw) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          temperature=0, extra_body={"return_token_ids": True}, **kw)


def test_copying_answers_are_identical_and_drafts_are_accepted(stacks, smollm2):
    plain, spec = clients(stacks)
    model = plain.models.list().data[0].id

    def both(prompt: str) -> tuple[list[int], list[int]]:
        return tuple(chat(c, model, prompt, max_tokens=96).choices[0].token_ids for c in (plain, spec))

    with concurrent.futures.ThreadPoolExecutor(len(COPY)) as pool:
        for expected, got in pool.map(both, COPY):
            assert got == expected
    accepted = metric(stacks[1].control_metrics_url, "ttserve_spec_decode_num_accepted_tokens_total")
    proposed = metric(stacks[1].control_metrics_url, "ttserve_spec_decode_num_draft_tokens_total")
    assert 0 < accepted <= proposed
    assert metric(stacks[0].control_metrics_url, "ttserve_spec_decode_num_draft_tokens_total") == 0


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7, 11])
def test_max_tokens_inside_an_accepted_run_ends_exactly_there(stacks, max_tokens):
    plain, spec = clients(stacks)
    model = plain.models.list().data[0].id
    replies = [chat(c, model, COPY[2], max_tokens=max_tokens) for c in (plain, spec)]
    assert replies[1].choices[0].message.content == replies[0].choices[0].message.content
    assert replies[1].usage.completion_tokens == replies[0].usage.completion_tokens <= max_tokens
    assert replies[1].choices[0].finish_reason == replies[0].choices[0].finish_reason


def test_a_stop_string_inside_an_accepted_run_cuts_the_same_text(stacks):
    plain, spec = clients(stacks)
    model = plain.models.list().data[0].id
    replies = [chat(c, model, COPY[0], max_tokens=96, stop=["polished"]) for c in (plain, spec)]
    texts = [r.choices[0].message.content for r in replies]
    assert texts[1] == texts[0] and replies[1].choices[0].finish_reason == replies[0].choices[0].finish_reason


def test_logprobs_of_accepted_tokens_are_those_of_plain_decoding(stacks):
    plain, spec = clients(stacks)
    model = plain.models.list().data[0].id
    replies = [chat(c, model, COPY[0], max_tokens=48, logprobs=True, top_logprobs=2) for c in (plain, spec)]
    expected, got = (r.choices[0].logprobs.content for r in replies)
    assert [t.token for t in got] == [t.token for t in expected]
    for e, g in zip(expected, got):
        assert g.logprob == e.logprob  # the same logits, to the bit
        assert [t.token for t in g.top_logprobs] == [t.token for t in e.top_logprobs]


def test_a_request_whose_worker_is_killed_mid_run_finishes_with_the_same_tokens(tmp_path, smollm2, hf_smollm2):
    from test_e2e_migration import rest, stream
    tokenizer, _ = hf_smollm2
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": COPY[0]}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    stack = start_stack(tmp_path, str(smollm2), gateway=False, workers=2, worker_flags=WORKER_FLAGS,
                        control_flags=("--speculative-config", SPEC))
    client = ControlClient(stack.control_address)
    try:
        client.add("reference", prompt, 64, eos_token_ids=())
        reference = client.collect({"reference"})["reference"]
        assert reference.placements == {(0, 0)}
        client.add("moved", prompt, 64, eos_token_ids=())
        head = stream(client, "moved", 12)
        assert head.placements == {(0, 0)} and not head.finish_reason
        stack.services[0].stop(signal.SIGKILL)
        result = rest(client, "moved", head)
        assert result.finish_reason == engine_pb2.FinishReason.FINISH_REASON_LENGTH, result.error
        assert result.token_ids == reference.token_ids and (1, 0) in result.placements
        assert metric(stack.control_metrics_url, "ttserve_spec_decode_num_accepted_tokens_total") > 0
    finally:
        client.close()
        stack.stop()
