"""Exact greedy tokens of a float32 output head from a bfloat16 screen.

Why: in a decode step of a small model the output head is one of the largest products
(SmolLM2-135M: 49152 x 576, a fifth of a token's weights, ~15% of a 48-row decode step on a
Zen 4), and a greedy row needs only the position of its largest logit. The head is multiplied
in bfloat16 first (:meth:`kernels.gemm.NativeGemm.pack_bf16`: half the bytes, twice the rate);
every column whose float32 logit could still be the largest is then computed in float32
exactly as the float32 head computes it, and the token is the first of their largest:
**the token the float32 head gives, bit for bit** (``ps_gemm_head_greedy`` in
``kernels/csrc/gemm.c``; tests/test_greedy_head.py checks it against the float32 head on the
real model and on near ties). So it is not a mode with other numerics: every greedy row
without logprobs takes it where the CPU multiplies bfloat16 (AVX512-BF16 or AMX).

The bound, per row x and column W_j, with t_j the exact sum of x_i W_ji, S_j the sum of
|x_i W_ji|, u = 2^-24 (float32) and u_b = 2^-8 (bfloat16, both rounded to nearest):

* the bfloat16 product a_j: x_i and W_ji each off by at most u_b relatively, so each product
  by (2 u_b + u_b^2); products of two bfloat16 numbers are exact in float32 and their sums
  round at most 2K times (pairs, then the accumulator, in any order): |a_j - t_j| <=
  (2 u_b + u_b^2 + gamma(2K) (1 + 2 u_b + u_b^2)) S_j;
* the float32 product f_j (one fused multiply-add chain): |f_j - t_j| <= gamma(K) S_j;
* S_j <= |x|_2 |W_j|_2 (Cauchy-Schwarz).

So |a_j - f_j| <= c |x|_2 |W_j|_2 with c = 2^-7 + 2^-16 + 3.1 K u (gamma(n) ~ n u), taken
with a 1% margin for the rounding of the norms themselves. The bfloat16 instructions read
subnormal inputs as zero and flush subnormal sums: a term with a subnormal x_i or W_ji is off
by at most 2^-126 times the other factor (in all at most sqrt(K) 2^-126 (|x|_2 + max |W_j|_2)),
and each of the 2K sums by at most 2^-126; that absolute term t (with 8 u |x|_2 max |W_j|_2
for the rounding of the comparisons themselves, the logits being at most |x|_2 max |W_j|_2)
is added to every column's bound. Rows whose |x| is not finite or beyond 1e30 (where bfloat16
rounding could overflow), and rows with more than ``cap`` candidates, take the float32 head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.gemm import PanelWeight

#: Most columns computed in float32 per row before the row takes the whole float32 head.
CAP = 64
_U = 2.0**-24
_TINY = 2.0**-126
_X_LIMIT = 1e30


def rounding_factor(in_features: int) -> float:
    """c of the module docstring: |bfloat16 product - float32 product| <= c |x| |W_j| (with
    its margin)."""
    return (2.0**-7 + 2.0**-16 + 3.1 * in_features * _U) * 1.01


@dataclass(frozen=True, eq=False)
class GreedyHead:
    """A float32 head (:meth:`NativeGemm.pack`'s panels) with its bfloat16 screen."""

    head: PanelWeight
    screen: PanelWeight
    #: |W_j|_2 per column, rounded up to float32.
    norms: torch.Tensor
    nmax: float
    #: The head's rows ``[out, in]`` (float32, unit column stride) where the model keeps them (a
    #: tied embedding): a recomputed column reads one contiguous row instead of one float of
    #: every k step's 128-byte panel line (16x fewer bytes; the same values, the same sums).
    rows: torch.Tensor | None = None
    cap: int = CAP

    @classmethod
    def build(cls, head: PanelWeight, rows: torch.Tensor | None = None) -> GreedyHead | None:
        """The screen of a float32 panel head, or None where this build or CPU has no bfloat16
        product or the head is not a plain float32 one. ``rows``: the same weight unpacked, if
        the caller keeps it (checked equal to the panels' values)."""
        gemm = head.gemm
        plain = head.panels.dtype == torch.float32 and not head.glu and head.scale is None
        if not (gemm.bf16 and plain and head.in_features % 2 == 0):
            return None
        n, k = head.out_features, head.in_features
        weight = head.panels.transpose(1, 2).reshape(-1, k)[:n]  # the head's own values
        norms = torch.linalg.vector_norm(weight.double(), dim=1).float()
        norms = torch.nextafter(norms, torch.full_like(norms, float("inf")))
        if rows is not None and (
            rows.shape != weight.shape or rows.stride(1) != 1 or not torch.equal(rows, weight)
        ):
            raise ValueError("rows must be the head's float32 weight [out, in], unit stride")
        return cls(head, gemm.pack_bf16(weight), norms, float(norms.max()), rows)

    def tokens(self, x: torch.Tensor) -> list[int]:
        """Each row's greedy token: the first position of the largest of ``x @ W.T`` as the
        float32 head computes it; -1 for a row the screen cannot settle (the caller runs the
        float32 head for it: its outputs do not depend on the other rows). ``x``: [rows, in]
        float32."""
        if x.stride(1) != 1:
            x = x.contiguous()
        rows, k = x.shape
        xnorm = torch.linalg.vector_norm(x.double(), dim=1)
        ok = torch.isfinite(xnorm) & (xnorm <= _X_LIMIT)
        flushed = (k**0.5 * (xnorm + self.nmax) + 2 * k) * _TINY
        compares = 8 * _U * xnorm * self.nmax  # the float32 tests of the bound in C
        rounding = xnorm * (rounding_factor(k) * (1 + 1e-6))
        slack = torch.stack([rounding, (flushed + compares) * 1.01], dim=1).float()  # [rows, 2]
        slack = torch.nextafter(slack, torch.full_like(slack, float("inf")))
        tokens = torch.full((rows,), -1, dtype=torch.int64)
        if bool(ok.all()):
            self._screen(x, slack, tokens)
        else:
            good = ok.nonzero().flatten()
            if good.numel():
                sub = torch.full((good.numel(),), -1, dtype=torch.int64)
                self._screen(x.index_select(0, good), slack[good].contiguous(), sub)
                tokens[good] = sub
        return tokens.tolist()

    def _screen(self, x: torch.Tensor, slack: torch.Tensor, tokens: torch.Tensor) -> None:
        approx = self.screen.matmul(x)
        self.head.gemm.head_greedy(
            x, self.head, self.rows, approx, self.norms, self.nmax, slack, self.cap, tokens
        )
