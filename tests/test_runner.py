"""The worker's runner over real models (SmolLM2 in torch, and the sim mesh): per-batch device vs
host sampling, warmup order, trace flags, deterministic sim tokens."""
from __future__ import annotations

import pytest
import torch

from ttserve.worker.backends.sim.model import PROFILES, SimModel, next_token
from ttserve.worker.backends.torch.backend import TorchBackend
from ttserve.worker.backends.torch.models import TorchLlamaForCausalLM
from ttserve.worker.batch import DecodeItem, HostSampling, NewRequest, PrefillChunk, ServingConfig, StepBatch, StepResult
from ttserve.worker.runner import DeviceOptions, ModelRunner

CONFIG = ServingConfig(num_lanes=1, max_num_seqs=4, max_model_len=256, max_num_batched_tokens=256)
PROMPTS = {"greedy": [1, 504, 3458, 282, 4649], "seeded": [1, 9690, 314, 2185, 282, 3000]}


def runner(model_path, model_cls=TorchLlamaForCausalLM, backend_traces=False, kv_tokens_per_lane=None,
           traced_kinds=frozenset({"prefill", "decode"}), **tt) -> tuple[ModelRunner, list]:
    options = DeviceOptions(tt, backend_traces, kv_tokens_per_lane, traced_kinds)
    r = ModelRunner(model_path, model_cls, "LlamaForCausalLM", TorchBackend(torch.device("cpu"), torch.float32,
                                                                            options.traced),
                    torch.float32, block_size=16, kv_cache_bytes=64 << 20, options=options)
    progress = []
    r.warmup(CONFIG, lambda phase, done, total, detail: progress.append((phase, done, total)))
    return r, progress


def run_steps(r: ModelRunner, news: list[NewRequest], steps: int) -> tuple[dict, list[StepResult]]:
    """Prefill PROMPTS as `news` (request "greedy" in block 0, "seeded" in block 1), then `steps`
    decodes; every request's tokens, and each step's result."""
    blocks = {"greedy": [0], "seeded": [1]}
    result = r.execute(StepBatch(1, "prefill", new_requests=news,
                                 prefill=[PrefillChunk(rid, ids, 0, blocks[rid], True) for rid, ids in PROMPTS.items()]))
    out = {rid: [t] for rid, t in result.tokens.items()}
    results = [result]
    for step in range(steps):
        items = [DecodeItem(rid, out[rid][-1], len(PROMPTS[rid]) + step, []) for rid in PROMPTS]
        result = r.execute(StepBatch(2 + step, "decode", decode=items))
        results.append(result)
        for rid, t in result.tokens.items():
            out[rid].append(t)
    return out, results


def generate(r: ModelRunner, steps: int = 10, min_tokens: int = 0) -> tuple[dict, list[bool]]:
    news = [NewRequest("greedy", 0, 0, 0.0, 1.0, 0, None, min_tokens, [2] if min_tokens else []),
            NewRequest("seeded", 0, 1, 0.8, 0.9, 50, 1234)]
    out, results = run_steps(r, news, steps)
    return out, [result.sampled_on_device for result in results]


@pytest.fixture(scope="module")
def host_run(smollm2):
    return generate(runner(smollm2)[0])


def test_device_and_host_sampling_give_the_same_tokens(smollm2, host_run):
    device_out, device_paths = generate(runner(smollm2, sample_on_device_mode="all")[0])
    host_out, host_paths = host_run
    assert device_out == host_out
    assert all(device_paths) and not any(host_paths)


def test_a_pipelined_decode_a_cpu_computed_comes_back_with_its_own_step(smollm2, host_run):
    """On a CPU the launch is the compute: a decode asked to stay on the device (async_readback)
    is returned at once, not after the next step's compute, and the next decode's carried rows
    (use_previous_token) still take its tokens. The tokens are the host-sampled run's."""
    r = runner(smollm2, sample_on_device_mode="all")[0]
    assert r.async_decode
    news = [NewRequest("greedy", 0, 0, 0.0, 1.0, 0, None), NewRequest("seeded", 0, 1, 0.8, 0.9, 50, 1234)]
    first = r.execute(StepBatch(1, "prefill", new_requests=news, prefill=[
        PrefillChunk(rid, ids, 0, [i], True) for i, (rid, ids) in enumerate(PROMPTS.items())]))
    out = {rid: [t] for rid, t in first.tokens.items()}
    for step in range(4):
        carried = step > 0  # the first decode feeds the prefill's tokens from the host
        items = [DecodeItem(rid, 0 if carried else out[rid][-1], len(PROMPTS[rid]) + step, [],
                            use_previous_token=carried) for rid in PROMPTS]
        [result] = r.step(StepBatch(2 + step, "decode", async_readback=True, decode=items))
        assert result.step_id == 2 + step and result.sampled_on_device and not r.unanswered()
        for rid, t in result.tokens.items():
            out[rid].append(t)
    assert out == {rid: tokens[:5] for rid, tokens in host_run[0].items()}


