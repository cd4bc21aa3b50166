"""A step's logits to tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

Greedy rows without penalties take one batched argmax. A row with its own seed samples with its
own generator (one per completion), so its text does not depend on what else shares the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import fused
from kernels.fused import FusedOps
from pagedserve.params import SamplingParams
from worker.outputs import TokenLogprob


@dataclass(slots=True)
class SampleRow:
    """One logits row to sample from, ``n`` times (n > 1 only for a parent's first token)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    #: the history penalties read; the engine passes [] when ``has_penalties`` is false
    output_token_ids: list[int]
    generators: list[torch.Generator | None]  # one per draw
    n: int = 1


def has_penalties(p: SamplingParams) -> bool:
    """Whether sampling reads the row's token history (``SampleRow``'s token ids): penalties
    only. Rows without are built without copying it (an O(length) slice per row per step)."""
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def argmax_draw(p: SamplingParams, n: int) -> bool:
    """Whether a row drawing ``n`` tokens takes its logits' argmax alone: greedy, one token,
    no penalties."""
    return p.greedy and n == 1 and not has_penalties(p)


def plain_greedy(p: SamplingParams) -> bool:
    """Whether each of a request's tokens is its logits' argmax and nothing else: one completion
    drawn by :func:`argmax_draw`, no logprobs to report (a constrained one also needs its
    grammar's mask: the engine checks that)."""
    return argmax_draw(p, p.n) and p.logprobs is None


def apply_penalties(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """OpenAI presence/frequency penalties on output tokens; HF-style repetition penalty on all."""
    p = row.params
    vocab = logits.shape[-1]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long
        )
        seen = seen[seen < vocab]
        vals = logits[seen]
        logits[seen] = torch.where(
            vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
        )
    if row.output_token_ids and (p.presence_penalty or p.frequency_penalty):
        ids = torch.tensor(row.output_token_ids, dtype=torch.long)
        ids = ids[ids < vocab]
        counts = torch.bincount(ids, minlength=vocab).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits with top-k, top-p and min-p applied (-inf outside)."""
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(logits, -1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) > p.top_p  # keep the token crossing top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return logits


def _draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p, one op, seedable.
    if gen is not None and gen.device != probs.device:
        # A seed's generator is a CPU one (request_state): on a GPU the draw moves to the CPU,
        # so that one seed gives one noise stream on every device.
        probs = probs.cpu()
    noise = torch.empty_like(probs).exponential_(generator=gen)
    return int(torch.argmax(probs / noise))


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax: through the C kernel for float32 CPU logits (``FusedOps.argmax``: the
    same tokens, ~13x torch's argmax over a [48, 49152] vocabulary on a Xeon), else torch."""
    if logits.dim() == 2 and logits.shape[1] and FusedOps.supports(logits):
        ops = fused.load()
        if ops is not None and logits.stride(1) == 1:
            return ops.argmax(logits)
    return torch.argmax(logits, dim=-1).tolist()


def settle_open_rows(
    tokens: list[int], x: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor]
) -> int:
    """Rows a greedy head screen left open (-1 in ``tokens``, :mod:`kernels.greedy_head`) get
    the argmax of ``logits_of`` their rows of ``x`` (the float32 head: per row the same logits
    alone or in a batch); how many there were."""
    rest = [i for i, t in enumerate(tokens) if t < 0]
    if rest:
        picked = logits_of(x.index_select(0, torch.tensor(rest, dtype=torch.long)))
        for i, t in zip(rest, greedy_tokens(picked), strict=True):
            tokens[i] = t
    return len(rest)


class Sampler:
    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[list[int]]:
        """Tokens for each row (a list of ``row.n`` tokens each)."""
        out: list[list[int]] = [[] for _ in rows]
        simple = [i for i, r in enumerate(rows) if argmax_draw(r.params, r.n)]
        if simple:
            if len(simple) == len(rows):
                tokens = greedy_tokens(logits)
            else:
                idx = torch.tensor(simple, dtype=torch.long)
                tokens = greedy_tokens(logits.index_select(0, idx))
            for i, t in zip(simple, tokens, strict=True):
                out[i] = [t]
        done = set(simple)
        for i, row in enumerate(rows):
            if i in done:
                continue
            x = logits[i].clone()
            if has_penalties(row.params):
                x = apply_penalties(x, row)
            if row.params.temperature == 0.0:
                out[i] = [int(torch.argmax(x))] * row.n
                continue
            probs = torch.softmax(_filter(x, row.params), -1)
            out[i] = [_draw(probs, row.generators[k]) for k in range(row.n)]
        return out

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
        """Log-probabilities of the model's raw distribution for ``tokens`` drawn from one row."""
        lp = torch.log_softmax(logits.float(), -1)
        top_map: dict[int, float] = {}
        if top > 0:
            vals, ids = torch.topk(lp, top)
            top_map = dict(zip(ids.tolist(), vals.tolist(), strict=True))
        return [TokenLogprob(t, float(lp[t]), dict(top_map)) for t in tokens]
