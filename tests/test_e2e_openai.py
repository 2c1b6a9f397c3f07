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
                    control_flags=("--max-num-seqs", "8", "--max-num-batched-tokens", "16"),
                    # The oracle is transformers in float32: the worker must compute in it too
                    # (bf16, the CPU default, is checked in tests/test_reference_model.py).
                    worker_flags=("--dtype", "float32"),
                    # vLLM's frontend wants a tool parser for named or "required" tool choice.
                    # Parsers with a structural-tag model (hermes, ...) emit xgrammar-format
                    # structural tags, which the guidance backend refuses; pythonic has none, so
                    # the call is a JSON-schema structured output.
                    gateway_flags=("--tool-call-parser", "pythonic", "--enable-auto-tool-choice"))
    yield s
    s.stop()


def chat(client, model_name, content: str, **kw):
    return client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": content}],
                                          temperature=0, **kw)


def test_models_lists_the_served_model(client, smollm2):
    assert [m.id for m in client.models.list().data] == [smollm2.name]


def test_capital_of_france_is_paris(client, model_name):
    answer = chat(client, model_name, "What is the capital of France?", max_tokens=32)
    assert "Paris" in answer.choices[0].message.content


def test_greedy_output_matches_transformers_token_for_token(client, model_name, hf_smollm2):
    tokenizer, model = hf_smollm2
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.inference_mode():
            expected = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                      min_new_tokens=32)[0, len(ids):].tolist()
        out = client.completions.create(model=model_name, prompt=ids, max_tokens=32, temperature=0,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
        assert out.choices[0].token_ids == expected, prompt
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 32


def test_chat_greedy_matches_transformers_with_chat_template(client, model_name, hf_smollm2):
    tokenizer, model = hf_smollm2
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


def test_continuous_usage_stats_count_up_in_every_chunk(client, model_name):
    stream = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=6, temperature=0,
                                       stream=True, stream_options={"include_usage": True,
                                                                    "continuous_usage_stats": True},
                                       extra_body={"ignore_eos": True})
    counts = [chunk.usage.completion_tokens for chunk in stream if chunk.usage]
    assert counts == sorted(counts) and counts[-1] == 6 and len(counts) >= 6


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


def test_seeded_sampling_reproduces_and_depends_on_the_seed(client, model_name):
    kw = dict(model=model_name, prompt="My favourite animal is", max_tokens=16, temperature=1.0, top_p=0.9,
              extra_body={"return_token_ids": True, "ignore_eos": True})

    def sampled(**over) -> list[int]:
        return client.completions.create(**(kw | over)).choices[0].token_ids

    first = sampled(seed=1234)
    assert sampled(seed=1234) == first
    # Really sampling with that seed: another seed, or greedy decoding, gives another output.
    assert sampled(seed=4321) != first
    assert sampled(temperature=0) != first


def test_stop_string_trims_output(client, model_name):
    out = client.completions.create(model=model_name, prompt="1, 2, 3, 4, 5,", max_tokens=30, temperature=0,
                                    stop=[" 8"])
    assert out.choices[0].finish_reason == "stop" and " 8" not in out.choices[0].text


@pytest.mark.parametrize("kw, status, words", [
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(prompt="hello " * 9000), 400, "context length"),
    (dict(model="no-such-model"), 404, "no-such-model"),
    (dict(extra_body={"prompt_logprobs": 1}), 400, "prompt_logprobs"),
    (dict(extra_body={"priority": 1}), 400, "first come, first served"),
    (dict(logprobs=21), 400, "logprobs"),
])
def test_bad_requests_get_openai_errors(client, model_name, kw, status, words):
    args = dict(model=model_name, prompt="hi", max_tokens=4) | kw
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(**args)
    assert e.value.status_code == status
    assert words in str(e.value.body)


def test_chat_top_logprobs_above_20_is_a_400(client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model_name, "hi", max_tokens=2, logprobs=True, top_logprobs=21)
    assert "logprobs" in str(e.value.body)


