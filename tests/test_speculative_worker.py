"""Speculative decoding on the worker: the reference models' verify_forward (every position's
logits in one forward), sampling.py's acceptance (`verify`: greedy by argmax, sampled by rejection
sampling), the runner's verify steps (worker/runner.py `_verify`), step_check's refusals and the
wire fields (device.proto DecodeItem.draft_token_ids, SampledToken.num_accepted_drafts).

The properties: greedy verify steps give plain decoding's tokens whatever the drafts (all right,
some wrong, all wrong), with the accepted counts the drafts earn, and the KV of rejected positions
is rewritten (plain decode steps after them still agree); verify_forward's logits are decode's at
every position; sampled rows keep plain sampling's distribution (a chi-square test on a tiny
vocabulary); a seeded row is reproducible and draws one uniform per new token, so a resumed
request replays correctly; logprobs come per accepted draft.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import assert_logits_close

from ttserve.v1 import device_pb2
from ttserve.worker.backends.sim.model import PROFILES, SimModel, next_token
from ttserve.worker.backends.torch.backend import TorchBackend
from ttserve.worker.backends.torch.models import (TorchGemma3ForCausalLM, TorchLlamaForCausalLM,
                                                  TorchQwen2_5_VLForConditionalGeneration, paged_kv)
from ttserve.worker.backends.ttnn.backend import TtnnBackend
from ttserve.worker.batch import (DecodeItem, Description, GroupBlocks, HostSampling, NewRequest, PrefillChunk,
                                  ServingConfig, StepBatch, StepResult, TokenLogprobs)
from ttserve.worker.planning.mesh import resolve_mesh
from ttserve.worker.runner import DeviceOptions, ModelRunner
from ttserve.worker.sampling import SamplingBatch, _filtered_probs, seeded_generator, verify, verify_logprobs
from ttserve.worker.step_check import Limits, check_batch
from ttserve.worker.wire import batch_from_pb, description_to_pb, result_to_pb

BLOCK = 16
CONFIG = ServingConfig(num_lanes=2, max_num_seqs=2, max_model_len=128, max_num_batched_tokens=256)
# Rows 1 (lane 0) and 2 (lane 1) get drafts; row 0 (lane 0) never does: a plain decode row (k = 0)
# in every verify step. Block ids are lane-local: a and b hold the same ids in different lanes.
PROMPTS = {"a": [1, 504, 3458, 282, 4649], "b": [1, 9690, 314, 2185, 282, 3000], "c": [1, 28, 17, 44, 9, 310]}
ROWS = {"a": 1, "b": 2, "c": 0}
BLOCKS = {"a": [0, 1, 2], "b": [0, 1, 2], "c": [3, 4, 5]}
NEW_TOKENS = 24
K = 3                        # drafts per row at most
# Of the logits' scale: verify vs decode, both bf16. Decode and a prefill of the same sequence
# differ by up to 2.1% in bf16 on either path (measured); float32 agrees to 1e-4.
BF16_LOGIT_TOL = 0.04
TIE_GAP = 0.05               # of the logits' scale: a top-2 gap above it is a clear greedy decision
BF16_TIE = 1.0               # logits: a top-2 gap within bf16 noise at SmolLM2's scale (~30: 1/8 a unit)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread(single_torch_thread):
    """Memory-bound on a CPU, as the text models (conftest.single_torch_thread)."""


def make_runner(model_path, dtype: torch.dtype = torch.float32, model_cls: type = TorchLlamaForCausalLM,
                config: ServingConfig = CONFIG) -> ModelRunner:
    options = DeviceOptions()
    r = ModelRunner(model_path, model_cls, model_cls.__name__.removeprefix("Torch"),
                    TorchBackend(torch.device("cpu"), dtype, options.traced), dtype, block_size=BLOCK,
                    kv_cache_bytes=64 << 20, options=options)
    r.warmup(config, lambda *_: None)
    return r


def start(r: ModelRunner, news: list[NewRequest], prompts: dict[str, list[int]], blocks: dict[str, list[int]],
          groups=lambda ids, position: []) -> dict[str, list[int]]:
    """Prefill every prompt (one step); each request's first token."""
    result = r.execute(StepBatch(1, "prefill", new_requests=news, prefill=[
        PrefillChunk(rid, prompts[rid], 0, blocks[rid], True, groups=groups(blocks[rid], 0)) for rid in prompts]))
    assert not result.refused, result.refused
    return {rid: [t] for rid, t in result.tokens.items()}


