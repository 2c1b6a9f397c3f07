"""On-device sampling (ttserve.worker.sampling): the rules each parameter promises."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ttserve.worker.sampling import SamplingBatch, sample

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


def test_mixed_batch_keeps_greedy_rows_exact():
    logits = _logits(3)
    out = sample(logits, SamplingBatch([0.0, 1.0, 0.0], [0, 0, 0], [1.0] * 3))
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
