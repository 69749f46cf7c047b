"""The batched sampler: one next token per request from a [S, V] block of logits.

Processing order follows vLLM: penalties (repetition on prompt + output tokens, presence / frequency on
output tokens), min_tokens (EOS and stop ids masked), then for the rows that sample at random: temperature,
top_k, top_p, min_p, and a draw. Every stage runs as a few tensor ops over exactly the rows that need it,
so a batch of 64 requests costs a handful of kernel launches per stage, not 64 Python round trips.

Random draws invert the cumulative distribution with one uniform number per row. Each seeded row draws
its number from its own torch.Generator and every stage is row-wise, so a seeded request gets the same
tokens whether it runs alone or next to any other requests; unseeded rows share torch's default
generator (so `torch.manual_seed` makes a whole run reproducible).

Logprobs come from the raw model logits (before penalties / temperature / truncation), like vLLM's default.

The sampler is total: for any params SamplingParams accepts and any logits (NaN, +-inf in any pattern, all
-inf, huge magnitudes), every row gets an id in [0, V) and nothing raises, because one request's broken row
must not fail the whole batch (an id == V would crash the next model step instead). Greedy rows take
torch's argmax (a NaN counts as the largest) and so are always in range; random rows never draw a NaN
entry, and keep their most likely token through every stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedkv.sampling_params import SamplingParams

_NEG_INF = float("-inf")
_FLOAT32_MAX = torch.finfo(torch.float32).max
_TOP_P_CANDIDATES = (64, 1024)  # candidate counts apply_top_p tries before a full sort


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per row; logprobs only when some row asked for them.

    logprobs[i]: raw-logit logprob of token_ids[i] (for every row, once any row asked).
    top_logprobs[i]: the N most likely (token, logprob) pairs, best first, for a row with logprobs=N
    ([] when N=0), None for a row that did not ask.
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]] | None] | None = None


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded for one request, or None (use the default generator) when seed is None.

    It must live on the device of the logits; create it once per request and keep it for the request's
    lifetime, since its state is what makes the request's later draws reproducible.
    """
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


