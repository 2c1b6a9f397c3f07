"""Images in the control plane: placeholder tokens scheduled like prompt tokens, never split
across prefill chunks, sent to the worker once per device state, and in the prefix-cache keys."""
from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ttserve.control.admission import AdmissionError, Limits, check_request
from ttserve.control.images import ImageInput
from ttserve.control.request import Request, SamplingParams
from ttserve.control.wire import request_from_pb, step_batch_to_pb
from ttserve.v1 import engine_pb2, multimodal_pb2

from test_scheduler import EOS, run_step, scheduler

IMAGE_TOKEN = 99


def with_images(rid: str, layout: list[tuple[int, int]], tail: int = 3, max_tokens: int = 2,
                hashes: list[str] | None = None) -> Request:
    """A prompt of (text, image) runs: `text` text tokens then an image of `image` placeholders,
    for each pair, then `tail` text tokens."""
    tokens, images = [], []
    for i, (text, image) in enumerate(layout):
        tokens += list(range(10, 10 + text))
        images.append(ImageInput((hashes or [f"img{i}"] * len(layout))[i] if hashes else f"img{i}",
                                 len(tokens), image, payload=f"payload-{rid}-{i}"))
        tokens += [IMAGE_TOKEN] * image
    tokens += list(range(10, 10 + tail))
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, eos_token_ids=frozenset({EOS})),
                   images=images)


def drive(s, requests) -> list:
    for r in requests:
        s.add(r)
    plans = []
    for _ in range(500):
        if not s.has_work:
            break
        plans.append(run_step(s))
    assert not s.has_work
    return plans


def cuts_an_image(work) -> bool:
    return any(image.offset < work.start < image.end or image.offset < work.end < image.end
               for image in work.request.images)


@settings(max_examples=60, deadline=None)
@given(layout=st.lists(st.tuples(st.integers(0, 9), st.integers(1, 10)), min_size=1, max_size=4),
       budget=st.sampled_from([12, 16, 20, 32]), caching=st.booleans())
