"""Images in chat, end to end: openai client -> gateway (vLLM's multimodal processing) ->
control plane -> worker (the torch Qwen2.5-VL), on the tiny random-weight checkpoint.

The oracle is transformers' generate on the same checkpoint, image and processor: greedy tokens
identical. The stack runs two lanes (mRoPE models in lane mode), prefix caching, and a prefill
budget of three 16-token blocks, so prompts are chunked around their images.
"""
from __future__ import annotations

import base64
import concurrent.futures
import io

import openai
import pytest
import torch

from conftest import sample_image as make_image
from stack import Stack, start_stack

pytestmark = pytest.mark.e2e

BLOCK = 16
BUDGET = 48

# The tests' image servers listen on loopback: the module's gateway allows that network, the
# strict one (below) does not.
IMAGE_URL_FLAGS = ("--allowed-media-domains", "127.0.0.1", "localhost")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_vlm) -> Stack:
    s = start_stack(tmp_path_factory.mktemp("vision"), str(tiny_vlm),
                    control_flags=("--max-num-seqs", "2", "--data-parallel-size", "2",
                                   "--max-num-batched-tokens", str(BUDGET), "--enable-prefix-caching"),
                    worker_flags=("--dtype", "float32", "--block-size", str(BLOCK)),
                    gateway_flags=("--limit-images-per-prompt", "3", *IMAGE_URL_FLAGS,
                                   "--allowed-media-networks", "127.0.0.0/8"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def strict_client(stack, tmp_path_factory):
    """The OpenAI client of a second gateway on the module's control plane, with the same
    allowed domains but no --allowed-media-networks: image URLs reach public addresses only."""
    from stack import Service, free_port, http_ok, wait_until

    port = free_port()
    gateway = Service("gateway", ["ttserve.gateway", "--port", str(port), "--control", stack.control_address,
                                  "--limit-images-per-prompt", "3", *IMAGE_URL_FLAGS],
                      tmp_path_factory.mktemp("strict-gateway") / "gateway.log").start()
    try:
        wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/ready"), 300, "the strict gateway",
                   Stack(services=[gateway]))
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    finally:
        gateway.stop()


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # lossless: the gateway decodes the same pixels
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def openai_content(parts: list) -> list[dict]:
    return [{"type": "text", "text": p} if isinstance(p, str)
            else {"type": "image_url", "image_url": {"url": data_url(p)}} for p in parts]


def ask(client, model_name, parts: list, max_tokens: int = 10, **kw):
    return client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": openai_content(parts)}],
        temperature=0, max_tokens=max_tokens,
        extra_body={"return_token_ids": True, "ignore_eos": True, **kw.pop("extra_body", {})}, **kw)


