"""The whole serving path through real processes: openai client → gateway → control → worker."""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import openai
import pytest
import torch

from stack import Stack, start_stack

pytestmark = pytest.mark.e2e

PROMPTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "Tenstorrent builds AI accelerators. Their chips",
    # Long enough for several prefill chunks at the stack's budget of 16 tokens.
    "The following is a detailed account of the voyage of a small research vessel across the "
    "North Atlantic in winter, written by its captain, who kept a careful log of the weather, the "
    "sea state, the condition of the crew and every repair made to the ship along the way. Day one:",
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm2) -> Stack:
    # A small prefill budget chunks the chat-template prompts, so the oracle tests cover chunking.
    s = start_stack(tmp_path_factory.mktemp("stack"), str(smollm2),
                    control_flags=("--max-num-seqs", "8", "--max-num-batched-tokens", "16"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def hf(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    return tokenizer, model


def chat(client, model_name, content: str, **kw):
    return client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": content}],
                                          temperature=0, **kw)


def test_models_lists_the_served_model(client, smollm2):
    assert [m.id for m in client.models.list().data] == [smollm2.name]


def test_capital_of_france_is_paris(client, model_name):
    answer = chat(client, model_name, "What is the capital of France?", max_tokens=32)
    assert "Paris" in answer.choices[0].message.content


def test_greedy_output_matches_transformers_token_for_token(client, model_name, hf):
    tokenizer, model = hf
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.inference_mode():
            expected = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                      min_new_tokens=32)[0, len(ids):].tolist()
        out = client.completions.create(model=model_name, prompt=ids, max_tokens=32, temperature=0,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
        assert out.choices[0].token_ids == expected, prompt
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 32


def test_chat_greedy_matches_transformers_with_chat_template(client, model_name, hf):
    tokenizer, model = hf
    messages = [{"role": "user", "content": "Write a haiku about silicon."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(ids) > 16  # longer than the stack's prefill budget: served in chunks
    with torch.inference_mode():
        full = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)[0].tolist()
    expected = full[len(ids):]
    out = client.chat.completions.create(model=model_name, messages=messages, max_tokens=40, temperature=0,
                                         extra_body={"return_token_ids": True})
    generated = out.choices[0].token_ids
    # transformers keeps the EOS it stopped on; the API reports it as the finish, not as text.
    assert generated == expected[:len(generated)] and len(expected) - len(generated) in (0, 1)
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(generated)


def test_streaming_and_non_streaming_agree(client, model_name):
    whole = chat(client, model_name, "Name three colors.", max_tokens=24)
    chunks = chat(client, model_name, "Name three colors.", max_tokens=24, stream=True,
                  stream_options={"include_usage": True})
    text, usage, finish = "", None, None
    for chunk in chunks:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_concurrent_requests_match_their_sequential_outputs(stack, model_name):
    """Batched decode over paged KV gives each request exactly what it gets alone."""
    client = openai.AsyncOpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)
    prompts = [f"Count from {i} to {i + 10}:" for i in range(8)]

    async def one(prompt: str) -> str:
        out = await client.completions.create(model=model_name, prompt=prompt, max_tokens=20, temperature=0)
        return out.choices[0].text

    async def run() -> tuple[list[str], list[str]]:
        alone = [await one(p) for p in prompts]
        together = await asyncio.gather(*(one(p) for p in prompts))
        return alone, list(together)

    alone, together = asyncio.run(run())
    assert together == alone


def test_max_tokens_gives_length_finish_and_exact_usage(client, model_name):
    out = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=5,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5


def test_min_tokens_holds_back_eos(client, model_name):
    natural = chat(client, model_name, "Reply with just the word yes.", max_tokens=64)
    assert natural.choices[0].finish_reason == "stop"
    floor = natural.usage.completion_tokens + 10
    held = chat(client, model_name, "Reply with just the word yes.", max_tokens=64,
                extra_body={"min_tokens": floor})
    assert held.usage.completion_tokens >= floor
    assert "<|im_end|>" not in held.choices[0].message.content


def test_seeded_sampling_reproduces(client, model_name):
    kw = dict(model=model_name, prompt="My favourite animal is", max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_stop_string_trims_output(client, model_name):
    out = client.completions.create(model=model_name, prompt="1, 2, 3, 4, 5,", max_tokens=30, temperature=0,
                                    stop=[" 8"])
    assert out.choices[0].finish_reason == "stop" and " 8" not in out.choices[0].text


@pytest.mark.parametrize("kw, status, words", [
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(prompt="hello " * 9000), 400, "context length"),
    (dict(model="no-such-model"), 404, "no-such-model"),
    (dict(presence_penalty=0.5), 400, "presence_penalty"),
])
def test_bad_requests_get_openai_errors(client, model_name, kw, status, words):
    args = dict(model=model_name, prompt="hi", max_tokens=4) | kw
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(**args)
    assert e.value.status_code == status
    assert words in str(e.value.body)


def test_malformed_body_is_a_400(stack):
    request = urllib.request.Request(f"{stack.http_url}/v1/chat/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 400
    assert json.loads(e.value.read())["error"]["message"]


def test_health_and_metrics(stack):
    with urllib.request.urlopen(f"{stack.http_url}/health", timeout=5) as r:
        assert r.status == 200
    with urllib.request.urlopen(f"{stack.http_url}/metrics", timeout=5) as r:
        assert b"vllm:" in r.read()