def greedy_news() -> list[NewRequest]:
    return [NewRequest(rid, row // CONFIG.max_num_seqs, row, 0.0, 1.0, 0, None) for rid, row in ROWS.items()]


def decode(r: ModelRunner, out: dict[str, list[int]], prompts: dict[str, list[int]], drafts_of, step_id: int,
           groups=lambda ids, position: []) -> StepResult:
    """One decode step of every request short of NEW_TOKENS, each with drafts_of(rid) (cut to what
    it may still produce); appends each request's new tokens to `out`."""
    items = []
    for rid, tokens in out.items():
        if len(tokens) >= NEW_TOKENS:
            continue
        position = len(prompts[rid]) + len(tokens) - 1
        drafts = list(drafts_of(rid))[:NEW_TOKENS - len(tokens) - 1]
        items.append(DecodeItem(rid, tokens[-1], position, [], groups=groups([], position), draft_token_ids=drafts))
    result = r.execute(StepBatch(step_id, "decode", decode=items))
    assert not result.refused, result.refused
    for item in items:
        accepted = result.num_accepted.get(item.request_id, 0)
        out[item.request_id] += item.draft_token_ids[:accepted] + [result.tokens[item.request_id]]
    return result


def plain_greedy(r: ModelRunner, prompts=PROMPTS, news=None, blocks=BLOCKS, groups=lambda ids, position: []
                 ) -> dict[str, list[int]]:
    out = start(r, news or greedy_news(), prompts, blocks, groups)
    step = 2
    while any(len(t) < NEW_TOKENS for t in out.values()):
        decode(r, out, prompts, lambda rid: [], step, groups)
        step += 1
    return out


@pytest.fixture(scope="module", params=DTYPES, ids=["f32", "bf16"])
def dtype(request) -> torch.dtype:
    return request.param


@pytest.fixture(scope="module")
def reference(smollm2, dtype) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """Plain greedy decoding of the three requests: their tokens, and the gap between the top two
    logits where each token was chosen (asking for logprobs changes no greedy token)."""
    r = make_runner(smollm2, dtype)
    if dtype == torch.bfloat16:
        assert r.model.kernel_isa, "bf16 on this CPU should run vLLM CPU's kernels (the packed path)"
    news = [NewRequest(rid, row // CONFIG.max_num_seqs, row, 0.0, 1.0, 0, None, host=HostSampling(logprobs=2))
            for rid, row in ROWS.items()]
    result = r.execute(StepBatch(1, "prefill", new_requests=news, prefill=[
        PrefillChunk(rid, PROMPTS[rid], 0, BLOCKS[rid], True) for rid in PROMPTS]))
    out = {rid: [t] for rid, t in result.tokens.items()}
    gaps = {rid: [] for rid in out}
    results, step = [result], 2
    while any(len(t) < NEW_TOKENS for t in out.values()):
        results.append(decode(r, out, PROMPTS, lambda rid: [], step))
        step += 1
    for result in results:
        for rid, lp in result.logprobs.items():
            gaps[rid].append(lp.logprobs[1] - lp.logprobs[2])
    assert all(len(gaps[rid]) == len(out[rid]) == NEW_TOKENS for rid in out)
    return out, gaps


def wrong(token: int) -> int:
    return (token + 1) % 49152


# Draft policies: (the request's true next tokens, the step) -> drafts. "mixed" cycles through all
# right, a wrong second draft, all wrong, and no drafts at all (a plain decode step after verify
# steps: the positions a rejected draft wrote are computed again).
POLICIES = {
    "right": lambda truth, step: truth,
    "wrong": lambda truth, step: [wrong(t) for t in truth],
    "mixed": lambda truth, step: [truth, truth[:1] + [wrong(t) for t in truth[1:2]] + truth[2:],
                                  [wrong(t) for t in truth], []][step % 4],
}


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_verify_steps_give_plain_decodings_tokens(smollm2, dtype, reference, policy):
    """Token for token in float32. In bf16 the verify forward's GEMMs and attention see other
    shapes than decode's, so logits differ in rounding (BF16_LOGIT_TOL) and a near-tie the plain
    run broke one way may break the other (SmolLM2 has exact bf16 ties); a request whose tokens
    part from the plain run's there stops being compared (none does on the machine it was written
    on), anywhere else fails the test."""
    tokens, gaps = reference
    r = make_runner(smollm2, dtype)
    out = start(r, greedy_news(), PROMPTS, BLOCKS)
    step, verified, parted = 2, 0, {}
    while any(len(t) < NEW_TOKENS for t in out.values()):
        proposed = {rid: POLICIES[policy](tokens[rid][len(out[rid]):len(out[rid]) + K], step) if rid != "c" else []
                    for rid in out}
        before = {rid: len(t) for rid, t in out.items()}
        result = decode(r, out, PROMPTS, proposed.get, step)
        assert result.sampled_on_device is False
        for rid in list(out):
            d = next((i for i, (ours, theirs) in enumerate(zip(out[rid], tokens[rid])) if ours != theirs), None)
            if d is not None:  # parted from the plain run: only at a bf16 near-tie
                assert dtype == torch.bfloat16 and gaps[rid][d] <= BF16_TIE, (rid, d, gaps[rid][d])
                parted[rid] = out.pop(rid)
                continue
            drafts = proposed[rid][:NEW_TOKENS - before[rid] - 1]
            if before[rid] >= NEW_TOKENS or not drafts:
                assert rid not in result.num_accepted
                continue
            # Accepted: the run of drafts that are the model's own next tokens.
            truth = tokens[rid][before[rid]:]
            expected = next((j for j, t in enumerate(drafts) if t != truth[j]), len(drafts))
            assert result.num_accepted[rid] == expected, (rid, step, drafts, truth[:K])
            verified += 1
        step += 1
    assert out == {rid: t for rid, t in tokens.items() if rid not in parted}
    assert verified >= 8 or parted


# --- verify_forward's logits --------------------------------------------------------------------

def load(smollm2, dtype: torch.dtype) -> TorchLlamaForCausalLM:
    config = json.loads((smollm2 / "config.json").read_text())
    return TorchLlamaForCausalLM.initialize_vllm_model(config, torch.device("cpu"), max_batch_size=2, max_seq_len=128,
                                                       tt_data_parallel=2, model_path=str(smollm2), dtype=dtype)


def cache(model: TorchLlamaForCausalLM, kernels: bool) -> list:
    s = model.shape
    kv = model.allocate_kv_cache((12, s.num_kv_heads, BLOCK, s.head_dim), model.dtype, s.num_layers)
    if kernels:
        assert model.kernel_isa, "the kernels should serve bf16 here"
        return kv
    return paged_kv.allocate(model.lanes, s.num_layers, 13, s.num_kv_heads, BLOCK, s.head_dim, model.dtype,
                             torch.device("cpu"))


@pytest.mark.parametrize("dtype, kernels", [(torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)],
                         ids=["f32", "bf16-kernels", "bf16-plain"])
def test_verify_forward_logits_are_decode_logits_at_every_position(smollm2, dtype, kernels):
    """Batch rows 1 (lane 0) and 2 (lane 1) at different lengths and positions, one padded: each
    position's logits are what decode computes there, the last what a prefill of the whole
    sequence computes, and the KV verify wrote serves the next decode as decode's own does."""
    model = load(smollm2, dtype)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, model.shape.vocab_size, (n,), generator=g).tolist() for n in (41, 33)]
    cut, count = [30, 25], [10, 7]      # prefilled; then verified
    rows = [1, 2]
    table = torch.tensor([[4, 0, 7, -1], [2, 9, 5, -1]], dtype=torch.int32)  # lane-local ids
    tol = 1e-4 if dtype == torch.float32 else BF16_LOGIT_TOL

    def prefilled() -> list:
        kv = cache(model, kernels)
        width = max(cut)
        tokens = torch.tensor([s[:width] for s in seqs])
        model.prefill_forward(tokens, table, kv, prompt_lens=cut, empty_slots=rows)
        return kv

    def decode_step(kv, pos: list[int]) -> torch.Tensor:
        feed = torch.zeros(4, 1, dtype=torch.long)
        start = torch.full((4,), -1)
        full = torch.zeros(4, 4, dtype=torch.int32)
        for i, (row, p) in enumerate(zip(rows, pos)):
            if p < len(seqs[i]):
                feed[row], start[row], full[row] = seqs[i][p], p, table[i]
        return model.decode_forward(feed, start, full, kv)[:, 0]

    kv_decode = prefilled()
    decoded = [decode_step(kv_decode, [cut[0] + j, cut[1] + j]) for j in range(max(count) + 1)]
    kv_verify = prefilled()
    tokens = torch.zeros(2, max(count), dtype=torch.long)
    for i in range(2):
        tokens[i, :count[i]] = torch.tensor(seqs[i][cut[i]:cut[i] + count[i]])
    logits = model.verify_forward(tokens, torch.tensor(cut), table, kv_verify, torch.tensor(count), empty_slots=rows)
    assert logits.shape == (2, max(count), model.shape.vocab_size) and logits.dtype == torch.float32
    clear = 0
    for i, row in enumerate(rows):
        for j in range(count[i]):
            ref = decoded[j][row]
            assert_logits_close(logits[i, j], ref, tol)
            top = ref.topk(2).values
            if float(top[0] - top[1]) > TIE_GAP * float(ref.abs().max()):
                assert int(logits[i, j].argmax()) == int(ref.argmax())
                clear += 1
    assert clear >= 2  # the argmax comparison has teeth (random tokens: mostly flat distributions)
    # The next position, after the verified ones: the KV verify wrote is decode's.
    after = decode_step(kv_verify, [cut[0] + count[0], cut[1] + count[1]])
    for i, row in enumerate(rows):
        assert_logits_close(after[row], decoded[count[i]][row], tol)
    # The last verified position is a prefill of the sequence up to it.
    end = cut[0] + count[0]
    whole = model.prefill_forward(torch.tensor([seqs[0][:end]]), table[:1], cache(model, kernels), prompt_lens=[end],
                                  empty_slots=[1])[0, 0]
    assert_logits_close(logits[0, count[0] - 1], whole, tol)


def test_qwen2_5_vl_verify_rotates_each_row_by_its_rope_delta(tiny_vlm):
    """The mRoPE model's verify_forward takes rope_deltas_all_users as its decode does: batch row
    empty_slots[i]'s delta shifts the row's rotary positions, so verified logits are decode's with
    the same deltas (and differ without them)."""
    config = ModelRunner.read_config(tiny_vlm)
    model = TorchQwen2_5_VLForConditionalGeneration.initialize_vllm_model(
        config, torch.device("cpu"), max_batch_size=2, max_seq_len=256, tt_data_parallel=2, model_path=str(tiny_vlm))
    g = torch.Generator().manual_seed(4)
    seq = torch.randint(0, 200, (20,), generator=g).tolist()    # text: no image placeholders
    table = torch.tensor([[3, 1, -1, -1]], dtype=torch.int32)
    deltas = [0, 0, 0, -7]                                      # batch row 3 (lane 1)
    s = model.shape

    def prefilled() -> list:
        kv = model.allocate_kv_cache((8, s.num_kv_heads, BLOCK, s.head_dim), torch.float32, s.num_layers)
        model.prefill_forward(torch.tensor([seq[:14]]), table, kv, prompt_lens=[14], empty_slots=[3])
        return kv

    kv = prefilled()
    decoded = []
    for p in range(14, 20):
        feed, pos = torch.zeros(4, 1, dtype=torch.long), torch.full((4,), -1)
        full = torch.zeros(4, 4, dtype=torch.int32)
        feed[3], pos[3], full[3] = seq[p], p, table[0]
        decoded.append(model.decode_forward(feed, pos, full, kv, rope_deltas_all_users=deltas)[3, 0])
    verified = model.verify_forward(torch.tensor([seq[14:20]]), [14], table, prefilled(), [6], empty_slots=[3],
                                    rope_deltas_all_users=deltas)[0]
    for j, ref in enumerate(decoded):
        assert_logits_close(verified[j], ref)
    unshifted = model.verify_forward(torch.tensor([seq[14:20]]), [14], table, prefilled(), [6], empty_slots=[3],
                                     rope_deltas_all_users=[0, 0, 0, 0])[0]
    # The tiny random model's logits move little with position: 0.24% of their scale, 24x the tolerance.
    assert float((unshifted[-1] - decoded[-1]).abs().max()) > 1e-3 * float(decoded[-1].abs().max())


def test_verify_forward_refuses_rows_without_tokens(smollm2):
    model = load(smollm2, torch.float32)
    kv = cache(model, False)
    with pytest.raises(ValueError, match="num_tokens"):
        model.verify_forward(torch.zeros(1, 2, dtype=torch.long), torch.tensor([0]),
                             torch.zeros(1, 4, dtype=torch.int32), kv, torch.tensor([3]))


# --- rejection sampling is distribution-exact -----------------------------------------------------

TRIALS = 20_000
LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.5],    # draft 0 judged here
                       [-1.0, 0.3, 1.2, 0.0, 0.8, -0.2],     # draft 1 (and the bonus of one draft)
                       [0.5, 0.5, -1.0, 1.5, 0.0, -2.0]])    # the bonus after two drafts


