"""Scheduling through the real services: greedy output is unchanged by preemption (forced by a
tiny KV pool) and by prefix-cache hits, and the hits are reported to the client."""
from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from stack import Stack, start_stack

pytestmark = pytest.mark.e2e

BLOCK = 16
# 12 blocks of 16 tokens: four requests of 14 + 64 tokens each (5 blocks) cannot all fit.
BYTES_PER_BLOCK = 30 * 2 * 3 * BLOCK * 64 * 4  # SmolLM2: layers x (K, V) x kv heads x block x dim x fp32
NUM_BLOCKS = 12
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm2) -> Stack:
    s = start_stack(tmp_path_factory.mktemp("sched"), str(smollm2),
                    control_flags=("--max-num-seqs", "4", "--enable-prefix-caching",
                                   "--max-num-batched-tokens", "32"),
                    # float32: the oracle is transformers in float32, and BYTES_PER_BLOCK is.
                    # One torch thread: SmolLM2's steps are too small to split, and on a shared
                    # 2-core machine a second thread waiting for its core made them 3x slower.
                    worker_flags=("--dtype", "float32", "--block-size", str(BLOCK), "--num-threads", "1",
                                  "--kv-cache-memory-bytes", str(NUM_BLOCKS * BYTES_PER_BLOCK)))
    yield s
    s.stop()


def first_non_greedy_token(model, prompts: list[list[int]], outputs: list[list[int]]) -> list[int | None]:
    """Per request, the index of the first output token that is not transformers' greedy choice
    after the prompt and the outputs before it (None: every one is). Teacher-forced: one forward
    pass over each prompt + output instead of generating token by token; an output is greedy
    exactly when each of its tokens is the argmax after its prefix."""
    rows = [ids + out for ids, out in zip(prompts, outputs)]
    assert len({len(r) for r in rows}) == 1, "one batch without padding: equal lengths"
    with torch.inference_mode():
        choices = model(torch.tensor(rows)).logits.argmax(-1)
    firsts = []
    for row, (ids, out) in enumerate(zip(prompts, outputs)):
        greedy = choices[row, len(ids) - 1:len(ids) - 1 + len(out)].tolist()
        firsts.append(next((t for t, (a, b) in enumerate(zip(out, greedy)) if a != b), None))
    return firsts


def test_preemption_by_kv_pressure_keeps_greedy_output_exact(stack, smollm2, hf_smollm2):
    tokenizer, model = hf_smollm2
    prompts = [tokenizer(f"Item {i}: a list of animals that live in the sea:")["input_ids"] for i in range(4)]
    client = openai.AsyncOpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)

    async def one(ids):
        out = await client.completions.create(model=smollm2.name, prompt=ids, max_tokens=NEW_TOKENS,
                                              temperature=0,
                                              extra_body={"return_token_ids": True, "ignore_eos": True})
        return out.choices[0].token_ids

    async def run():
        return await asyncio.gather(*(one(ids) for ids in prompts))

    outputs = asyncio.run(run())
    assert "preempted request" in stack.services[1].output(), "the KV pool was meant to force preemption"
    assert [len(out) for out in outputs] == [NEW_TOKENS] * len(prompts)
    assert first_non_greedy_token(model, prompts, outputs) == [None] * len(prompts)


def test_prefix_cache_hit_is_reported_and_changes_nothing(client, smollm2):
    prompt = ("You are a careful assistant. Answer in one short sentence. " * 6) + "What is a lighthouse?"
    kw = dict(model=smollm2.name, messages=[{"role": "user", "content": prompt}], max_tokens=16,
              temperature=0, extra_body={"return_token_ids": True})
    first = client.chat.completions.create(**kw)
    second = client.chat.completions.create(**kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Whole blocks only, and never the last prompt token (its logits are needed to sample).
    assert cached == (second.usage.prompt_tokens - 1) // BLOCK * BLOCK and cached >= 4 * BLOCK
    assert second.choices[0].token_ids == first.choices[0].token_ids