def test_no_chunk_splits_an_image_and_each_is_sent_once(layout, budget, caching):
    s = scheduler(budget=budget, block_size=4, max_model_len=96, num_blocks=64, caching=caching)
    r = with_images("a", layout)
    try:  # what admission lets through: every cluster of images fits one chunk
        check_request(r, [], Limits(max_model_len=96, vocab_size=128, supports_images=True,
                                    max_image_blocks=budget // 4, block_size=4))
    except AdmissionError:
        assume(False)
    plans = drive(s, [r])
    works = [w for p in plans for w in p.prefill]
    assert works and not any(cuts_an_image(w) for w in works)
    sent = [image for w in works for image in w.images]
    assert sent == r.images, "every image once, in order, with the chunk that first reaches it"
    for w in works:
        assert all(image.end <= w.end for image in w.images)
    assert r.output_token_ids and s.lane.pool.num_free == s.lane.pool.num_blocks


def test_chunk_ends_before_an_image_it_cannot_finish():
    s = scheduler(budget=8, block_size=4, max_model_len=64)
    r = with_images("a", [(6, 6)])  # text 0..5, image 6..11, tail 12..14
    s.add(r)
    first = run_step(s).prefill[0]
    assert (first.start, first.end, first.images) == (0, 4, [])
    second = run_step(s).prefill[0]
    assert (second.start, second.end) == (4, 12) and second.images == r.images


def test_a_preempted_request_sends_its_images_again():
    # b runs first, so a is the newest request: the one preempted when the 8 blocks run short.
    s = scheduler(num_blocks=8, block_size=4, budget=32, max_model_len=32)
    b = Request("b", list(range(10, 18)), SamplingParams(max_tokens=20, eos_token_ids=frozenset({EOS})))
    s.add(b)
    run_step(s)
    a = with_images("a", [(2, 5)], tail=2, max_tokens=20)
    s.add(a)
    sends = []
    for _ in range(80):
        if not s.has_work:
            break
        plan = run_step(s)
        sends += [w.images for w in plan.prefill if w.request is a]
    assert a.num_preemptions >= 1
    assert sends.count(a.images) == 1 + a.num_preemptions, "each recompute carried the images to the new device state"


def test_same_image_hits_the_prefix_cache_another_image_misses():
    s = scheduler(caching=True, block_size=4, budget=32, max_model_len=64)
    drive(s, [with_images("first", [(5, 8)], tail=6, hashes=["cat"])])
    same = with_images("same", [(5, 8)], tail=6, hashes=["cat"])
    other = with_images("other", [(5, 8)], tail=6, hashes=["dog"])
    drive(s, [same])
    drive(s, [other])
    assert same.num_cached_tokens == 16   # the text block and both image blocks (offset 5..12) hit
    assert other.num_cached_tokens == 4   # only the text block before the image


def test_a_cache_hit_ending_inside_an_image_resumes_at_the_image():
    s = scheduler(caching=True, block_size=4, budget=32, max_model_len=64)
    # Published blocks cover [0, 12): text 0..4, image 5..14 ends in block 3.
    drive(s, [with_images("first", [(5, 10)], tail=1, hashes=["cat"])])
    again = with_images("again", [(5, 10)], tail=1, hashes=["cat"])
    s.add(again)
    plan = run_step(s)
    assert again.num_cached_tokens == 4 and plan.prefill[0].start == 4
    assert plan.prefill[0].images == again.images


def test_step_batch_carries_the_clients_image_messages():
    mm = multimodal_pb2.MultiModalInput(modality="image", hash="h", offset=3, length=4)
    mm.data["image_grid_thw"].CopyFrom(multimodal_pb2.Tensor(dtype="int64", shape=[3], data=bytes(24)))
    add = engine_pb2.AddRequest(request_id="a", prompt_token_ids=[1, 2, 3] + [IMAGE_TOKEN] * 4 + [5],
                                sampling=engine_pb2.SamplingParams(max_tokens=2), mm_inputs=[mm])
    request, unsupported = request_from_pb(add, 0)
    assert not unsupported and request.images[0].offset == 3
    s = scheduler()
    s.add(request)
    plan = s.schedule()
    batch = step_batch_to_pb(1, plan.kind, plan.lanes, 4)
    assert list(batch.prefill[0].mm_inputs) == [mm]


def test_admission_refuses_images_for_a_text_model_and_images_too_large_for_a_chunk():
    r = with_images("a", [(2, 9)])
    with pytest.raises(AdmissionError, match="does not take images"):
        check_request(r, [], Limits(max_model_len=64, vocab_size=128))
    with pytest.raises(AdmissionError, match="more than one prefill chunk holds"):
        check_request(r, [], Limits(max_model_len=64, vocab_size=128, supports_images=True,
                                    max_image_blocks=2, block_size=4))
    check_request(r, [], Limits(max_model_len=64, vocab_size=128, supports_images=True,
                                max_image_blocks=3, block_size=4))
    bad = with_images("b", [(2, 4)])
    bad.images[0] = ImageInput("x", 1, 40)
    adjacent = with_images("c", [(2, 5), (0, 5)])  # two images sharing block 1: one cluster of 3 blocks
    with pytest.raises(AdmissionError, match="images 0 to 1"):
        check_request(adjacent, [], Limits(max_model_len=64, vocab_size=128, supports_images=True,
                                           max_image_blocks=2, block_size=4))
    with pytest.raises(AdmissionError, match="past the prompt"):
        check_request(bad, [], Limits(max_model_len=64, vocab_size=128, supports_images=True))


def test_malformed_image_tensors_are_named_at_admission():
    from ttserve.control.wire import mm_inputs_problem
    mm = multimodal_pb2.MultiModalInput(modality="image", hash="h", offset=0, length=1)
    mm.data["pixel_values"].CopyFrom(multimodal_pb2.Tensor(dtype="float32", shape=[2, 3], data=b"short"))
    add = engine_pb2.AddRequest(request_id="a", prompt_token_ids=[IMAGE_TOKEN], mm_inputs=[mm])
    assert "image 0's pixel_values: a float32 tensor of shape [2, 3] needs 24 bytes, got 5" == mm_inputs_problem(add)


def test_a_migrated_request_sends_its_images_to_its_new_worker():
    s = scheduler(budget=32, block_size=4, max_model_len=64)
    r = with_images("a", [(2, 5)], tail=2, max_tokens=5)
    s.add(r)
    assert run_step(s).prefill[0].images == r.images and r.num_sent_images == 1
    assert s.lane.release() == [r]  # its worker is lost: its lane gives it up ...
    other = scheduler(budget=32, block_size=4, max_model_len=64)
    other.lane.adopt(r)       # ... and another worker's lane adopts it
    assert r.num_sent_images == 0
    assert run_step(other).prefill[0].images == r.images


def test_a_step_carries_image_payloads_within_one_grpc_message():
    """Three requests of 20 MiB of pixels each fit a prefill budget together but not one 64 MiB
    step message: a step carries at most STEP_PAYLOAD_BYTES of them (its first always), the rest
    go first in the next steps, in arrival order."""
    from dataclasses import replace

    from ttserve.control.images import STEP_PAYLOAD_BYTES
    from ttserve.v1 import multimodal_pb2

    s = scheduler(budget=48, max_num_seqs=4)
    requests = [with_images(f"r{i}", [(2, 4)]) for i in range(3)]
    for r in requests:
        r.images[0] = replace(r.images[0], payload=multimodal_pb2.MultiModalInput(
            modality="image", hash=r.images[0].hash, data={"pixel_values": multimodal_pb2.Tensor(
                dtype="uint8", shape=[20 << 20], data=bytes(20 << 20))}))
        s.add(r)
    carried = []
    while any(r.num_sent_images == 0 for r in requests):
        plan = run_step(s)
        sent = [w.request.request_id for w in plan.prefill if w.images]
        assert sum(image.payload.ByteSize() for w in plan.prefill for image in w.images) <= STEP_PAYLOAD_BYTES
        carried.append(sent)
    assert carried == [["r0", "r1"], ["r2"]]
