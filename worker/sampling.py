"""Sampling: turns a step's logits into one token id per row, on the device or on the host.

The device path (inside the model call) expresses temperature, top-k, top-p and a per-request
seed. The host path runs the same `sample` with each row's `HostSampling` too: allowed token
ids, bad words, min_tokens, logit_bias and penalties on the logits, then min_p after the
temperature, in vLLM's order (vllm/v1/sample/sampler.py), and `gather_logprobs` for the rows
that asked. The runner decides per batch which path a batch takes (docs/architecture.md, "The worker").

Reproducibility rule: a request with a seed owns a `torch.Generator` that persists across its
steps, and every token it samples draws exactly one uniform from it, whatever the other rows of
the batch are. So a seeded request yields the same tokens alone or in any batch,
and one that resumes elsewhere (preempted, or migrated off a lost worker) replays its draws
(`seeded_generator`) and goes on with the tokens an uninterrupted run gives.

Speculative decoding (`verify`): a verify step's row judges its draft tokens against the model's
logits at each draft's position and returns the accepted drafts and one token after them, with
plain sampling's output distribution (greedy: its exact tokens). It keeps the rule above: each of
the row's new tokens, accepted draft or final, costs its generator exactly one uniform, so a
resumed request's replay stays right. A uniform decides a token differently in a verify step
(u < p(draft)) than in a plain one (the inverse CDF), so a seeded sampled request gives the same
tokens for the same drafts, and other tokens of the same distribution for other drafts.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Concatenate, ParamSpec, TypeVar

import torch

from .batch import HostSampling, TokenLogprobs

# Logits of at most this many entries (one row of a 128K vocabulary) are sampled on one thread.
# Their ops are too small to gain from a team, and a team that slept while a device computed
# must first be woken: on 2 vCPUs, one row of SmolLM2's 49,152 logits after 50 ms idle took
# 4.1 ms on 2 threads and 1.2 ms on 1 (0.2-0.3 ms either way with the team awake). At 4 rows an
# awake team was faster (1.8 vs 2.1 ms); 2 and 3 rows measured within noise of either.
ONE_THREAD_ENTRIES = 1 << 17

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _one_thread_when_small(fn: Callable[Concatenate[torch.Tensor, _P], _R]
                           ) -> Callable[Concatenate[torch.Tensor, _P], _R]:
    """Runs `fn(logits, ...)` on one torch thread when the logits are on the CPU and small
    (ONE_THREAD_ENTRIES); the calling thread's count is restored after, also on a raise.

    torch keeps the count per thread, and a thread takes the process's default at its first
    parallel op: a thread whose first op fell inside another's window would keep 1 for good. The
    worker runs every torch op of its steps on its one device thread, so none does."""
    @functools.wraps(fn)
    def wrapper(logits: torch.Tensor, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        threads = torch.get_num_threads()
        if threads == 1 or logits.device.type != "cpu" or logits.numel() > ONE_THREAD_ENTRIES:
            return fn(logits, *args, **kwargs)
        torch.set_num_threads(1)
        try:
            return fn(logits, *args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return wrapper


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
    # Per row, the options only the host sampler applies, or None.
    host: list[HostSampling | None] = field(default_factory=list)
    # Per row, a grammar's allowed tokens (llguidance's bitmask: bit i of little-endian int32
    # words allows token i; ids past its end are disallowed), or None.
    bitmasks: list[bytes | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.temperature)
        if not self.generators:
            self.generators = [None] * n
        if not self.blocked_token_ids:
            self.blocked_token_ids = [None] * n
        if not self.host:
            self.host = [None] * n
        if not self.bitmasks:
            self.bitmasks = [None] * n
        if not (len(self.top_k) == len(self.top_p) == len(self.generators) == len(self.host)
                == len(self.bitmasks) == n):
            raise ValueError(
                f"SamplingBatch fields differ in length: temperature={n} top_k={len(self.top_k)} "
                f"top_p={len(self.top_p)} generators={len(self.generators)} host={len(self.host)}")

    def __len__(self) -> int:
        return len(self.temperature)

    def select(self, rows: list[int]) -> SamplingBatch:
        """The batch of the given rows, in that order."""
        pick = lambda values: [values[r] for r in rows]  # noqa: E731
        return SamplingBatch([float(t) for t in pick(self.temperature)], [int(k) for k in pick(self.top_k)],
                             [float(p) for p in pick(self.top_p)], pick(self.generators),
                             pick(self.blocked_token_ids), pick(self.host), pick(self.bitmasks))

    @classmethod
    def greedy(cls, rows: int) -> SamplingBatch:
        return cls([0.0] * rows, [0] * rows, [1.0] * rows)


def _as_tensor(values: Sequence[float] | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", dtype)
    return torch.tensor(list(values), dtype=dtype)


def draws(temperature: float, top_k: int) -> bool:
    """Whether a row with these values draws from its generator when it samples (else greedy)."""
    return temperature > 0 and top_k != 1


def _uniform(generator: torch.Generator | None, rows: int = 1) -> torch.Tensor:
    """[rows] float64 uniforms in [0, 1), on the host: one per sampled token."""
    return torch.rand(rows, dtype=torch.float64, generator=generator)


def seeded_generator(seed: int, replay: int = 0) -> torch.Generator:
    """A request's generator, on the host (where the draw is made, whatever the model's device:
    the same tokens anywhere), past the draws of the `replay` tokens it sampled before it
    resumed here (one uniform each)."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    if replay:
        _uniform(generator, replay)
    return generator