def oracle(hf_tiny_vlm, parts: list, max_tokens: int = 10) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) of transformers on the same turn."""
    processor, model = hf_tiny_vlm
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]
    text = processor.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True, tokenize=False)
    images = [p for p in parts if not isinstance(p, str)]
    inputs = processor(text=[text], images=images or None, return_tensors="pt", return_mm_token_type_ids=True)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()


LONG_TEXT = ("A careful description follows of everything that can be seen in the picture below, "
             "from the foreground to the background, with attention to colour and shape.")

CASES = {
    "one-image": lambda: [make_image(84, 56, 1), "What is in this image?"],
    "image-after-long-text": lambda: [LONG_TEXT, make_image(112, 84, 2), "Describe it."],
    "several-images-interleaved": lambda: ["Compare", make_image(56, 56, 3), "with", make_image(84, 84, 4),
                                           "and", make_image(112, 56, 5), "briefly."],
    "text-only-on-a-vision-model": lambda: ["No image here, just a question about vision models."],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_answer_is_transformers_token_for_token(client, model_name, hf_tiny_vlm, case):
    parts = CASES[case]()
    prompt, expected = oracle(hf_tiny_vlm, parts)
    reply = ask(client, model_name, parts)
    assert reply.prompt_token_ids == prompt, "vLLM's processor expands the placeholders as transformers'"
    assert reply.choices[0].token_ids == expected


def test_concurrent_image_requests_over_both_lanes_match_the_oracle(client, model_name, hf_tiny_vlm):
    """Four requests at once on two lanes of two rows: rows of both lanes decode together, each
    with its own rope delta (the plugin cannot run mRoPE models in lane mode)."""
    turns = [[make_image(56 + 28 * (i % 3), 56, 10 + i), f"Question {i}?"] for i in range(4)]
    expected = [oracle(hf_tiny_vlm, parts, 12)[1] for parts in turns]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda parts: ask(client, model_name, parts, 12), turns))
    assert [r.choices[0].token_ids for r in replies] == expected


def cached_tokens(reply) -> int:
    details = reply.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details else 0


def test_prefix_cache_hits_on_the_same_image_and_misses_on_another(client, model_name, hf_tiny_vlm):
    first = [LONG_TEXT, make_image(112, 84, 20), "Describe it."]
    same = [LONG_TEXT, make_image(112, 84, 20), "Describe it."]
    other = [LONG_TEXT, make_image(112, 84, 21), "Describe it."]  # same size: same placeholder tokens
    prompt, expected_same = oracle(hf_tiny_vlm, same)
    _, expected_other = oracle(hf_tiny_vlm, other)
    ask(client, model_name, first)
    hit = ask(client, model_name, same)
    miss = ask(client, model_name, other)
    assert hit.choices[0].token_ids == expected_same and miss.choices[0].token_ids == expected_other
    # The same image: every full block hits (the last token is always computed).
    assert cached_tokens(hit) == (len(prompt) - 1) // BLOCK * BLOCK
    # Another image: only the text blocks before it, never a block its placeholders touch.
    assert 0 < cached_tokens(miss) < cached_tokens(hit)
    assert cached_tokens(miss) <= hit.prompt_token_ids.index(image_token(hf_tiny_vlm)) // BLOCK * BLOCK


def image_token(hf_tiny_vlm) -> int:
    return hf_tiny_vlm[1].config.image_token_id


def test_an_image_too_large_for_a_prefill_chunk_is_a_clear_400(client, model_name):
    # 224 x 224 becomes 8 x 8 = 64 placeholder tokens: more than a chunk of 48 can ever hold.
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, model_name, [make_image(224, 224, 30), "Too big?"])
    assert "more than one prefill chunk holds" in str(e.value) and "--max-num-batched-tokens" in str(e.value)


def test_an_undecodable_image_is_a_clear_400(client, model_name):
    broken = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
        b"this is not a png").decode()}}, {"type": "text", "text": "What is it?"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": broken}],
                                       max_tokens=4)
    assert "image" in str(e.value).lower()


@pytest.fixture
def image_server():
    """A loopback HTTP server with one PNG at /cat.png (and /redirect?to=URL answering 302 to
    URL); yields (base url, the image, the paths it was asked for)."""
    import http.server
    import threading

    picture = make_image(84, 56, 50)
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    body = buffer.getvalue()
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            asked.append(self.path)
            if self.path.startswith("/redirect?to="):
                self.send_response(302)
                self.send_header("Location", self.path.split("=", 1)[1])
                self.end_headers()
                return
            self.send_response(200 if self.path == "/cat.png" else 404)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", picture, asked
    server.shutdown()
    server.server_close()


def test_an_http_image_url_from_an_allowed_host_is_fetched(client, model_name, hf_tiny_vlm, image_server):
    base, picture, _ = image_server
    _, expected = oracle(hf_tiny_vlm, [picture, "What is this?"])
    content = [{"type": "image_url", "image_url": {"url": f"{base}/cat.png"}}, {"type": "text", "text": "What is this?"}]
    reply = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": content}],
                                           temperature=0, max_tokens=10,
                                           extra_body={"return_token_ids": True, "ignore_eos": True})
    assert reply.choices[0].token_ids == expected


def test_http_image_urls_are_refused_unless_the_operator_allows_their_host(client, model_name):
    content = [{"type": "image_url", "image_url": {"url": "http://images.example:9/cat.png"}},
               {"type": "text", "text": "What is it?"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": content}],
                                       max_tokens=4)
    assert "allowed domains" in str(e.value) and "127.0.0.1" in str(e.value)


def bomb_png(side: int) -> bytes:
    """A valid grayscale PNG of side x side pixels, all black: 13,000 is 169 MP in ~170 KB, which
    would decode to ~500 MB of RGB. Written row by row, so making it costs no such memory here."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    packer, row, parts = zlib.compressobj(9), b"\0" * (side + 1), []  # filter byte 0, then the row
    for _ in range(side):
        parts.append(packer.compress(row))
    parts.append(packer.flush())
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b""))


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_decompression_bomb_is_a_clear_400_before_it_is_decoded(client, model_name, stack):
    bomb = "data:image/png;base64," + base64.b64encode(bomb_png(13_000)).decode()
    assert len(bomb) < 400_000
    gateway = stack.services[-1].proc.pid
    before = rss_kib(gateway)
    content = [{"type": "image_url", "image_url": {"url": bomb}} for _ in range(3)] + [
        {"type": "text", "text": "How big?"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": content}],
                                       max_tokens=4)
    assert "13000x13000" in str(e.value) and str(16_777_216) in str(e.value)
    # Three bombs would be ~1.5 GB decoded; refused from their headers, the gateway barely grows.
    assert rss_kib(gateway) - before < 100 * 1024


def test_a_redirect_from_an_allowed_host_is_not_followed(client, model_name, image_server):
    """The allowed host answers 302 to another address: the gateway does not go there."""
    import http.server
    import threading

    reached = []

    class Target(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            reached.append(self.path)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    target = http.server.ThreadingHTTPServer(("127.0.0.2", 0), Target)
    threading.Thread(target=target.serve_forever, daemon=True).start()
    base, _, asked = image_server
    url = f"{base}/redirect?to=http://127.0.0.2:{target.server_address[1]}/metadata"
    try:
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": content}],
                                           max_tokens=4)
        # The allowed host was asked (its URL passed every check) and answered 302; nothing followed.
        assert any(path.startswith("/redirect?to=") for path in asked) and reached == []
    finally:
        target.shutdown()
        target.server_close()


def test_image_urls_reaching_loopback_are_refused_unless_the_operator_allows_its_network(
        client, strict_client, model_name, hf_tiny_vlm, image_server):
    """An IP literal and a name that resolves to loopback, both from allowed domains: the strict
    gateway refuses them (400, naming the host and why) without a request reaching the server;
    the module's gateway, given --allowed-media-networks 127.0.0.0/8, serves the same URLs."""
    base, picture, asked = image_server
    port = base.rsplit(":", 1)[1]
    urls = {host: f"http://{host}:{port}/cat.png" for host in ("127.0.0.1", "localhost")}

    def chat(on, url):
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]
        return on.chat.completions.create(model=model_name, messages=[{"role": "user", "content": content}],
                                          temperature=0, max_tokens=10,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})

    for host, url in urls.items():
        with pytest.raises(openai.BadRequestError) as e:
            chat(strict_client, url)
        said = str(e.value)
        assert f"image URL host '{host}'" in said and "a loopback address" in said, said
        assert "image URLs may reach only public addresses" in said and "--allowed-media-networks" in said
    assert asked == []
    _, expected = oracle(hf_tiny_vlm, [picture, "What is this?"])
    for url in urls.values():
        assert chat(client, url).choices[0].token_ids == expected
    assert asked == ["/cat.png", "/cat.png"]


