"""A request whose inputs make the model raise fails alone; its batch-mates finish with the tokens
of an uninterrupted run (issue 22 item 2).

Real processes: the torch Qwen2.5-VL worker on the tiny checkpoint and a control plane, driven
through engine.proto. The poison is an image whose image_grid_thw disagrees with its
pixel_values and placeholders, as a faulty or hostile frontend could send: it passes admission
(tensors well formed, placeholders inside the prompt) and fails inside the model's prefill.
"""
from __future__ import annotations

import signal

import pytest
import torch

from conftest import sample_image
from stack import metric, start_stack, wait_until
from ttserve.control_client import ControlClient
from ttserve.tensor_wire import tensor_to_pb
from ttserve.v1 import engine_pb2, multimodal_pb2

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_vlm):
    # One lane, room for the whole burst's prefill in one step: the poison shares its first step.
    s = start_stack(tmp_path_factory.mktemp("poison"), str(tiny_vlm), gateway=False,
                    control_flags=("--max-num-seqs", "4", "--max-num-batched-tokens", "1024"),
                    worker_flags=("--dtype", "float32", "--block-size", "16"))
    yield s
    s.stop()


def image_request(hf_tiny_vlm, request_id: str, seed: int, poison: bool = False) -> engine_pb2.AddRequest:
    processor, model = hf_tiny_vlm
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Question {seed}?"}]}],
        add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[sample_image(56, 56, seed)], return_tensors="pt")
    prompt = inputs["input_ids"][0].tolist()
    image_token = model.config.image_token_id
    offset, length = prompt.index(image_token), prompt.count(image_token)
    grid = inputs["image_grid_thw"][0]
    if poison:
        grid = grid * torch.tensor([1, 2, 1])  # twice the rows the pixels and placeholders hold
    image = multimodal_pb2.MultiModalInput(
        modality="image", hash=f"{request_id}-{seed}", offset=offset, length=length,
        data={"pixel_values": tensor_to_pb(inputs["pixel_values"]), "image_grid_thw": tensor_to_pb(grid)})
    return engine_pb2.AddRequest(request_id=request_id, prompt_token_ids=prompt,
                                 eos_token_ids=[processor.tokenizer.eos_token_id],
                                 sampling=engine_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                                 mm_inputs=[image])


def test_a_poison_request_fails_alone_and_its_batch_mates_finish_as_if_uninterrupted(stack, hf_tiny_vlm):
    client = ControlClient(stack.control_address)
    try:
        goods = [image_request(hf_tiny_vlm, f"alone-{i}", seed=i) for i in range(3)]
        expected = {}
        for add in goods:  # one at a time: the uninterrupted run
            client.add_request(add)
            expected[add.request_id.removeprefix("alone-")] = client.collect({add.request_id})[add.request_id].token_ids
        assert all(len(tokens) == MAX_TOKENS for tokens in expected.values())

        burst = [image_request(hf_tiny_vlm, f"mate-{i}", seed=i) for i in range(3)]
        burst.append(image_request(hf_tiny_vlm, "poison", seed=9, poison=True))
        # The worker paused: mate-0's step waits on it while the others queue, so that mate-1,
        # mate-2 and the poison share the next prefill step (the poison's first failure is a
        # batch's, as it would be under load).
        worker = stack.services[0].proc
        worker.send_signal(signal.SIGSTOP)
        try:
            client.add_request(burst[0])
            wait_until(lambda: metric(stack.control_metrics_url, "ttserve_num_requests_running",
                                      worker="0", lane="0") == 1, 30, "mate-0 to be scheduled")
            for add in burst[1:]:
                client.add_request(add)
            wait_until(lambda: metric(stack.control_metrics_url, "ttserve_num_requests_waiting",
                                      worker="0", lane="0") == 3, 30, "the others to queue")
        finally:
            worker.send_signal(signal.SIGCONT)
        results = client.collect({add.request_id for add in burst})
    finally:
        client.close()

    poison = results.pop("poison")
    assert poison.finish_reason == engine_pb2.FINISH_REASON_ERROR
    assert "the model failed on this request" in poison.error, poison.error
    assert "carried it failed, the last with it alone" in poison.error
    for rid, result in results.items():
        assert result.finish_reason == engine_pb2.FINISH_REASON_LENGTH, (rid, result.error)
        assert result.token_ids == expected[rid.removeprefix("mate-")], rid

    url = stack.control_metrics_url
    assert metric(url, "ttserve_request_isolations_total", outcome="failed") == 1
    # The poison's first failed step was a batch's: its two batch-mates ran isolated, and so did it.
    assert metric(url, "ttserve_request_isolations_total", outcome="isolated") == 3
    assert metric(url, "ttserve_step_failures_total", worker="0") >= 2
    assert metric(url, "ttserve_request_migrations_total", outcome="failed_limit") == 0
    assert metric(url, "ttserve_kv_cache_usage_perc", worker="0", lane="0") == 0