def test_malformed_body_is_a_400(stack):
    request = urllib.request.Request(f"{stack.http_url}/v1/chat/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 400
    assert json.loads(e.value.read())["error"]["message"]


# ---- the host sampler's options, end to end ----------------------------------------------------
REPETITIVE = "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat."


def completion_ids(client, model_name, prompt, max_tokens: int = 24, **kw) -> list[int]:
    extra = {"return_token_ids": True, "ignore_eos": True} | kw.pop("extra_body", {})
    out = client.completions.create(model=model_name, prompt=prompt, max_tokens=max_tokens,
                                    temperature=kw.pop("temperature", 0), extra_body=extra, **kw)
    return out.choices[0].token_ids


def test_logprobs_match_transformers_and_the_greedy_choice(client, model_name, hf_smollm2):
    tokenizer, model = hf_smollm2
    ids = tokenizer(PROMPTS[2])["input_ids"]
    out = client.completions.create(model=model_name, prompt=ids, max_tokens=8, temperature=0, logprobs=5,
                                    extra_body={"return_token_ids": True, "ignore_eos": True,
                                                "return_tokens_as_token_ids": True})
    choice = out.choices[0]
    generated = choice.token_ids
    with torch.inference_mode():
        logits = model(torch.tensor([ids + generated[:-1]])).logits[0, len(ids) - 1:]
    expected = logits.float().log_softmax(-1)
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(generated) == 8
    for i, token in enumerate(generated):
        assert lp.tokens[i] == f"token_id:{token}"
        top = lp.top_logprobs[i]
        assert len(top) == 5  # greedy: the chosen token is one of the top 5, not a sixth entry
        values = list(top.values())
        assert values == sorted(values, reverse=True) and lp.token_logprobs[i] == max(values)
        best = expected[i].topk(5)
        assert [int(k.split(":")[1]) for k in top] == best.indices.tolist()
        assert values == pytest.approx(best.values.tolist(), abs=2e-3)
        assert lp.token_logprobs[i] == pytest.approx(float(expected[i, token]), abs=2e-3)


def test_chat_top_logprobs_count_is_honoured(client, model_name):
    out = chat(client, model_name, "Name a fruit.", max_tokens=6, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert entry.logprob == values[0] and entry.token == entry.top_logprobs[0].token


@pytest.mark.parametrize("penalty", [dict(presence_penalty=2.0, frequency_penalty=2.0),
                                     dict(extra_body={"repetition_penalty": 2.0})])
def test_penalties_reduce_repeats_in_a_repetitive_greedy_output(client, model_name, penalty):
    plain = completion_ids(client, model_name, REPETITIVE)
    penalised = completion_ids(client, model_name, REPETITIVE, **penalty)
    assert penalised != plain
    assert len(penalised) - len(set(penalised)) < len(plain) - len(set(plain))


def test_logit_bias_forces_a_token_or_bans_it(client, model_name):
    plain = completion_ids(client, model_name, "My favourite fruit is", max_tokens=4)
    forced = completion_ids(client, model_name, "My favourite fruit is", max_tokens=4, logit_bias={"1234": 100})
    assert forced == [1234] * 4
    banned = completion_ids(client, model_name, "My favourite fruit is", max_tokens=4,
                            logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]


def test_min_p_of_one_keeps_only_the_top_token_at_any_temperature(client, model_name):
    greedy = completion_ids(client, model_name, PROMPTS[0], max_tokens=12)
    hot = completion_ids(client, model_name, PROMPTS[0], max_tokens=12, temperature=2.0,
                         extra_body={"min_p": 1.0})
    assert hot == greedy


def test_bad_words_ban_a_word(client, model_name):
    question = "What is the capital of France?"
    assert "Paris" in chat(client, model_name, question, max_tokens=32).choices[0].message.content
    banned = chat(client, model_name, question, max_tokens=32, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in banned.choices[0].message.content


def test_allowed_token_ids_restrict_the_output(client, model_name, hf_smollm2):
    tokenizer, _ = hf_smollm2
    allowed = sorted({tokenizer.encode(w)[0] for w in (" yes", " no", " maybe")})
    ids = completion_ids(client, model_name, "Is the sky blue?", max_tokens=6, temperature=1.0,
                         extra_body={"allowed_token_ids": allowed})
    assert len(ids) == 6 and set(ids) <= set(allowed)


def test_seeded_sampling_with_penalties_reproduces_and_depends_on_the_seed(client, model_name):
    kw = dict(model=model_name, prompt=REPETITIVE, max_tokens=16, temperature=1.0,
              presence_penalty=1.0, frequency_penalty=0.5, logprobs=2,
              extra_body={"return_token_ids": True, "ignore_eos": True})

    def sampled(**over):
        return client.completions.create(**(kw | over)).choices[0]

    first, second = sampled(seed=99), sampled(seed=99)
    assert first.token_ids == second.token_ids and first.text == second.text
    assert first.logprobs.token_logprobs == second.logprobs.token_logprobs
    assert sampled(seed=100).token_ids != first.token_ids
    assert sampled(temperature=0).token_ids != first.token_ids


def test_n_returns_that_many_choices_each_sampled_with_its_own_seed(client, model_name):
    kw = dict(model=model_name, prompt="My favourite animal is", max_tokens=8, temperature=1.0,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    out = client.completions.create(n=3, seed=7, **kw)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert all(c.text for c in out.choices)
    choices = [c.token_ids for c in sorted(out.choices, key=lambda c: c.index)]
    assert len({tuple(c) for c in choices}) == 3  # three samples, not one repeated
    # vLLM gives choice i the seed seed + i: each is what a single request with that seed gets.
    for i, ids in enumerate(choices):
        assert ids == client.completions.create(seed=7 + i, **kw).choices[0].token_ids, i


def test_client_disconnect_aborts_the_request_and_frees_its_blocks(stack, model_name):
    import httpx

    from stack import wait_until
    from ttserve.control_client import ControlClient

    body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{stack.http_url}/v1/completions", json=body, timeout=60) as response:
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data:")
            if seen >= 3:
                break  # hang up mid-stream
    control = ControlClient(stack.control_address)
    try:
        def idle() -> bool:
            w = control.server_info().workers[0]
            return w.num_running == 0 and w.num_waiting == 0 and w.kv_blocks_used == 0
        wait_until(idle, 15, "the abandoned request to be aborted and its KV blocks freed")
    finally:
        control.close()


def test_tokenize_detokenize_version_and_echo(stack, client, model_name):
    import httpx

    tokens = httpx.post(f"{stack.http_url}/tokenize", json={"model": model_name, "prompt": "Hello world"},
                        timeout=10).json()["tokens"]
    assert tokens
    text = httpx.post(f"{stack.http_url}/detokenize", json={"model": model_name, "tokens": tokens},
                      timeout=10).json()["prompt"]
    assert text == "Hello world"
    assert httpx.get(f"{stack.http_url}/version", timeout=10).status_code == 200
    out = client.completions.create(model=model_name, prompt="Say hi", max_tokens=3, temperature=0, echo=True)
    assert out.choices[0].text.startswith("Say hi")


# ---- structured outputs (enforced by the control plane with llguidance) ---------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_json_schema_output_validates_against_its_schema(client, model_name):
    import jsonschema
    out = chat(client, model_name, "Describe a person as JSON.", max_tokens=64,
               response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    choice = out.choices[0]
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert choice.finish_reason == "stop"


def test_json_object_output_parses(client, model_name):
    out = chat(client, model_name, 'Reply with this JSON object: {"ok": true}', max_tokens=48,
               response_format={"type": "json_object"})
    content = out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop", content
    assert isinstance(json.loads(content), dict)


def test_regex_and_choice_outputs_match(client, model_name):
    import re
    out = chat(client, model_name, "What year did the Berlin wall fall?", max_tokens=16,
               extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert re.fullmatch("[0-9]{4}", out.choices[0].message.content)
    out = chat(client, model_name, "Is the sky blue?", max_tokens=16,
               extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert out.choices[0].message.content in ("yes", "no", "maybe")


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"]}}}


def test_named_tool_call_has_arguments_matching_its_schema(client, model_name):
    import jsonschema
    out = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "What's the weather in Paris?"}],
        temperature=0, max_tokens=48, tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


def test_required_tool_choice_returns_a_tool_call(client, model_name):
    out = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "What's the weather in Rome?"}],
        temperature=0, max_tokens=64, tools=[WEATHER_TOOL], tool_choice="required",
        parallel_tool_calls=False)  # one call: the greedy 135M model would list calls until max_tokens
    calls = out.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert "city" in json.loads(calls[0].function.arguments)


def test_invalid_schema_is_refused_with_400(client, model_name):
    with pytest.raises(openai.BadRequestError):
        chat(client, model_name, "hi", max_tokens=8,
             extra_body={"structured_outputs": {"regex": "(unclosed"}})
    with pytest.raises(openai.BadRequestError):
        chat(client, model_name, "hi", max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}})


def test_a_grammar_request_does_not_block_a_plain_request(stack, model_name):
    async def both():
        aclient = openai.AsyncOpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)
        grammar = aclient.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "A person as JSON"}], temperature=0,
            max_tokens=48, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
        plain = aclient.completions.create(model=model_name, prompt="Hello", max_tokens=8, temperature=0)
        return await asyncio.gather(grammar, plain)

    grammar, plain = asyncio.run(both())
    assert json.loads(grammar.choices[0].message.content)
    assert plain.usage.completion_tokens == 8


def test_an_image_for_a_text_only_model_is_a_clear_400(client, model_name):
    png = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg==")
    content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
               {"type": "text", "text": "What is in this image?"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": content}],
                                       max_tokens=4)
    assert "is not a multimodal model" in str(e.value)  # vLLM's frontend says so
    # The server still serves text.
    assert chat(client, model_name, "What is the capital of France?", max_tokens=8).choices[0].message.content