@_one_thread_when_small
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
    logits = _processed_logits(logits, batch)

    temperature = _as_tensor(batch.temperature, torch.float32)
    top_k = _as_tensor(batch.top_k, torch.int64)
    # top_k == 1 keeps only the argmax, whatever the temperature: greedy without drawing (`draws`).
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
    min_p = torch.tensor([h.min_p if h else 0.0 for h in batch.host], dtype=torch.float32)
    probs = _filtered_probs(
        (logits if len(sampled_rows) == rows else logits[idx]).float(),
        temperature[sampled_rows].to(logits.device),
        top_k[sampled_rows].to(logits.device),
        _as_tensor(batch.top_p, torch.float32)[sampled_rows].to(logits.device),
        min_p[sampled_rows].to(logits.device),
    )
    u = _uniform(None, len(sampled_rows))
    for j, row in enumerate(sampled_rows.tolist()):
        gen = batch.generators[row]
        if gen is not None:
            u[j] = _uniform(gen)[0]
    # Inverse CDF: the token where a row's cumulative probability first exceeds u * total, u
    # uniform in [0, 1), has exactly the row's probability; a zero-probability token never
    # owns an interval. One uniform per row (not one exponential per vocabulary entry, as the
    # exponential race draws: 25 of 35 ms at 32 rows x 49,152 tokens on a 2-core Xeon). The
    # cumulative sum is float64 so that u * total stays below the last entry.
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # cast on the fly: no float64 copy
    target = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    out[idx] = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=vocab - 1)
    return out