def _flat_keys(rows: list[int], seqs: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """`row * vocab + token` for every token of seqs[j], which belongs to logits row rows[j]."""
    lengths = torch.tensor([len(s) for s in seqs], device=device)
    tokens = torch.cat([torch.as_tensor(s, dtype=torch.long, device=device) for s in seqs])
    return torch.repeat_interleave(torch.tensor(rows, device=device) * vocab, lengths) + tokens


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], prompts: list[Sequence[int]], outputs: list[Sequence[int]]
) -> None:
    """In place on a contiguous [S, V] block, with vLLM's semantics: repetition divides positive and
    multiplies negative logits of tokens seen in prompt or output; frequency subtracts once per output
    occurrence, presence once per distinct output token. Rows whose params have no penalty are untouched.

    A penalty only touches tokens that occurred, so it works on the flat positions `row * V + token`:
    one `unique` (with counts) over all rows' tokens, one gather and one scatter of those positions,
    instead of a dozen passes over dense [S, V] count tensors.
    """
    vocab, device, flat = logits.shape[1], logits.device, logits.view(-1)
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        keys = torch.cat(
            [
                _flat_keys(rep_rows, [prompts[i] for i in rep_rows], vocab, device),
                _flat_keys(rep_rows, [outputs[i] for i in rep_rows], vocab, device),
            ]
        ).unique()
        rep = torch.tensor([p.repetition_penalty for p in params], device=device)[keys // vocab]
        values = flat[keys]
        flat[keys] = torch.where(values > 0, values / rep, values * rep)
    add_rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if add_rows:
        keys = _flat_keys(add_rows, [outputs[i] for i in add_rows], vocab, device)
        keys, counts = keys.unique(return_counts=True)
        rows = keys // vocab
        freq = torch.tensor([p.frequency_penalty for p in params], device=device)[rows]
        pres = torch.tensor([p.presence_penalty for p in params], device=device)[rows]
        flat.index_add_(0, keys, -(freq * counts + pres))


class Sampler:
    """Samples one token per row of a logits block; stateless apart from the model's EOS ids.

    Call with per-row SamplingParams, per-row generators (from `make_generator`), and each row's prompt and
    output token ids so far (lists or 1-D tensors; read only for rows with penalties or min_tokens).
    The logits are not modified.
    """

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        prompt_token_ids: list[Sequence[int]],
        output_token_ids: list[Sequence[int]],
    ) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(params):
            raise ValueError(f"logits must be [len(params)={len(params)}, vocab], got {tuple(logits.shape)}")
        if not len(generators) == len(prompt_token_ids) == len(output_token_ids) == len(params):
            raise ValueError("generators, prompt_token_ids and output_token_ids need one entry per row")
        # The engine calls this every step and plain greedy decoding is the common case: one argmax.
        if all(p.is_plain_greedy(len(out)) for p, out in zip(params, output_token_ids, strict=True)):
            return SamplerOutput(logits.argmax(dim=-1).tolist())

        work = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        if any(p.has_penalties for p in params):
            apply_penalties(work, params, prompt_token_ids, output_token_ids)
        self._mask_stop_ids(work, params, output_token_ids)

        greedy = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy) == len(params):
            token_ids = work.argmax(dim=-1)
        else:
            token_ids = torch.empty(len(params), dtype=torch.long, device=work.device)
            if greedy:
                index = torch.tensor(greedy, device=work.device)
                token_ids[index] = work.index_select(0, index).argmax(dim=-1)
            random = [i for i, p in enumerate(params) if not p.greedy]
            index = torch.tensor(random, device=work.device)
            sub = work if len(random) == len(params) else work.index_select(0, index)
            # A NaN must never be drawn, and +inf makes softmax NaN (inf - inf): map them to -inf and the largest
            # float32, once (~170 us at [64, 49152] on 2 cores, against ~1 ms for the copy above or a softmax).
            sub.nan_to_num_(nan=_NEG_INF, posinf=_FLOAT32_MAX, neginf=_NEG_INF)
            sub = _truncate(sub, [params[i] for i in random])
            token_ids[index] = _draw(sub, [generators[i] for i in random])

        out = SamplerOutput(token_ids.tolist())
        if any(p.logprobs is not None for p in params):
            _fill_logprobs(out, logits.float(), token_ids, params)
        return out

    def _mask_stop_ids(self, logits: torch.Tensor, params: list[SamplingParams], outputs: list[Sequence[int]]) -> None:
        """Below min_tokens a row may not end: its EOS (unless ignore_eos) and stop_token_ids get -inf.

        A row masked whole (`SamplingParams.verify_for_model` rejects those requests) is left to `_draw`.
        """
        rows: list[int] = []
        cols: list[int] = []
        for i, (p, out) in enumerate(zip(params, outputs, strict=True)):
            if len(out) < p.min_tokens:
                stop_ids = p.stop_token_id_set if p.ignore_eos else p.stop_token_id_set.union(self.eos_token_ids)
                stop_ids = [t for t in stop_ids if t < logits.shape[1]]  # others can never be drawn
                rows += [i] * len(stop_ids)
                cols += stop_ids
        if rows:
            device = logits.device
            logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = _NEG_INF