def test_too_many_images_is_a_clear_400(client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, model_name, [make_image(56, 56, i) for i in range(4)] + ["Four images."])
    assert "At most 3 image(s) may be provided in one prompt" in str(e.value)


def test_refused_requests_leak_no_kv_blocks_and_the_server_keeps_serving(client, model_name, hf_tiny_vlm,
                                                                         stack):
    """Runs after the refusals above (file order): nothing is left running or holding blocks."""
    from stack import metric, wait_until
    parts = CASES["one-image"]()
    _, expected = oracle(hf_tiny_vlm, parts)
    assert ask(client, model_name, parts).choices[0].token_ids == expected
    for lane in ("0", "1"):
        wait_until(lambda: metric(stack.control_metrics_url, "ttserve_num_requests_running",
                                  worker="0", lane=lane) == 0, 10, f"lane {lane} to drain")
        assert metric(stack.control_metrics_url, "ttserve_kv_cache_usage_perc", worker="0", lane=lane) == 0


def test_ttserve_up_serves_an_image_chat_with_transformers_answer(tmp_path, tiny_vlm, hf_tiny_vlm):
    """The whole product as a user starts it: `ttserve up --model <tiny-vlm folder>`."""
    import signal

    from stack import ttserve_up

    with ttserve_up(tmp_path, "--model", str(tiny_vlm), "--dtype", "float32", "--max-num-seqs", "2") as (proc, ports):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports[0]}/v1", api_key="unused", max_retries=0)
        parts = [make_image(112, 56, 40), "What do you see?"]
        _, expected = oracle(hf_tiny_vlm, parts)
        assert ask(client, tiny_vlm.name, parts).choices[0].token_ids == expected
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