@pytest.mark.parametrize("sampling", [{}, {"sample_on_device_mode": "all"}], ids=["host", "device"])
def test_traced_torch_decode_runs_static_shapes_and_gives_the_same_tokens(smollm2, host_run, sampling):
    # The worker's torch backend: decode traces only (a CUDA graph on CUDA, eager here).
    r = runner(smollm2, backend_traces=True, traced_kinds=frozenset({"decode"}), trace_mode="all",
               **sampling)[0]
    assert (r.options.traced("prefill"), r.options.traced("decode")) == (False, True)
    static_steps, static_decode = [], r.model._static_decode
    r.model._static_decode = lambda *args: static_steps.append(1) or static_decode(*args)
    out, _ = generate(r)
    assert out == host_run[0] and len(static_steps) == 10


def test_decode_only_mode_samples_prefill_on_the_host(smollm2, host_run):
    out, paths = generate(runner(smollm2, sample_on_device_mode="decode_only")[0])
    assert out == host_run[0] and paths[0] is False and all(paths[1:])


def test_always_compat_sampling_forces_the_host_path(smollm2):
    _, paths = generate(runner(smollm2, sample_on_device_mode="all", always_compat_sampling=True)[0], steps=2)
    assert not any(paths)


def test_a_request_needing_the_host_sampler_sends_its_whole_batch_there(smollm2):
    _, paths = generate(runner(smollm2, sample_on_device_mode="all")[0], steps=3, min_tokens=3)
    assert paths == [False, False, False, True]  # min_tokens held until 3 tokens exist


def test_warmup_compiles_every_shape_before_capturing(smollm2):
    _, progress = runner(smollm2, SimModel.for_profile(PROFILES["n300-llama-3.1-8b"]), backend_traces=True,
                         kv_tokens_per_lane=4096)
    phases = [p for p, _, _ in progress]
    assert phases.index("compile") < phases.index("capture")
    assert phases[:phases.index("compile")] == ["load", "load", "allocate", "allocate"]


@pytest.mark.parametrize("trace_mode, prefill_traced, decode_traced",
                         [("all", True, True), ("decode_only", False, True), ("none", False, False)])
def test_sim_traces_follow_trace_mode_and_tokens_are_deterministic(smollm2, trace_mode, prefill_traced,
                                                                   decode_traced):
    profile = PROFILES["n300-llama-3.1-8b"]
    r, _ = runner(smollm2, SimModel.for_profile(profile), backend_traces=True, trace_mode=trace_mode,
                  kv_tokens_per_lane=4096)
    assert r.prefill_buckets == (sorted(profile.prefill_buckets) if prefill_traced else [])
    first = r.execute(StepBatch(1, "prefill", new_requests=[NewRequest("a", 0, 0, 0.0, 1.0, 0, None)],
                                prefill=[PrefillChunk("a", [5, 6, 7], 0, [0], True)]))
    assert first.traced is prefill_traced
    expected = int(next_token(torch.tensor(7), torch.tensor(2), r.vocab_size))
    assert first.tokens == {"a": expected}
    second = r.execute(StepBatch(2, "decode", decode=[DecodeItem("a", expected, 3, [])]))
    assert second.traced is decode_traced
    assert second.tokens == {"a": int(next_token(torch.tensor(expected), torch.tensor(3), r.vocab_size))}


def test_sim_prefill_cost_interpolates_the_published_points():
    p = PROFILES["galaxy-llama-3.3-70b"]
    assert p.prefill_s(128) == pytest.approx(0.053) and p.prefill_s(4096) == pytest.approx(0.627)
    assert p.prefill_s(128) < p.prefill_s(p.bucket(500)) < p.prefill_s(4096)
    assert p.bucket(1) == 128 and p.bucket(1025) == 2048 and p.bucket(9000) == 16384


def _run_penalised(r: ModelRunner, steps: int, resume_after: int | None = None,
                   sampling: tuple = (0.0, 1.0, 0, None), **penalties) -> tuple[list[int], list]:
    """Decode of PROMPTS["greedy"] (greedy unless `sampling` = temperature, top_p, top_k, seed
    says otherwise), with `penalties` and 3 logprobs if any are given; `resume_after` tokens in,
    the request is released and re-added as a resumed one (prompt + outputs prefilled again, its
    history resent as the control plane does)."""
    prompt = PROMPTS["greedy"]

    def host(outputs: list[int]) -> HostSampling | None:
        return HostSampling(logprobs=3, prompt_token_ids=list(prompt), output_token_ids=list(outputs),
                            **penalties) if penalties else None

    new = NewRequest("p", 0, 2, *sampling, host=host([]))
    result = r.execute(StepBatch(1, "prefill", new_requests=[new],
                                 prefill=[PrefillChunk("p", prompt, 0, [4], True)]))
    out, results = [result.tokens["p"]], [result]
    step = 2
    while len(out) < steps:
        if len(out) == resume_after:
            new = NewRequest("p", 0, 3, *sampling, num_output_tokens=len(out), host=host(out))
            result = r.execute(StepBatch(step, "prefill", new_requests=[new], released_ids=["p"],
                                         prefill=[PrefillChunk("p", prompt + out, 0, [5], True)]))
        else:
            item = DecodeItem("p", out[-1], len(prompt) + len(out) - 1, [])
            result = r.execute(StepBatch(step, "decode", decode=[item]))
        out.append(result.tokens["p"])
        results.append(result)
        step += 1
    return out, results