@_one_thread_when_small
def verify(logits: torch.Tensor, drafts: Sequence[Sequence[int]], batch: SamplingBatch
           ) -> tuple[list[int], torch.Tensor]:
    """Speculative decoding's acceptance: row i fed its token and drafts[i] (k_i tokens), and
    logits[i, j] [R, S, V] (S > every k_i) is the model's distribution after its j-th fed token,
    the one draft j is judged against. Returns (a_i, the number of drafts accepted, per row) and
    [R] int64 token ids on the host: the token sampled after the accepted ones (a correction
    after a rejected draft, or the bonus after all k_i). Row i's new tokens are
    drafts[i][:a_i] + [token].

    * A row without drafts is a plain decode row: `sample` of logits[i, 0] with every rule its
      batch row holds (penalties, bitmask, min_tokens, ...).
    * Greedy (`draws` false): draft j is accepted while it is the argmax at j; the token is the
      argmax after the accepted run: plain greedy decoding's tokens, one argmax over the rows.
    * Sampled: rejection sampling against a point-mass proposal. With p_j the row's distribution
      at j as `sample` computes it (temperature, top-k, top-p, min-p: `_filtered_probs`), draft x
      is accepted with probability p_j(x), by one uniform u < p_j(x). On the first rejection the
      token comes from p_j without x, renormalised, and the row stops; after k accepted drafts it
      comes from p_k. Every token so has plain sampling's distribution given the ones before.
      A rejection's uniform, u in [p_j(x), 1), also picks the correction: (u - p_j(x)) / (1 -
      p_j(x)) is uniform in [0, 1) given the rejection, so the row draws one uniform per new
      token (the module's reproducibility rule) and a seeded row is reproducible for the same
      drafts.

    A row with drafts must hold no rule beyond temperature, top-k, top-p and min-p (no bitmask,
    blocked ids or `HostSampling.draft_problem`): step_check refuses those before they run.
    """
    if logits.dim() != 3:
        raise ValueError(f"verify logits must be [rows, positions, vocab], got {tuple(logits.shape)}")
    rows, width, vocab = logits.shape
    counts = [len(d) for d in drafts]
    if len(counts) != rows or len(batch) != rows:
        raise ValueError(f"verify has {rows} logits rows, {len(counts)} draft lists and {len(batch)} sampling rows")
    if any(k >= width for k in counts):
        raise ValueError(f"a row has {max(counts)} drafts; the logits hold {width} positions per row")
    for i, k in enumerate(counts):
        host = batch.host[i]
        problem = ((host.draft_problem if host is not None else None)
                   or ("a grammar bitmask" if batch.bitmasks[i] else None)
                   or ("min_tokens' blocked ids" if batch.blocked_token_ids[i] else None))
        if k and problem:
            raise ValueError(f"row {i} has drafts and {problem}: its drafts cannot be verified")
    accepted = [0] * rows
    out = torch.zeros(rows, dtype=torch.int64)
    plain = [i for i in range(rows) if not counts[i]]
    if plain:
        index = torch.tensor(plain, device=logits.device)
        out[plain] = sample(logits[index, 0], batch.select(plain)).cpu()
    draw = [draws(float(batch.temperature[i]), int(batch.top_k[i])) for i in range(rows)]
    greedy = [i for i in range(rows) if counts[i] and not draw[i]]
    if greedy:
        best = logits[torch.tensor(greedy, device=logits.device)].argmax(dim=-1).cpu()  # [g, S]
        proposed = torch.full((len(greedy), width - 1), -1, dtype=torch.int64)  # -1: never the argmax
        for g, i in enumerate(greedy):
            proposed[g, :counts[i]] = torch.tensor(list(drafts[i]), dtype=torch.int64)
        # Drafts accepted: the length of the run of matches from the first.
        run = (best[:, :-1] == proposed).long().cumprod(dim=-1).sum(dim=-1)
        out[greedy] = best.gather(1, run[:, None]).squeeze(1)
        for g, i in enumerate(greedy):
            accepted[i] = int(run[g])
    sampled = [i for i in range(rows) if counts[i] and draw[i]]
    if sampled:
        # Every real position of the sampled rows, one probability row each, in one pass.
        at = [(i, j) for i in sampled for j in range(counts[i] + 1)]
        pick = lambda values: [values[i] for i, _ in at]  # noqa: E731
        dev = logits.device
        min_p = [h.min_p if h is not None else 0.0 for h in batch.host]
        probs = _filtered_probs(
            logits[torch.tensor([i for i, _ in at], device=dev), torch.tensor([j for _, j in at], device=dev)].float(),
            torch.tensor(pick([float(t) for t in batch.temperature]), device=dev),
            torch.tensor(pick([int(k) for k in batch.top_k]), device=dev),
            torch.tensor(pick([float(p) for p in batch.top_p]), device=dev),
            torch.tensor(pick(min_p), dtype=torch.float32, device=dev)).cpu()
        first = 0
        for i in sampled:
            accepted[i], out[i] = _rejection_sample(probs[first:first + counts[i] + 1], drafts[i], batch.generators[i])
            first += counts[i] + 1
    return accepted, out


def _rejection_sample(probs: torch.Tensor, drafts: Sequence[int], generator: torch.Generator | None
                      ) -> tuple[int, int]:
    """One sampled row of `verify`: probs [k + 1, V] its distributions at the k drafts' positions
    and after them. Returns (drafts accepted, the token after them); draws one uniform per token."""
    for j, x in enumerate(drafts):
        u = float(_uniform(generator)[0])
        p_x = float(probs[j, x])
        if u < p_x:
            continue
        residual = probs[j].clone()
        residual[x] = 0.0
        # u is uniform in [p_x, 1) given the rejection (p_x < 1): rescaled, the correction's draw.
        return j, _inverse_cdf(residual, (u - p_x) / (1.0 - p_x), fallback=x)
    return len(drafts), _inverse_cdf(probs[len(drafts)], float(_uniform(generator)[0]))


