"""Exact greedy tokens of a float32 output head from a cheaper screen of it (bfloat16 or int16).

Why: in a decode step of a small model the output head is one of the largest products
(SmolLM2-135M: 49152 x 576, a fifth of a token's weights, ~15% of a 48-row decode step on a
Zen 4), and a greedy row needs only the position of its largest logit. The head is multiplied
in bfloat16 first (:meth:`kernels.gemm.NativeGemm.pack_bf16`: half the bytes, twice the rate);
every column whose float32 logit could still be the largest is then computed in float32
exactly as the float32 head computes it, and the token is the first of their largest:
**the token the float32 head gives, bit for bit** (``ps_gemm_head_greedy`` in
``kernels/csrc/gemm.c``; tests/test_greedy_head.py checks it against the float32 head on the
real model and on near ties). So it is not a mode with other numerics: every greedy row
without logprobs takes it: the bfloat16 screen where the CPU multiplies bfloat16 (AVX512-BF16
or AMX), the integer one below elsewhere (AVX2; AVX-512 without AVX512-BF16).

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

**The integer screen** (:class:`Int16Screen`, ``ps_head_i16_screen``): where the CPU has no
bfloat16 product, W and each row x are rounded to int16 steps, W_j = s_j q_j + e_j with s_j =
max|W_j| / L per column and x = r p + e_x with r = max|x| / L per row (L = floor(sqrt((2^31 - 1)
/ K)), at most 32767, so that K L^2 < 2^31 and the int32 sums D_j of p_i q_ji are exact), and
the screen's value is a_j = (D_j s_j) r in float32 (three roundings of the exact r s_j D_j, at
most 3.01 u of it). With X = |x|_2, E = |e_x|_2 (per row, from the rounded p), w_j = |W_j|_2 and
e_j = |e_j|_2 (per column, at build), and r s_j D_j = (x - e_x).(W_j - e_j):

    |a_j - f_j| <= (X + E) (e_j + 3.01 u (w_j + e_j) + gamma(K) w_j) + E max_j (w_j + 2 e_j)

(Cauchy-Schwarz on each cross term; f_j's own error as above), which is ``ps_head_row``'s form
s * norms[j] + t with s = X + E, norms[j] the bracket (1% margin) and t = E max_j (w_j + 2 e_j)
plus the comparisons' rounding and 2^-149 (r + 1) for products that land among subnormals (at
most 2^-150 off absolutely, the first one then multiplied by r). No subnormal flushing: the
integer products are exact. vpmaddwd multiplies 16 int16 pairs per AVX2 instruction, twice
float32's multiply-adds (Zen 5 with an AVX2-only build, Qwen2-0.5B's head, 48 rows: 1.55x the
float32 head; bench/README.md, a fifty-third session).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels import native
from kernels.gemm import NativeGemm, PanelWeight

#: Most columns computed in float32 per row before the row takes the whole float32 head.
CAP = 64
#: ``PAGEDSERVE_GREEDY_SCREEN``: ``auto`` (default: bfloat16 where the CPU multiplies it, else
#: int16 where the build has AVX2 or AVX-512BW), ``bfloat16`` (none without it) or ``int16``
#: (everywhere: how the tests and benches reach it on any CPU).
SCREEN_ENV = native.GREEDY_SCREEN_ENV
SCREENS = ("auto", "bfloat16", "int16")
_U = 2.0**-24
_TINY = 2.0**-126
#: Twice the largest absolute error of rounding a float32 product that lands among subnormals.
_UNDER = 2.0**-149
_X_LIMIT = 1e30
_INT32_MAX = 2**31 - 1
#: Head rows per slice of the screens' float64 work at build (a Llama-3-8B head in one piece
#: would take three 4 GB float64 copies).
_CHUNK = 8192


def rounding_factor(in_features: int) -> float:
    """c of the module docstring: |bfloat16 product - float32 product| <= c |x| |W_j| (with
    its margin)."""
    return (2.0**-7 + 2.0**-16 + 3.1 * in_features * _U) * 1.01


def int16_levels(in_features: int) -> int:
    """L of the module docstring: the largest |q| and |p| of the integer screen, so that every
    int32 sum of ``in_features`` products of two of them is exact."""
    return min(32767, math.isqrt(_INT32_MAX // in_features))


def _up(t: torch.Tensor) -> torch.Tensor:
    """``t`` (float64) as float32, never below it."""
    f = t.float()
    return torch.where(f.double() < t, torch.nextafter(f, torch.full_like(f, math.inf)), f)


@dataclass(frozen=True, eq=False)
class Bf16Screen:
    """The head in bfloat16 (:meth:`NativeGemm.pack_bf16`), norms |W_j|_2."""

    weight: PanelWeight
    norms: torch.Tensor
    nmax: float

    @classmethod
    def build(cls, weight: torch.Tensor, gemm: NativeGemm) -> Bf16Screen:
        norms = torch.cat(
            [torch.linalg.vector_norm(c.double(), dim=1) for c in weight.split(_CHUNK)]
        )
        norms = _up(norms)
        return cls(gemm.pack_bf16(weight), norms, float(norms.max()))

    def products(self, x: torch.Tensor, xnorm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The screen's products of rows ``x`` and each row's (s, t) (module docstring)."""
        k = x.shape[1]
        flushed = (k**0.5 * (xnorm + self.nmax) + 2 * k) * _TINY
        compares = 8 * _U * xnorm * self.nmax  # the float32 tests of the bound in C
        rounding = xnorm * (rounding_factor(k) * (1 + 1e-6))
        return self.weight.matmul(x), _up(torch.stack([rounding, (flushed + compares) * 1.01], 1))


