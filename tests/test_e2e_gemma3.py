"""Gemma 3 end to end: openai client -> gateway -> control plane -> worker (the torch Gemma 3), on
the tiny random-weight checkpoint (worker/planning/tiny_gemma3.py: a 16-token window, local and
global layers).

The oracle is transformers' generate on the same checkpoint: greedy tokens identical, for prompts
and answers that run far past the window. The control plane's prefill budget of 16 tokens serves
every prompt in chunks, and concurrent requests decode together.

The worker runs hybrid KV cache groups (worker/kv_groups.py: the two global layers in one group,
the four local ones in two): its KV budget is 40 blocks of 16 tokens and two layers each
(KV_BYTES), where one table for all six layers would hold 13 blocks, 208 tokens. Prefix caching
is on: a hit resumes each local group from the blocks its window reads there.
"""
from __future__ import annotations

import concurrent.futures

import pytest
import torch

from stack import Stack, start_stack

pytestmark = pytest.mark.e2e

NEW_TOKENS = 40
# 40 blocks of 16 tokens x 2 layers x (K, V) x 2 heads x 16 dims x 4 bytes (float32).
BLOCK_BYTES = 16 * 2 * 2 * 2 * 16 * 4
KV_BYTES = 40 * BLOCK_BYTES
TEXT = ("The history of the Roman Empire began when the city of Rome, founded on seven hills by the twins "
        "Romulus and Remus, grew from a small village into the capital of an empire that spanned three "
        "continents and lasted for more than a thousand years, until its last emperor was deposed.")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_gemma3) -> Stack:
    s = start_stack(tmp_path_factory.mktemp("gemma3"), str(tiny_gemma3),
                    control_flags=("--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--enable-prefix-caching"),
                    # The oracle is transformers in float32: the worker computes in it too.
                    worker_flags=("--dtype", "float32", "--block-size", "16", "--kv-cache-memory-bytes", str(KV_BYTES)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf(hf_tiny_gemma3):
    return hf_tiny_gemma3


def greedy(model, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    """transformers' n greedy tokens; the prompts are chosen so that none ends early (no end of
    sequence to stop at or to mask: ignore_eos serves the same tokens)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    assert len(out) == n, out
    return out


def test_models_lists_the_tiny_gemma3(client, tiny_gemma3):
    assert [m.id for m in client.models.list().data] == [tiny_gemma3.name]


def test_greedy_completions_past_the_window_are_transformers_token_for_token(client, model_name, hf):
    """Three prompts of 40, 34 and 47 tokens at once, 40 tokens each: 80+ positions over a
    16-token window."""
    tokenizer, model = hf
    ids = tokenizer(TEXT)["input_ids"]
    prompts = [ids[:40], ids[3:37], ids[1:48]]
    expected = [greedy(model, p) for p in prompts]

    def complete(prompt: list[int]) -> list[int]:
        out = client.completions.create(model=model_name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
        assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == NEW_TOKENS
        return out.choices[0].token_ids

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(complete, prompts)) == expected


def test_chat_greedy_matches_transformers_with_the_chat_template(client, model_name, hf):
    tokenizer, model = hf
    messages = [{"role": "user", "content": "Tell me, in some detail, how the seven hills of Rome were settled."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(ids) > 32  # past the window before the answer starts
    expected = greedy(model, ids, 24)
    out = client.chat.completions.create(model=model_name, messages=messages, max_tokens=24, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
    assert out.usage.prompt_tokens == len(ids)
    assert out.choices[0].token_ids == expected


def test_sliding_layers_hold_only_their_window_so_one_lane_serves_past_a_single_tables_reach(
        client, model_name, hf, stack):
    """A single table for all six layers: 40 * 2 / 6 = 13 blocks, 208 tokens. Hybrid groups: the
    global group takes a block per 16 tokens, each local group at most 3 (its 16-token window
    and a 16-token chunk), so one lane holds a (40 - 6) * 16 = 544-token sequence, and
    max_model_len (the model's 1024) is lowered to that. A 500-token request is transformers'
    greedy tokens, its local layers' early blocks long given back."""
    tokenizer, model = hf
    served = client.models.list().data[0]
    assert served.model_extra["max_model_len"] == 544
    ids = (tokenizer(TEXT)["input_ids"] * 8)[:300]
    expected = greedy(model, ids, 200)
    out = client.completions.create(model=model_name, prompt=ids, max_tokens=200, temperature=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    assert out.choices[0].token_ids == expected
    log = stack.services[1].log_path.read_text()
    assert "shared by 3 KV groups (1 full attention, 2 sliding window of 16 tokens)" in log, log[-2000:]


def test_a_prefix_hit_resumes_the_local_layers_from_their_window(client, model_name, hf):
    """The same 100-token prompt twice: the second resumes at 96 from the cache. There the global
    group holds all six blocks; each local group only block 5 (its window reads 81..95), the
    first five entries skipped. Its tokens are transformers' greedy ones, as the first's."""
    tokenizer, model = hf
    ids = (tokenizer(TEXT)["input_ids"] * 3)[5:105]
    expected = greedy(model, ids, 30)
    replies = [client.completions.create(model=model_name, prompt=ids, max_tokens=30, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
               for _ in range(2)]
    assert [r.choices[0].token_ids for r in replies] == [expected, expected]
    assert [r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
            for r in replies] == [0, 96]