def _inverse_cdf(probs: torch.Tensor, u: float, fallback: int | None = None) -> int:
    """The token of [V] probabilities (not necessarily normalised) that uniform u in [0, 1) picks,
    as `sample` picks it: where the cumulative sum first exceeds u times the total. `fallback`
    when nothing is left (a residual whose rounding took all the mass: the draft was certain)."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    total = float(cdf[-1])
    if total <= 0.0 and fallback is not None:
        return fallback
    at = torch.searchsorted(cdf, torch.tensor([u * total], dtype=torch.float64), right=True)
    return int(at.clamp_(max=probs.shape[-1] - 1))


def verify_logprobs(logits: torch.Tensor, drafts: Sequence[Sequence[int]], accepted: Sequence[int],
                    tokens: torch.Tensor, batch: SamplingBatch
                    ) -> tuple[list[list[TokenLogprobs]], list[TokenLogprobs | None]]:
    """A verify step's logprobs (`verify`'s logits, drafts and results), for the rows that asked:
    per row, one entry per accepted draft (logits[i, j] with drafts[i][j] as the sampled token),
    and the final token's (logits[i, a_i]); each as `gather_logprobs` makes it (raw logprobs:
    the sampled token first, then the top-k)."""
    rows = len(drafts)
    per_draft: list[list[TokenLogprobs]] = [[] for _ in range(rows)]
    final: list[TokenLogprobs | None] = [None] * rows
    wanted = [i for i, h in enumerate(batch.host) if h is not None and h.logprobs is not None]
    if not wanted:
        return per_draft, final
    at = [(i, j) for i in wanted for j in range(accepted[i] + 1)]
    dev = logits.device
    flat = logits[torch.tensor([i for i, _ in at], device=dev), torch.tensor([j for _, j in at], device=dev)]
    chosen = torch.tensor([drafts[i][j] if j < accepted[i] else int(tokens[i]) for i, j in at], dtype=torch.int64,
                          device=dev)
    hosts = [batch.host[i] for i, _ in at]
    entries = gather_logprobs(flat, chosen, SamplingBatch([0.0] * len(at), [0] * len(at), [1.0] * len(at), host=hosts))
    for (i, j), entry in zip(at, entries):
        assert entry is not None
        if j < accepted[i]:
            per_draft[i].append(entry)
        else:
            final[i] = entry
    return per_draft, final


def _processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits after the rules that apply before temperature, in vLLM's order: the grammar
    bitmask (vLLM applies it to the logits before the sampler), allowed token ids, bad words,
    min_tokens' blocked ids and logit_bias, then repetition, frequency and presence penalties.
    Returns `logits` itself when no row has any.

    The rules that only forbid tokens (-inf) commute with each other and with what follows
    (a bias or a penalty leaves -inf at -inf), so the two that whole batches carry, grammar
    bitmasks and min_tokens' blocked ids, are applied to every row at once; only rows with
    per-request host options (rare) are visited one by one."""
    masked = [i for i, mask in enumerate(batch.bitmasks) if mask]
    blocked = [(i, ids) for i, ids in enumerate(batch.blocked_token_ids) if ids]
    hosted = [i for i, host in enumerate(batch.host) if host is not None and host.active]
    if not (masked or blocked or hosted):
        return logits
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    if masked:
        allowed = bitmasks_allowed([batch.bitmasks[i] for i in masked], vocab).to(logits.device)
        rows = torch.tensor(masked, device=logits.device)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    if blocked:
        rows = torch.tensor([i for i, ids in blocked for _ in ids], device=logits.device)
        cols = torch.tensor([t for _, ids in blocked for t in ids], device=logits.device)
        logits[rows, cols] = float("-inf")
    for i in hosted:
        row, host = logits[i], batch.host[i]
        if host.allowed_token_ids:
            banned = torch.ones(vocab, dtype=torch.bool, device=row.device)
            banned[host.allowed_token_ids] = False
            row.masked_fill_(banned, float("-inf"))
        for word in host.bad_words:
            if _ends_with(host.output_token_ids, word[:-1]):
                row[word[-1]] = float("-inf")
        if host.logit_bias:
            ids = torch.tensor(list(host.logit_bias), dtype=torch.long, device=row.device)
            row[ids] += torch.tensor(list(host.logit_bias.values()), dtype=row.dtype, device=row.device)
        if host.has_penalties:
            _apply_penalties(row, host)
    return logits