def chi_square_p_value(counts: torch.Tensor, p: torch.Tensor) -> float:
    """The chi-square goodness-of-fit p-value of `counts` against probabilities `p`; a category of
    probability 0 must never occur."""
    assert int(counts[p == 0].sum()) == 0, "a token of probability 0 was output"
    n = float(counts.sum())
    expected = p[p > 0].double() * n
    stat = float(((counts[p > 0].double() - expected) ** 2 / expected).sum())
    df = int((p > 0).sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def target(position: int, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    return _filtered_probs(LOGITS[position:position + 1], torch.tensor([temperature]), torch.tensor([top_k]),
                           torch.tensor([top_p]), torch.tensor([min_p]))[0]


@pytest.mark.parametrize("drafts, sampling", [
    ([0, 2], (1.0, 0, 1.0, 0.0)),         # the likely token first (p ~ 0.55)
    ([5, 4], (1.0, 0, 1.0, 0.0)),         # an unlikely first draft (p ~ 0.02)
    ([1, 3], (0.7, 4, 0.9, 0.05)),        # temperature, top-k, top-p and min-p filter the rows
    ([5, 2], (0.7, 4, 0.9, 0.05)),        # a draft the filters exclude: never accepted
], ids=["likely", "unlikely", "filtered", "excluded"])
def test_rejection_sampling_keeps_plain_samplings_distribution(drafts, sampling):
    """TRIALS rows of the same logits and drafts: the first new token is distributed as p_0, given
    draft 0's acceptance the second as p_1, and given both the bonus as p_2 (a chi-square test
    each, p-value > 1e-3; the global RNG is seeded, so the test is deterministic)."""
    temperature, top_k, top_p, min_p = sampling
    host = HostSampling(min_p=min_p) if min_p else None
    batch = SamplingBatch([temperature] * TRIALS, [top_k] * TRIALS, [top_p] * TRIALS, host=[host] * TRIALS)
    torch.manual_seed(0)
    accepted, tokens = verify(LOGITS.expand(TRIALS, -1, -1), [drafts] * TRIALS, batch)
    accepted_t = torch.tensor(accepted)
    first = torch.where(accepted_t >= 1, drafts[0], tokens)
    p0, p1 = target(0, *sampling), target(1, *sampling)
    assert chi_square_p_value(torch.bincount(first, minlength=6), p0) > 1e-3
    after = accepted_t >= 1
    second = torch.where(accepted_t[after] >= 2, drafts[1], tokens[after])
    if int(after.sum()):
        assert chi_square_p_value(torch.bincount(second, minlength=6), p1) > 1e-3
    else:
        assert float(p0[drafts[0]]) == 0.0
    both = accepted_t == 2  # the bonus after every draft: p_2 (where enough rows get there to test)
    if int(both.sum()) >= 1000:
        assert chi_square_p_value(torch.bincount(tokens[both], minlength=6), target(2, *sampling)) > 1e-3
    # A rejected draft is never the correction; the acceptance rate is p_0(draft).
    rejected = accepted_t == 0
    assert not bool((tokens[rejected] == drafts[0]).any())
    assert abs(float(after.double().mean()) - float(p0[drafts[0]])) < 5 * (0.25 / TRIALS) ** 0.5


def test_all_drafts_accepted_takes_the_bonus_from_the_last_position():
    """A draft of probability 1 (top_k 1 would be greedy: here the filters leave one token) is
    always accepted, and the bonus after the last draft follows p_k."""
    batch = SamplingBatch([1.0] * TRIALS, [0] * TRIALS, [1e-6] * TRIALS)   # top_p ~ 0: the argmax alone
    torch.manual_seed(1)
    accepted, tokens = verify(LOGITS.expand(TRIALS, -1, -1), [[0, 2]] * TRIALS, batch)
    assert set(accepted) == {2} and set(tokens.tolist()) == {3}


def test_greedy_plain_and_sampled_rows_in_one_call():
    """Greedy rows (temperature 0, or top_k 1) accept by argmax; a row without drafts is `sample`
    of position 0 with its own rules (here a bitmask allowing token 4 alone); a sampled row whose
    top_p leaves the argmax alone accepts the same way; [R] tokens on the host."""
    mask = (1 << 4).to_bytes(4, "little")
    batch = SamplingBatch([0.0, 0.7, 0.0, 1.0], [0, 1, 0, 0], [1.0, 1.0, 1.0, 1e-6], bitmasks=[None, None, mask, None])
    accepted, tokens = verify(LOGITS.expand(4, -1, -1), [[0, 2], [0, 1], [], [0, 2]], batch)
    assert accepted == [2, 1, 0, 2] and tokens.tolist() == [3, 2, 4, 3] and tokens.device.type == "cpu"


def test_drafts_with_rules_beyond_the_logits_are_refused_by_verify():
    batch = SamplingBatch([0.0], [0], [1.0], host=[HostSampling(presence_penalty=0.5)])
    with pytest.raises(ValueError, match="penalties"):
        verify(LOGITS[None], [[0]], batch)


# --- seeded rows ----------------------------------------------------------------------------------

@pytest.mark.parametrize("drafts", [[0, 2], [5, 4], [0, 1]], ids=str)
def test_a_seeded_row_draws_one_uniform_per_new_token_and_repeats_itself(drafts):
    runs = []
    for _ in range(2):
        g = seeded_generator(1234)
        accepted, tokens = verify(LOGITS[None], [drafts], SamplingBatch([0.9], [0], [1.0], [g]))
        replayed = seeded_generator(1234, accepted[0] + 1)
        assert torch.equal(g.get_state(), replayed.get_state()), accepted
        runs.append((accepted, tokens.tolist()))
    assert runs[0] == runs[1]


SEEDED = NewRequest("s", 0, 1, 0.8, 0.9, 50, 1234)


def seeded_run(smollm2, verify_steps: int) -> tuple[dict[str, list[int]], ModelRunner]:
    """Request "s" (seeded, sampled) through `verify_steps` verify steps whose drafts repeat its last
    tokens (some accepted by chance, most rejected), then one plain decode step."""
    r = make_runner(smollm2)
    prompts = {"s": PROMPTS["a"]}
    out = start(r, [SEEDED], prompts, {"s": BLOCKS["a"]})
    for step in range(verify_steps):
        decode(r, out, prompts, lambda rid: (out[rid][-2:] + [13])[:K], 2 + step)
    decode(r, out, prompts, lambda rid: [], 2 + verify_steps)
    return out, r


def test_a_seeded_request_is_reproducible_and_resumes_with_its_draws_replayed(smollm2):
    first, _ = seeded_run(smollm2, 6)
    second, _ = seeded_run(smollm2, 6)
    assert first == second and len(first["s"]) >= 8
    # Resumed elsewhere after the verify steps: the new worker replays num_output_tokens draws (one
    # per token so far, accepted drafts included) and samples the token the plain step sampled.
    tokens = first["s"]
    r = make_runner(smollm2)
    resumed = NewRequest("s", 0, 1, 0.8, 0.9, 50, 1234, num_output_tokens=len(tokens) - 1)
    out = start(r, [resumed], {"s": PROMPTS["a"] + tokens[:-1]}, {"s": BLOCKS["a"]})
    assert out["s"] == tokens[-1:]


# --- logprobs -------------------------------------------------------------------------------------

def test_logprobs_come_for_each_accepted_draft_and_the_final_token(smollm2):
    """Request a asks for 2 logprobs: a plain run's per-token logprobs, and a verify run's entries,
    one per accepted draft (the draft first) plus the final token's, agree token by token."""
    news = [NewRequest("a", 0, ROWS["a"], 0.0, 1.0, 0, None, host=HostSampling(logprobs=2))]
    prompts = {"a": PROMPTS["a"]}

    def run(drafts_of) -> tuple[list[int], list[TokenLogprobs], list[StepResult]]:
        r = make_runner(smollm2)
        out = start(r, news, prompts, BLOCKS)
        logprobs, results, step = [], [], 2
        while len(out["a"]) < NEW_TOKENS:
            result = decode(r, out, prompts, drafts_of(out), step)
            logprobs += result.draft_logprobs.get("a", []) + [result.logprobs["a"]]
            results.append(result)
            step += 1
        return out["a"], logprobs, results

    truth, plain, _ = run(lambda out: lambda rid: [])
    tokens, verified, results = run(lambda out: lambda rid: truth[len(out[rid]):len(out[rid]) + K])
    assert tokens == truth
    assert len(verified) == len(plain) and any(r.num_accepted.get("a") for r in results)
    for ours, theirs in zip(verified, plain):
        assert ours.token_ids == theirs.token_ids and ours.rank == theirs.rank
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-4)
    # On the wire: the accepted count and one DraftLogprobs per accepted draft.
    result = next(r for r in results if r.num_accepted.get("a"))
    [sampled] = result_to_pb(result).tokens
    assert sampled.num_accepted_drafts == result.num_accepted["a"] == len(sampled.draft_logprobs)
    assert [list(d.token_ids) for d in sampled.draft_logprobs] == [d.token_ids for d in result.draft_logprobs["a"]]
    assert list(sampled.logprob_token_ids) == result.logprobs["a"].token_ids


def test_verify_logprobs_layout():
    """Direct: the final entry is at the accepted count's position; rows that did not ask get none."""
    logits = LOGITS.expand(2, -1, -1)
    batch = SamplingBatch([0.0, 0.0], [0, 0], [1.0, 1.0], host=[HostSampling(logprobs=1), None])
    per_draft, final = verify_logprobs(logits, [[0, 5], [0, 2]], [1, 2], torch.tensor([2, 3]), batch)
    raw = LOGITS.log_softmax(-1)
    assert [e.token_ids for e in per_draft[0]] == [[0, 0]] and per_draft[1] == [] and final[1] is None
    assert final[0].token_ids == [2, 2] and final[0].logprobs[0] == pytest.approx(float(raw[1, 2]))


# --- step_check -----------------------------------------------------------------------------------

class Held:
    def __init__(self, row: int, blocks: list[int], host: HostSampling | None = None,
                 blocked: list[int] | None = None) -> None:
        self.row, self.block_ids, self.prefix, self.group_lengths = row, blocks, [], []
        self.host, self.blocked_token_ids = host, blocked


LIMITS = Limits(num_lanes=1, max_num_seqs=4, num_blocks_per_lane=16, block_size=4, max_model_len=32,
                page_table_width=8, vocab_size=100, speculative=True)
LIVE = {"old": Held(1, [5, 6]), "penalised": Held(2, [7, 8], HostSampling(frequency_penalty=0.5)),
        "min_tokens": Held(3, [9, 10], blocked=[2]), "asks": Held(0, [3, 4], HostSampling(logprobs=2, min_p=0.1))}


@pytest.mark.parametrize("item, limits, reason", [
    (DecodeItem("old", 5, 5, [], draft_token_ids=[1, 2]), LIMITS, None),        # positions 6, 7: the blocks cover 8
    (DecodeItem("asks", 5, 6, [], draft_token_ids=[1]), LIMITS, None),          # logprobs and min_p: verifiable
    (DecodeItem("old", 5, 6, [11], draft_token_ids=[1, 2, 3]), LIMITS, None),   # a new block covers position 9
    (DecodeItem("old", 5, 5, [], draft_token_ids=[1, 2, 3]), LIMITS, "reach position 8, but its blocks cover 8"),
    (DecodeItem("old", 5, 5, [], draft_token_ids=[1, 100]), LIMITS, "draft token id(s) 100 outside the vocabulary"),
    (DecodeItem("old", 5, 6, [], use_previous_token=True, draft_token_ids=[1]), LIMITS, "use_previous_token"),
    (DecodeItem("old", 5, 6, [], token_bitmask=b"\xff", draft_token_ids=[1]), LIMITS, "grammar bitmask"),
    (DecodeItem("penalised", 5, 6, [], draft_token_ids=[1]), LIMITS, "penalties"),
    (DecodeItem("min_tokens", 5, 6, [], draft_token_ids=[1]), LIMITS, "min_tokens still masks"),
    (DecodeItem("old", 5, 6, [], draft_token_ids=[1]), replace(LIMITS, speculative=False), "cannot verify them"),
], ids=["fits", "logprobs-min-p", "new-block", "blocks", "vocab", "carried", "bitmask", "penalties", "min-tokens",
        "no-speculation"])
def test_step_check_validates_draft_tokens(item, limits, reason):
    kept, refused = check_batch(StepBatch(2, "decode", decode=[item]), limits, LIVE)
    if reason is None:
        assert not refused and kept.decode == [item]
    else:
        assert reason in refused[item.request_id] and not kept.decode


def test_drafts_past_max_model_len_are_refused():
    limits = Limits(num_lanes=1, max_num_seqs=4, num_blocks_per_lane=16, block_size=4, max_model_len=10,
                    page_table_width=8, vocab_size=100, speculative=True)
    _, refused = check_batch(StepBatch(2, "decode", decode=[DecodeItem("old", 5, 7, [], draft_token_ids=[1, 2, 3])]),
                             limits, LIVE)
    assert "reach position 10, past max_model_len 10" in refused["old"]


def test_a_new_requests_sampling_is_read_for_its_drafts():
    new = NewRequest("n", 0, 2, 0.0, 1.0, 0, None, min_tokens=3, min_tokens_blocked_ids=[2])
    _, refused = check_batch(StepBatch(2, "decode", new_requests=[new],
                                       decode=[DecodeItem("n", 5, 0, [0], draft_token_ids=[1])]), LIMITS, {})
    assert "min_tokens still masks" in refused["n"]


# --- capability and wire --------------------------------------------------------------------------

def test_the_capability_is_the_classes_and_the_wire_carries_drafts(smollm2):
    backend = TorchBackend(torch.device("cpu"), torch.float32, DeviceOptions().traced)

    def supports(model_cls: type) -> bool:
        return ModelRunner(smollm2, model_cls, "LlamaForCausalLM", backend, torch.float32, 16, 1 << 20
                           ).supports_speculative_decoding

    sim = SimModel.for_profile(PROFILES["n300-llama-3.1-8b"])
    assert supports(TorchLlamaForCausalLM) and supports(TorchGemma3ForCausalLM)
    assert not supports(type("NoVerify", (sim,), {"verify_forward": None}))  # a class that declares none
    # A mesh never takes drafts: the TT plugin's speculative contract is its own (model_capabilities
    # supports_spec_decode, spec_plan, decode_forward over [B, 1 + K]; vllm_tt_plugin's spec decode
    # contract module), which ttserve does not drive, and verify_forward is ttserve's name, not tt-metal's.
    mesh = TtnnBackend(resolve_mesh("N150", 1), {})
    declares = type("Declares", (), {"verify_forward": lambda self, **kw: torch.ones(1, 2, 3),
                                     "model_capabilities": {"supports_spec_decode": True},
                                     "spec_plan": classmethod(lambda cls, *a: None)})
    assert not mesh.verifies_drafts(declares)
    with pytest.raises(NotImplementedError):
        mesh.verify(declares(), tokens=None)
    pb = device_pb2.StepBatch(step_id=3, kind=device_pb2.STEP_KIND_DECODE,
                              decode=[device_pb2.DecodeItem(request_id="a", token_id=5, position=9,
                                                            draft_token_ids=[7, 8])])
    assert batch_from_pb(pb).decode[0].draft_token_ids == [7, 8]
    d = Description("torch", "cpu", "m", "LlamaForCausalLM", 10, 10, {}, True, [], False, False, False, False,
                    False, 0, "float32", False, supports_speculative_decoding=True)
    assert description_to_pb(d).supports_speculative_decoding


def test_the_sim_verifies_its_own_next_tokens_through_the_runner(smollm2):
    options = DeviceOptions({}, backend_traces=True, kv_tokens_per_lane=4096)
    r = ModelRunner(smollm2, SimModel.for_profile(PROFILES["n300-llama-3.1-8b"]), "LlamaForCausalLM",
                    TorchBackend(torch.device("cpu"), torch.float32, options.traced), torch.float32, 16, 64 << 20,
                    options)
    r.warmup(ServingConfig(1, 4, 256, 256), lambda *_: None)
    first = r.execute(StepBatch(1, "prefill", new_requests=[NewRequest("a", 0, 0, 0.0, 1.0, 0, None)],
                                prefill=[PrefillChunk("a", [5, 6, 7], 0, [0], True)])).tokens["a"]
    own = [first]
    for position in (3, 4, 5):
        own.append(int(next_token(torch.tensor(own[-1]), torch.tensor(position), r.vocab_size)))
    item = DecodeItem("a", first, 3, [], draft_token_ids=[own[1], own[2], 9])
    result = r.execute(StepBatch(2, "decode", decode=[item]))
    assert result.num_accepted == {"a": 2} and result.tokens == {"a": own[3]}


# --- hybrid KV groups (Gemma 3) -------------------------------------------------------------------

GEMMA_ROWS = {"a": 0, "b": 1, "c": 3}
GEMMA_BLOCKS = {"a": [0, 1, 2, 3, 4], "b": [5, 6, 7, 8, 9], "c": [0, 1, 2, 3, 4]}
GROUP_SHIFTS = (10, 20)   # the sliding groups' block ids, past the full group's


def gemma_groups(new_block_ids: list[int], position: int) -> list[GroupBlocks]:
    from ttserve.worker.planning.tiny_gemma3 import SLIDING_WINDOW
    skipped = max(0, (position - SLIDING_WINDOW + 1) // BLOCK)
    return [GroupBlocks([b + shift for b in new_block_ids], skipped) for shift in GROUP_SHIFTS]


def test_hybrid_gemma3_verify_steps_page_each_group_and_give_plain_decodings_tokens(tiny_gemma3):
    """Two lanes of two rows, float32; prompts and outputs run past the 16-token window, so the
    sliding groups skip blocks while drafts are verified through each group's table."""
    config = ServingConfig(num_lanes=2, max_num_seqs=2, max_model_len=128, max_num_batched_tokens=256)
    g = torch.Generator().manual_seed(5)
    prompts = {rid: torch.randint(0, 256, (n,), generator=g).tolist() for rid, n in (("a", 40), ("b", 34), ("c", 47))}
    news = [NewRequest(rid, row // 2, row, 0.0, 1.0, 0, None) for rid, row in GEMMA_ROWS.items()]
    plain = plain_greedy(make_runner(tiny_gemma3, model_cls=TorchGemma3ForCausalLM, config=config), prompts, news,
                         GEMMA_BLOCKS, gemma_groups)
    r = make_runner(tiny_gemma3, model_cls=TorchGemma3ForCausalLM, config=config)
    assert r.kv_groups.hybrid and r.supports_speculative_decoding
    tables = []
    verify_forward = r.model.verify_forward
    r.model.verify_forward = lambda **kw: tables.append(len(kw["page_tables_per_layer"])) or verify_forward(**kw)
    out = start(r, news, prompts, GEMMA_BLOCKS, gemma_groups)
    step = 2
    while any(len(t) < NEW_TOKENS for t in out.values()):
        policy = POLICIES["mixed"]
        decode(r, out, prompts, lambda rid: policy(plain[rid][len(out[rid]):len(out[rid]) + K], step) if rid != "c"
               else [], step, gemma_groups)
        step += 1
    assert out == plain
    assert tables and set(tables) == {r.model.shape.num_layers}