def test_host_options_send_the_batch_to_the_host_and_return_logprobs(smollm2):
    r, _ = runner(smollm2, sample_on_device_mode="all")
    out, results = _run_penalised(r, 6, frequency_penalty=1.5, repetition_penalty=1.3)
    assert not any(res.sampled_on_device for res in results)
    for token, res in zip(out, results):
        lp = res.logprobs["p"]
        assert lp.token_ids[0] == token and len(lp.token_ids) == 4 and lp.rank >= 1
    plain, _ = generate(runner(smollm2)[0], steps=5)
    assert out != plain["greedy"][:6]  # the penalties changed the greedy continuation


@pytest.mark.parametrize("penalties", [dict(frequency_penalty=0.8), dict(repetition_penalty=1.3)])
def test_a_resumed_request_rebuilds_its_token_history_instead_of_doubling_it(smollm2, penalties):
    straight, _ = _run_penalised(runner(smollm2)[0], 10, **penalties)
    assert _run_penalised(runner(smollm2)[0], 10, resume_after=4, **penalties)[0] == straight


@pytest.mark.parametrize("mode", ["off", "all"])
def test_a_resumed_seeded_request_goes_on_with_the_tokens_of_an_uninterrupted_run(smollm2, mode):
    # Preempted, or migrated off a lost worker: its generator replays the draws it had made.
    seeded = (1.0, 1.0, 0, 77)
    straight, _ = _run_penalised(runner(smollm2, sample_on_device_mode=mode)[0], 12, sampling=seeded)
    resumed, _ = _run_penalised(runner(smollm2, sample_on_device_mode=mode)[0], 12, resume_after=5,
                                sampling=seeded)
    assert resumed == straight
    greedy, _ = _run_penalised(runner(smollm2)[0], 12)
    assert straight != greedy  # really sampled


def test_a_grammar_bitmask_sends_its_batch_to_the_host_and_masks_the_token(smollm2):
    r, _ = runner(smollm2, sample_on_device_mode="all")
    vocab = r.vocab_size
    allowed = 1234  # the only token the mask allows (bit 1234 % 32 of little-endian word 1234 // 32)
    words = [0] * ((vocab + 31) // 32)
    words[allowed // 32] = 1 << (allowed % 32)
    mask = b"".join(w.to_bytes(4, "little") for w in words)
    news = [NewRequest(rid, 0, row, 0.0, 1.0, 0, None) for row, rid in enumerate(PROMPTS)]
    result = r.execute(StepBatch(1, "prefill", new_requests=news, prefill=[
        PrefillChunk("greedy", PROMPTS["greedy"], 0, [0], True, mask),
        PrefillChunk("seeded", PROMPTS["seeded"], 0, [1], True)]))
    assert not result.sampled_on_device and result.tokens["greedy"] == allowed
    items = [DecodeItem("greedy", allowed, len(PROMPTS["greedy"]), [], token_bitmask=mask),
             DecodeItem("seeded", result.tokens["seeded"], len(PROMPTS["seeded"]), [])]
    decode = r.execute(StepBatch(2, "decode", decode=items))
    assert not decode.sampled_on_device and decode.tokens["greedy"] == allowed
    items = [DecodeItem(rid, decode.tokens[rid], len(PROMPTS[rid]) + 1, []) for rid in PROMPTS]
    assert r.execute(StepBatch(3, "decode", decode=items)).sampled_on_device  # no mask: back on the device


def _rows_run(smollm2, rows: dict[str, int]) -> tuple[dict, list]:
    r = runner(smollm2)[0]
    news = [NewRequest("greedy", 0, rows["greedy"], 0.0, 1.0, 0, None),
            NewRequest("seeded", 0, rows["seeded"], 0.8, 0.9, 50, 1234, host=HostSampling(logprobs=2))]
    out, results = run_steps(r, news, 6)
    return out, [result.logprobs for result in results[1:]]


def test_host_sampling_samples_the_live_rows_wherever_they_sit_and_keys_logprobs_by_request(smollm2):
    """Only live rows are sampled on the host (the others' logits are garbage by contract): a
    request's tokens and logprobs do not depend on which row it occupies or on empty rows."""
    first, lp_first = _rows_run(smollm2, {"greedy": 0, "seeded": 1})
    last, lp_last = _rows_run(smollm2, {"greedy": 3, "seeded": 2})
    assert first == last
    for a, b in zip(lp_first, lp_last):
        assert set(a) == set(b) == {"seeded"}
        assert a["seeded"].token_ids == b["seeded"].token_ids and a["seeded"].rank == b["seeded"].rank
