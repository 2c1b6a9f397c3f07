"""On-device sampling: turns a step's logits into one token id per row, inside the model call.

Only what the device path can express lives here: temperature, top-k, top-p and a per-request
seed. Anything else (logprobs, penalties, grammar masks, ...) is the host sampler's job; the
runner decides per batch which path a batch takes (DESIGN.md §3 "Sampling").

Reproducibility rule: a request with a seed owns a `torch.Generator` that persists across its
steps, and every step draws exactly one exponential per vocabulary entry from it, whatever the
other rows of the batch are. So a seeded request yields the same tokens alone or in any batch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters; row i of the batch is row i of the logits.

    temperature: 0 (or less) means greedy. top_k: 0 or less means off. top_p: 1 means off.
    generators: the request's own generator when it asked for a seed, else None (the global
    RNG of the logits' device is used).
    """

    temperature: Sequence[float] | torch.Tensor
    top_k: Sequence[int] | torch.Tensor
    top_p: Sequence[float] | torch.Tensor
    generators: list[torch.Generator | None] = field(default_factory=list)
    # Per row, token ids that must not be sampled this step (EOS and stop ids before
    # min_tokens), or None.
    blocked_token_ids: list[list[int] | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.temperature)
        if not self.generators:
            self.generators = [None] * n
        if not self.blocked_token_ids:
            self.blocked_token_ids = [None] * n
        if not (len(self.top_k) == len(self.top_p) == len(self.generators) == n):
            raise ValueError(
                f"SamplingBatch fields differ in length: temperature={n} top_k={len(self.top_k)} "
                f"top_p={len(self.top_p)} generators={len(self.generators)}")

    def __len__(self) -> int:
        return len(self.temperature)

    def select(self, rows: list[int]) -> SamplingBatch:
        """The batch of the given rows, in that order."""
        pick = lambda values: [values[r] for r in rows]  # noqa: E731
        return SamplingBatch([float(t) for t in pick(self.temperature)], [int(k) for k in pick(self.top_k)],
                             [float(p) for p in pick(self.top_p)], pick(self.generators),
                             pick(self.blocked_token_ids))

    @classmethod
    def greedy(cls, rows: int) -> SamplingBatch:
        return cls([0.0] * rows, [0] * rows, [1.0] * rows)


def _as_tensor(values: Sequence[float] | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", dtype)
    return torch.tensor(list(values), dtype=dtype)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Samples one token per row of `logits` [B, V]; returns [B] int64 on the logits' device.

    Rows past len(batch) are padding: they are not sampled and return 0.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    n = len(batch)
    if n > rows:
        raise ValueError(f"SamplingBatch has {n} rows but logits only {rows}")
    out = torch.zeros(rows, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    if any(ids for ids in batch.blocked_token_ids):
        logits = logits.clone()
        for row, ids in enumerate(batch.blocked_token_ids):
            if ids:
                logits[row, ids] = float("-inf")

    temperature = _as_tensor(batch.temperature, torch.float32)
    top_k = _as_tensor(batch.top_k, torch.int64)
    # top_k == 1 keeps only the argmax, whatever the temperature: greedy without drawing.
    greedy = (temperature <= 0) | (top_k == 1)
    if bool(greedy.all()):
        out[:n] = logits[:n].argmax(dim=-1)
        return out

    greedy_rows = greedy.nonzero().flatten()
    if greedy_rows.numel():
        idx = greedy_rows.to(logits.device)
        out[idx] = logits[idx].argmax(dim=-1)

    sampled_rows = (~greedy).nonzero().flatten()
    idx = sampled_rows.to(logits.device)
    probs = _filtered_probs(
        logits[idx].float(),
        temperature[sampled_rows].to(logits.device),
        top_k[sampled_rows].to(logits.device),
        _as_tensor(batch.top_p, torch.float32)[sampled_rows].to(logits.device),
    )
    # Exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks index i with probability p_i,
    # and it lets each seeded row draw from its own generator without touching the others.
    race = torch.empty_like(probs).exponential_()
    for j, row in enumerate(sampled_rows.tolist()):
        gen = batch.generators[row]
        if gen is not None:
            draw = torch.empty(vocab, dtype=torch.float32, device=gen.device)
            race[j] = draw.exponential_(generator=gen).to(probs.device)
    # A zero draw would turn 0/0 into NaN for a filtered-out token; keep draws positive.
    race.clamp_(min=torch.finfo(race.dtype).tiny)
    out[idx] = (probs / race).argmax(dim=-1)
    return out


def _filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> torch.Tensor:
    """Softmax of logits/temperature restricted to each row's top-k and then top-p set.

    Every row keeps at least its most likely token, so no row ends with all-zero probabilities.
    """
    vocab = logits.shape[-1]
    scaled = logits / temperature.unsqueeze(-1)
    masked_value = torch.finfo(scaled.dtype).min

    k = torch.where((top_k <= 0) | (top_k >= vocab), torch.full_like(top_k, vocab), top_k)
    if bool((k < vocab).any()):
        # The k-th largest value of each row is its threshold; ties at the threshold are kept.
        sorted_desc = scaled.sort(dim=-1, descending=True).values
        threshold = sorted_desc.gather(-1, (k - 1).unsqueeze(-1))
        scaled = scaled.masked_fill(scaled < threshold, masked_value)

    if bool((top_p < 1).any()):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # A token is dropped when the tokens ranked above it already reach top_p.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before > top_p.unsqueeze(-1)
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, masked_value)

    return scaled.softmax(dim=-1)