def bitmasks_allowed(bitmasks: list[bytes], vocab: int) -> torch.Tensor:
    """[len(bitmasks), vocab] bool, unpacked in one pass (see bitmask_allowed); masks of
    different lengths are padded with zero bytes (disallowed)."""
    width = max(len(m) for m in bitmasks)
    packed = bytearray(b"".join(m.ljust(width, b"\0") for m in bitmasks))
    bits = torch.frombuffer(packed, dtype=torch.uint8).view(len(bitmasks), width)
    allowed = ((bits.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten(1).bool()
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    return torch.cat([allowed, torch.zeros(len(bitmasks), vocab - allowed.shape[1], dtype=torch.bool)], dim=1)


def bitmask_allowed(bitmask: bytes, vocab: int) -> torch.Tensor:
    """[vocab] bool: the tokens a grammar bitmask allows (bit i of little-endian int32 words,
    i.e. bit i % 8 of byte i // 8); ids past the mask's end are not allowed."""
    bits = torch.frombuffer(bytearray(bitmask), dtype=torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).flatten().bool()
    if allowed.numel() >= vocab:
        return allowed[:vocab]
    return torch.cat([allowed, torch.zeros(vocab - allowed.numel(), dtype=torch.bool)])


def _ends_with(tokens: list[int], prefix: list[int]) -> bool:
    """vLLM's bad-words rule: the output so far ends with the word's ids before its last."""
    return len(prefix) <= len(tokens) and (not prefix or tokens[-len(prefix):] == prefix)


def _apply_penalties(row: torch.Tensor, host: HostSampling) -> None:
    """vLLM's penalties (model_executor/layers/utils.py apply_penalties), in place: repetition
    over prompt and output tokens (positive logits divided, others multiplied), then frequency
    (times the count) and presence (once) over the output tokens."""
    vocab = row.shape[-1]
    output = torch.tensor(host.output_token_ids, dtype=torch.long, device=row.device)
    counts = torch.bincount(output, minlength=vocab)[:vocab].to(row.dtype)
    seen = counts > 0
    if host.repetition_penalty != 1.0:
        repeated = seen.clone()
        if host.prompt_token_ids:
            repeated[torch.tensor(host.prompt_token_ids, dtype=torch.long, device=row.device)] = True
        penalty = host.repetition_penalty
        scaling = torch.where(row > 0, 1.0 / penalty, penalty)
        row.mul_(torch.where(repeated, scaling, torch.ones_like(scaling)))
    if host.frequency_penalty:
        row.sub_(host.frequency_penalty * counts)
    if host.presence_penalty:
        row.sub_(host.presence_penalty * seen.to(row.dtype))


def gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch
                    ) -> list[TokenLogprobs | None]:
    """Logprobs of each row's sampled token and its top-k, for the rows that asked.

    vLLM's default logprobs_mode "raw_logprobs": the log-softmax of the model's logits before
    any rule, penalty, temperature or top-k/top-p (`logits` must be those raw logits). The rank
    counts the tokens at least as likely as the sampled one (1 = most likely), as vLLM's
    batched_count_greater_than does.
    """
    wanted = [(i, h.logprobs) for i, h in enumerate(batch.host)
              if h is not None and h.logprobs is not None]
    if not wanted:  # the common case: no thread switch for nothing
        return [None] * len(batch)
    return _wanted_logprobs(logits, tokens, wanted, len(batch))


@_one_thread_when_small
def _wanted_logprobs(logits: torch.Tensor, tokens: torch.Tensor, wanted: list[tuple[int, int]],
                     rows_in_batch: int) -> list[TokenLogprobs | None]:
    result: list[TokenLogprobs | None] = [None] * rows_in_batch
    rows = torch.tensor([i for i, _ in wanted], dtype=torch.long, device=logits.device)
    raw = logits[rows].float().log_softmax(dim=-1)
    top_logprobs, top_ids = raw.topk(max(k for _, k in wanted), dim=-1)
    sampled = tokens[rows].to(logits.device).long().unsqueeze(-1)
    sampled_logprobs = raw.gather(-1, sampled)
    ranks = (raw >= sampled_logprobs).sum(dim=-1)
    for j, (i, k) in enumerate(wanted):
        result[i] = TokenLogprobs(token_ids=[int(sampled[j, 0])] + top_ids[j, :k].tolist(),
                                  logprobs=[float(sampled_logprobs[j, 0])] + top_logprobs[j, :k].tolist(),
                                  rank=int(ranks[j]))
    return result


def _filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax of logits/temperature restricted to each row's min-p, top-k and then top-p set.

    Every row keeps at least its most likely token, so no row ends with all-zero probabilities.
    """
    vocab = logits.shape[-1]
    # Temperature 1 (OpenAI's default) leaves the logits as they are: no [rows, vocab] pass.
    scaled = logits if bool((temperature == 1).all()) else logits / temperature.unsqueeze(-1)
    masked_value = torch.finfo(scaled.dtype).min

    if min_p is not None and bool((min_p > 0).any()):
        # vLLM's MinPLogitsProcessor: drop tokens less likely than min_p times the top token.
        probs = scaled.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(-1)
        scaled = scaled.masked_fill(probs < threshold, masked_value)

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