@dataclass(frozen=True, eq=False)
class Int16Screen:
    """The head in int16 steps (module docstring): ``panels`` [ceil(out / 16), in / 2, 16, 2]
    (``ps_head_i16_screen``'s layout), ``scale`` s_j per column (zero past ``out``)."""

    panels: torch.Tensor
    scale: torch.Tensor
    levels: int
    norms: torch.Tensor
    nmax: float
    #: max_j (|W_j| + 2 |e_j|): E times it bounds the rows' rounding terms.
    wide: float
    gemm: NativeGemm

    @classmethod
    def build(cls, weight: torch.Tensor, gemm: NativeGemm) -> Int16Screen:
        n, k = weight.shape
        levels = int16_levels(k)
        nr = gemm.head_i16_width
        pad = -(-n // nr) * nr
        q16 = torch.zeros(pad, k, dtype=torch.int16)
        cols = torch.zeros(pad, dtype=torch.float32)
        wn = torch.empty(n, dtype=torch.float64)
        err = torch.empty(n, dtype=torch.float64)
        for lo in range(0, n, _CHUNK):  # float64 work in slices: a few hundred MB at most
            w = weight[lo : lo + _CHUNK].double()
            scale = (w.abs().amax(dim=1) / levels).float()
            safe = torch.where(scale > 0, scale, torch.ones_like(scale)).double()
            q = torch.round(w / safe[:, None]).clamp_(-levels, levels)
            hi = lo + w.shape[0]
            err[lo:hi] = torch.linalg.vector_norm(w - q * scale.double()[:, None], dim=1)
            wn[lo:hi] = torch.linalg.vector_norm(w, dim=1)
            q16[lo:hi] = q.to(torch.int16)
            cols[lo:hi] = scale
        bracket = err + 3.01 * _U * (wn + err) + 1.01 * k * _U * wn
        norms = _up(bracket * 1.01)
        panels = q16.reshape(pad // nr, nr, k // 2, 2).transpose(1, 2).contiguous()
        wide = float(_up((wn + 2 * err).max().reshape(1) * 1.01))
        return cls(panels, cols, levels, norms, float(norms.max()), wide, gemm)

    def products(self, x: torch.Tensor, xnorm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The screen's products of rows ``x`` and each row's (s, t) (module docstring)."""
        rs = (x.abs().amax(dim=1) / self.levels).float()
        rs = torch.where(rs > 0, rs, torch.ones_like(rs))
        xd, rd = x.double(), rs.double()
        p = torch.round(xd / rd[:, None]).clamp_(-self.levels, self.levels)
        e = torch.linalg.vector_norm(xd - p * rd[:, None], dim=1)
        s = (xnorm + e) * (1 + 1e-6)
        under = (rd + 1) * _UNDER  # a subnormal D s_j, then times r (docstring)
        t = (e * self.wide + 8 * _U * s * self.wide + under) * 1.01
        approx = self.gemm.head_i16(p.to(torch.int16), self.panels, len(self.norms), self.scale, rs)
        return approx, _up(torch.stack([s, t], 1))


def screen_kind(gemm: NativeGemm) -> str | None:
    """The screen this library and ``PAGEDSERVE_GREEDY_SCREEN`` give a head, or None."""
    kind = native.choice(SCREEN_ENV, SCREENS)
    if kind == "auto":  # int16 only where it is vector code (else no faster than float32)
        return "bfloat16" if gemm.bf16 else "int16" if gemm.head_i16_vector else None
    return None if kind == "bfloat16" and not gemm.bf16 else kind


@dataclass(frozen=True, eq=False)
class GreedyHead:
    """A float32 head (:meth:`NativeGemm.pack`'s panels) with its screen."""

    head: PanelWeight
    screen: Bf16Screen | Int16Screen
    #: The head's rows ``[out, in]`` (float32, unit column stride) where the model keeps them (a
    #: tied embedding): a recomputed column reads one contiguous row instead of one float of
    #: every k step's 128-byte panel line (16x fewer bytes; the same values, the same sums).
    rows: torch.Tensor | None = None
    cap: int = CAP

    @classmethod
    def build(
        cls, head: PanelWeight, rows: torch.Tensor | None = None, kind: str | None = None
    ) -> GreedyHead | None:
        """The screen of a float32 panel head, or None where the head is not a plain float32
        one (or ``kind`` is ``bfloat16`` and this CPU has no bfloat16 product). ``rows``: the
        same weight unpacked, if the caller keeps it (checked equal to the panels' values);
        ``kind``: ``bfloat16`` or ``int16`` (default: :func:`screen_kind`)."""
        gemm = head.gemm
        plain = head.panels.dtype == torch.float32 and not head.glu and head.scale is None
        kind = kind or screen_kind(gemm)
        if kind == "bfloat16" and not gemm.bf16:
            kind = None
        if not (kind and plain and head.in_features % 2 == 0):
            return None
        n, k = head.out_features, head.in_features
        weight = head.panels.transpose(1, 2).reshape(-1, k)[:n]  # the head's own values
        if rows is not None and (
            rows.shape != weight.shape or rows.stride(1) != 1 or not torch.equal(rows, weight)
        ):
            raise ValueError("rows must be the head's float32 weight [out, in], unit stride")
        build = Bf16Screen.build if kind == "bfloat16" else Int16Screen.build
        return cls(head, build(weight, gemm), rows)

    @property
    def kind(self) -> str:
        return "bfloat16" if isinstance(self.screen, Bf16Screen) else "int16"

    def tokens(self, x: torch.Tensor) -> list[int]:
        """Each row's greedy token: the first position of the largest of ``x @ W.T`` as the
        float32 head computes it; -1 for a row the screen cannot settle (the caller runs the
        float32 head for it: its outputs do not depend on the other rows). ``x``: [rows, in]
        float32."""
        if x.stride(1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        xnorm = torch.linalg.vector_norm(x.double(), dim=1)
        ok = torch.isfinite(xnorm) & (xnorm <= _X_LIMIT)
        tokens = torch.full((rows,), -1, dtype=torch.int64)
        if bool(ok.all()):
            self._screen(x, xnorm, tokens)
        else:
            good = ok.nonzero().flatten()
            if good.numel():
                sub = torch.full((good.numel(),), -1, dtype=torch.int64)
                self._screen(x.index_select(0, good), xnorm[good], sub)
                tokens[good] = sub
        return tokens.tolist()

    def _screen(self, x: torch.Tensor, xnorm: torch.Tensor, tokens: torch.Tensor) -> None:
        approx, slack = self.screen.products(x, xnorm)
        s = self.screen
        self.head.gemm.head_greedy(
            x, self.head, self.rows, approx, s.norms, s.nmax, slack, self.cap, tokens
        )