def _truncate(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top_k, top_p, min_p, each only where some row uses it; in place, returns logits.

    Temperature divides x - max(x), not x: the same softmax, but at T < 1 a huge logit cannot overflow to
    +inf, nor the only finite one of a row to -inf, since the largest becomes exactly 0.
    """
    if any(p.temperature != 1.0 for p in params):
        temperatures = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
        logits.sub_(logits.amax(dim=-1, keepdim=True)).div_(temperatures)
    if any(0 < p.top_k < logits.shape[1] for p in params):
        apply_top_k(logits, [p.top_k for p in params])
    if any(p.top_p < 1.0 for p in params):
        apply_top_p(logits, [p.top_p for p in params])
    if any(p.min_p > 0.0 for p in params):
        apply_min_p(logits, [p.min_p for p in params])
    return logits


def apply_top_k(logits: torch.Tensor, ks: list[int]) -> None:
    """In place: keep each row's ks[i] largest logits (ties with the k-th too); k <= 0 or >= V: unchanged."""
    active = [0 < k < logits.shape[1] for k in ks]
    k = torch.tensor([k if a else 1 for k, a in zip(ks, active, strict=True)], device=logits.device)
    threshold = logits.topk(int(k.max()), dim=-1).values.gather(1, k.unsqueeze(1) - 1)
    threshold.masked_fill_(~torch.tensor(active, device=logits.device).unsqueeze(1), _NEG_INF)
    logits.masked_fill_(logits < threshold, _NEG_INF)


def apply_top_p(logits: torch.Tensor, ps: list[float]) -> None:
    """In place nucleus filter: keep a token while the probability mass of the tokens above it is < p
    (p >= 1: row unchanged). The most likely token always stays, even in a row of -inf only, whose NaN
    probabilities put no mass below p.

    A full sort of a 49k vocab costs ~100x a softmax on CPU, and the nucleus is usually a few dozen tokens.
    So the threshold is found among the top-K candidates for growing K, and a row moves on to a larger K
    only when its K candidates hold less than p of the mass (then the nucleus may reach beyond them).
    """
    probs = logits.softmax(dim=-1)
    p = torch.tensor(ps, device=logits.device, dtype=probs.dtype).unsqueeze(1)
    threshold = torch.zeros_like(p)
    pending = torch.tensor([i for i, x in enumerate(ps) if x < 1.0], dtype=torch.long, device=logits.device)
    vocab = logits.shape[1]
    for k in [k for k in _TOP_P_CANDIDATES if k < vocab] + [vocab]:
        every_row = pending.numel() == len(ps)
        rows_p = p if every_row else p.index_select(0, pending)
        top = (probs if every_row else probs.index_select(0, pending)).topk(k, dim=-1).values
        cumulative = top.cumsum(dim=-1)
        kept = ((cumulative - top) < rows_p).sum(dim=-1, keepdim=True).clamp_(min=1)
        threshold.index_copy_(0, pending, top.gather(1, kept - 1))
        pending = pending[cumulative[:, -1] < rows_p.squeeze(1)]
        if pending.numel() == 0:
            break
    logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_ps: list[float]) -> None:
    """In place: drop tokens with p < min_p * p_max, i.e. logit < max logit + log(min_p) (0: no change)."""
    log_min_p = torch.tensor(min_ps, device=logits.device).log().unsqueeze(1)
    logits.masked_fill_(logits < logits.amax(dim=-1, keepdim=True) + log_min_p, _NEG_INF)


def _draw(logits: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Inverse-CDF draw from softmax(logits): one uniform per row, from the row's own generator if seeded.

    One random number per row instead of one per vocab entry (as the exponential race needs): the CPU
    generator makes ~50M numbers/s, so V per row would cost ~1 ms per row per step at a 49k vocab.
    A float32 cumsum is enough (float64 is not vectorised on CPU and costs 20x): neighbouring CDF
    entries differ by one rounded addition, so each token's probability moves by at most ~6e-8.

    After `_truncate` every row keeps a finite maximum except one that was all -inf (a broken model row, or
    min_tokens masking the whole vocabulary; NaN after the temperature shift). It has no token to prefer
    and a NaN CDF, for which searchsorted may answer V, so the result is clamped into range.
    """
    cdf = logits.softmax(dim=-1).cumsum(dim=-1)
    u = torch.empty(len(generators), 1, dtype=torch.float64)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), 1, dtype=torch.float64)
    for i, generator in enumerate(generators):
        if generator is not None:
            u[i] = torch.rand(1, dtype=torch.float64, generator=generator, device=generator.device).cpu()
    # Strictly below the total, the first CDF entry above the target is a token with non-zero mass.
    total = cdf[:, -1:]
    target = torch.minimum(u.to(cdf) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=logits.shape[1] - 1)


def _fill_logprobs(
    out: SamplerOutput, raw: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
) -> None:
    """Sampled-token logprob for every row, top-N for rows that asked, all from the raw logits."""
    logprobs = raw.log_softmax(dim=-1)
    out.logprobs = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    out.top_logprobs = [None if p.logprobs is None else [] for p in params]
    rows = [i for i, p in enumerate(params) if p.logprobs]
    if not rows:
        return
    if len(rows) < len(params):
        logprobs = logprobs.index_select(0, torch.tensor(rows, device=raw.device))
    values, ids = logprobs.topk(min(max(params[i].logprobs for i in rows), logprobs.shape[1]), dim=-1)
    for i, ids_row, values_row in zip(rows, ids.tolist(), values.tolist(), strict=True):
        n = params[i].logprobs
        out.top_logprobs[i] = list(zip(ids_row[:n], values_row[:n], strict=True))
