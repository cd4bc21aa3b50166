"""Projection GEMM in C (``kernels/csrc/gemm.c``) for float32 weights on the CPU.

A weight is packed once, after loading, into column panels (:class:`PanelWeight`);
:func:`worker.models.layers.linear` then sends every product with it here. Built and cached
like the decode kernel (:func:`kernels.native.build`; off with ``PAGEDSERVE_NATIVE_KERNELS=0``).

``PAGEDSERVE_NATIVE_GEMM``: ``auto`` (default) and ``1`` use it wherever it builds; ``0`` never,
and weights are packed for oneDNN as before. Measured against oneDNN with the same packed
weights (bench/README.md, 2 threads): on a Zen 3 EPYC (AVX2, 8-float build) decode-sized products
(8-96 rows) 1.3-2.3x, 0.85-1.06x at 2048 rows; on a Zen 5 EPYC (AVX-512, 16-float build) 1.3-1.8x
at 8 rows, 1.0-1.5x at 48, 0.94-1.03x at 256-2048, and 30 layers of cold weights at 16 / 48 rows
in 0.79-0.82x / 0.65-0.92x of oneDNN's time. ``auto`` is kept apart from ``1`` so that a CPU kind
where oneDNN wins can be told apart later without changing what ``1`` means.

Where the CPU has AVX512-BF16, the same library multiplies bfloat16 weights too
(:meth:`NativeGemm.pack_bf16`, ``vdpbf16ps``; ``--weight-dtype bfloat16``): on a Zen 4 EPYC its
decode-sized products ran 1.27-1.38x oneDNN's bfloat16 ones over cold weights, prefill-sized
ones within 5% (bench/README.md, a twenty-eighth session). Where the CPU also has AMX, the same
panels multiply on its tiles (``ps_gemm_bf16_amx``): on an Intel Xeon decode-sized products
1.5-1.7x oneDNN's AMX kernels over cold weights, 2048-row ones at 0.93-0.98x (a thirtieth
session).

int8 weights (:meth:`NativeGemm.pack_int8`, ``--weight-dtype int8``): a scale per 32 inputs of
each row, the int8 values widened and scaled in registers (``ps_gemm_i8``; past 32 rows a call
widens each block of panels once into float32 panels for all its row tiles), so each product is
bit for bit the float32 one with the weight ``Q * S``; ~0.28 of float32's bytes, for decode
steps of a few rows (on a Zen 4 EPYC, 30 cold SmolLM2 layers: 2.9x float32's speed at 1 row,
1.6x at 4, 0.9x from 16; bench/README.md, a thirty-seventh session; prefill-sized calls
0.91-1.03x float32's rate on a Xeon, a thirty-eighth).

A model's fused gate/up weight is packed with :meth:`NativeGemm.pack_glu` instead: gate and up
rows of the same outputs share each panel, and the product returns SwiGLU's ``silu(gate) * up``
(``ps_gemm_f32_glu``), the activation applied to each tile's sums in registers, so the
``[rows, 2 * inter]`` product is never written and read back (bit-identical to the product
followed by the fused SwiGLU pass of :mod:`kernels.fused`).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "gemm.c"
#: Its default build's flags (the decode kernel's; ``load(flags=...)`` builds others).
FLAGS = native.FLAGS
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
#: The int8 path's k step: a panel's 4-byte element holds 4 k steps of a column (``ps_gemm_i8``).
INT8_K = 4
#: Inputs per int8 scale (``PS_GEMM_I8_GROUP`` in gemm.c: 4 x ``PS_GEMM_KB``).
INT8_GROUP = 32
#: The AMX path's k step (one tile row of bfloat16 values): other widths use ``vdpbf16ps``.
AMX_K = 32


class NativeGemm:
    """The loaded library: packs weights and multiplies by them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        lib.ps_gemm_f32.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I32]
        lib.ps_gemm_f32.restype = None
        lib.ps_gemm_panel_width.restype = ctypes.c_int
        lib.ps_gemm_bf16.argtypes = lib.ps_gemm_f32.argtypes
        lib.ps_gemm_bf16.restype = None
        lib.ps_gemm_bf16_available.restype = ctypes.c_int
        lib.ps_gemm_bf16_amx.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _P, _I32]
        lib.ps_gemm_bf16_amx.restype = None
        lib.ps_gemm_amx_available.restype = ctypes.c_int
        lib.ps_gemm_f32_glu.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _P, _I32]
        lib.ps_gemm_f32_glu.restype = None
        lib.ps_gemm_i8.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _I64, _I32]
        lib.ps_gemm_i8.restype = None
        lib.ps_gemm_i8_group.restype = ctypes.c_int
        lib.ps_gemm_glu_partial.argtypes = [_I64, _I64]
        lib.ps_gemm_glu_partial.restype = ctypes.c_int
        lib.ps_gemm_head_greedy.argtypes = [_P, _I64, _I64, _I64, _P, _P, _I64, _I64, _P, _I64,
                                            _P, ctypes.c_float, _P, _I64, _P, _P, _I32]  # fmt: skip
        lib.ps_gemm_head_greedy.restype = None
        lib.ps_gemm_head_list.restype = _I64
        lib.ps_head_i16_screen.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _I64, _I32]
        lib.ps_head_i16_screen.restype = None
        lib.ps_head_i16_panel_width.restype = ctypes.c_int
        lib.ps_head_i16_vector.restype = ctypes.c_int
        self._lib = lib
        #: Output columns per panel: 16 with 8-float vectors, 32 with 16-float ones.
        self.panel_width = int(lib.ps_gemm_panel_width())
        #: Inputs per int8 scale in this build (:meth:`pack_int8` needs :data:`INT8_GROUP`).
        self.int8_group = int(lib.ps_gemm_i8_group())
        #: Whether this build multiplies bfloat16 weights (AVX-512 with AVX512-BF16).
        self.bf16 = bool(lib.ps_gemm_bf16_available())
        #: Whether this build has the AMX tile path and Linux granted this process the tiles:
        #: weights packed by :meth:`pack_bf16` with ``in`` a multiple of 32 then multiply on it.
        self.amx = self.bf16 and bool(lib.ps_gemm_amx_available())
        #: Candidate columns ``head_greedy`` lists per row at most (its scratch, per thread).
        self.head_list = int(lib.ps_gemm_head_list())
        #: Columns per panel of the integer head screen (:meth:`head_i16`).
        self.head_i16_width = int(lib.ps_head_i16_panel_width())
        #: Whether :meth:`head_i16` runs vector instructions (AVX2 / AVX-512BW), not plain C.
        self.head_i16_vector = bool(lib.ps_head_i16_vector())

    def tiles_take(self, in_features: int) -> bool:
        """Whether bfloat16 weights of this input width multiply on the AMX tiles here."""
        return self.amx and in_features % AMX_K == 0

    def pack(self, weight: torch.Tensor) -> PanelWeight:
        """``weight`` [out, in] (float32, CPU) as panels ``[ceil(out / NR), in, NR]``."""
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("pack takes a 2-D float32 CPU weight")
        n, k = weight.shape
        nr = self.panel_width
        padded = -(-n // nr) * nr
        w = weight.detach()
        if padded != n:
            w = torch.cat([w, w.new_zeros(padded - n, k)])
        panels = w.reshape(padded // nr, nr, k).transpose(1, 2).contiguous()
        return PanelWeight(panels=panels, out_features=n, in_features=k, gemm=self)

    def pack_glu(self, weight: torch.Tensor) -> PanelWeight:
        """A fused gate/up weight ``[2 * inter, in]`` (gate rows first, float32, CPU) packed so
        that :meth:`PanelWeight.matmul` gives ``silu(x @ gate.T) * (x @ up.T)`` ``[rows,
        inter]`` (``ps_gemm_f32_glu``): each panel's first half is ``L`` gate rows, its second
        half the same rows of up (``L`` = half the panel width), zero rows past ``inter``."""
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("pack_glu takes a 2-D float32 CPU weight")
        two_inter, k = weight.shape
        if two_inter % 2:
            raise ValueError("pack_glu takes gate and up rows stacked: an even number of rows")
        halves = [_glu_halves(h, self.panel_width // 2) for h in weight.detach().chunk(2)]
        panels = torch.cat(halves, dim=1).transpose(1, 2).contiguous()
        return PanelWeight(panels=panels, out_features=two_inter // 2, in_features=k, gemm=self,
                           glu=True)  # fmt: skip

    def pack_int8(self, weight: torch.Tensor) -> PanelWeight:
        """``weight`` [out, in] (float32, CPU, ``in`` a multiple of 4) as int8 panels
        ``[ceil(out / NR), in, NR]`` with float32 scales ``[ceil(out / NR), groups, NR]``
        (:func:`quantize_int8`'s, one per row per :data:`INT8_GROUP` inputs; ``ps_gemm_i8``).
        Its product is, bit for bit, the float32 one with the weight ``Q * S``."""
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("pack_int8 takes a 2-D float32 CPU weight")
        n, k = weight.shape
        if k % INT8_K:
            raise ValueError(f"pack_int8 needs input features in multiples of {INT8_K}")
        if self.int8_group != INT8_GROUP:  # a build with another PS_GEMM_KB
            raise ValueError(
                f"this build groups int8 scales by {self.int8_group}, not {INT8_GROUP}"
            )
        q, scale = quantize_int8(weight.detach())
        nr = self.panel_width
        padded = -(-n // nr) * nr
        if padded != n:
            q = torch.cat([q, q.new_zeros(padded - n, k)])
            scale = torch.cat([scale, scale.new_zeros(padded - n, scale.shape[1])])
        panels = q.reshape(padded // nr, nr, k).transpose(1, 2).contiguous()
        scales = scale.reshape(padded // nr, nr, -1).transpose(1, 2).contiguous()
        return PanelWeight(panels=panels, out_features=n, in_features=k, gemm=self,
                           scale=scales)  # fmt: skip

    def pack_bf16(self, weight: torch.Tensor, amx: bool | None = None) -> PanelWeight:
        """``weight`` [out, in] (float32, CPU, ``in`` even) rounded to bfloat16 as panels of 32
        columns with each column's k pairs side by side: ``[ceil(out / 32), in / 2, 32, 2]``
        (``ps_gemm_bf16`` in gemm.c). Only where :attr:`bf16`. ``amx``: its products on the
        AMX tiles (``ps_gemm_bf16_amx``: the same panels); default where :attr:`amx` and ``in``
        is a multiple of 32, else ``vdpbf16ps``."""
        if not self.bf16:
            raise ValueError("this build of the C GEMM has no bfloat16 path (AVX512-BF16)")
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("pack_bf16 takes a 2-D float32 CPU weight")
        n, k = weight.shape
        if k % 2:
            raise ValueError("pack_bf16 needs an even number of input features")
        if amx is None:
            amx = self.tiles_take(k)
        elif amx and not self.amx:
            raise ValueError("this build or CPU has no AMX tile path")
        elif amx and not self.tiles_take(k):
            raise ValueError(f"the AMX path takes input features in multiples of {AMX_K}")
        nr = self.panel_width
        padded = -(-n // nr) * nr
        w = weight.detach().to(torch.bfloat16)
        if padded != n:
            w = torch.cat([w, w.new_zeros(padded - n, k)])
        panels = w.reshape(padded // nr, nr, k // 2, 2).transpose(1, 2).contiguous()
        return PanelWeight(panels=panels, out_features=n, in_features=k, gemm=self, amx=amx)

    def matmul(
        self, x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ W.T (+ bias)`` for 2-D float32 ``x`` with unit column stride; for a bfloat16
        weight ``x`` is rounded to bfloat16 first (to nearest even, as ``Tensor.to``)."""
        m, k = x.shape
        if k != weight.in_features or x.dtype != torch.float32 or not x.is_cpu:
            raise ValueError(f"x must be float32 [rows, {weight.in_features}] on the CPU")
        if weight.glu:
            return self._matmul_glu(x, weight, bias)
        if weight.scale is not None:
            return self._matmul_int8(x, weight, bias)
        bf16 = weight.panels.dtype == torch.bfloat16
        amx = bf16 and weight.amx
        if bf16 and not amx:
            x = x.to(torch.bfloat16, memory_format=torch.contiguous_format)
        elif x.stride(1) != 1:
            x = x.contiguous()
        bias = _column_bias(bias, weight.out_features)
        y = torch.empty(m, weight.out_features, dtype=torch.float32)
        args = (
            x.data_ptr(), m, k, x.stride(0), weight.panels.data_ptr(), weight.out_features,
            None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0),
        )  # fmt: skip
        if amx:  # x is rounded in C, into row blocks of the tiles' shape
            scratch = torch.empty(-(-m // 16) * 16 * k, dtype=torch.bfloat16)
            self._lib.ps_gemm_bf16_amx(*args, scratch.data_ptr(), torch.get_num_threads())
        else:
            run = self._lib.ps_gemm_bf16 if bf16 else self._lib.ps_gemm_f32
            run(*args, torch.get_num_threads())
        return y

    def head_greedy(
        self,
        x: torch.Tensor,
        head: PanelWeight,
        rows: torch.Tensor | None,
        approx: torch.Tensor,
        norms: torch.Tensor,
        nmax: float,
        slack: torch.Tensor,
        cap: int,
        tokens: torch.Tensor,
    ) -> None:
        """``ps_gemm_head_greedy`` (:mod:`kernels.greedy_head`): into ``tokens`` (int64) each
        row's float32 greedy token of the float32 ``head`` from ``approx`` (its bfloat16
        products), or -1. ``rows``: the head's weight unpacked, or None (the panels are read);
        ``slack``: [rows, 2] float32 (s, t) of each row's bound."""
        threads = torch.get_num_threads()
        cand = torch.empty(threads * self.head_list, dtype=torch.int64)
        self._lib.ps_gemm_head_greedy(
            x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), head.panels.data_ptr(),
            None if rows is None else rows.data_ptr(), 0 if rows is None else rows.stride(0),
            head.out_features, approx.data_ptr(), approx.stride(0), norms.data_ptr(), nmax,
            slack.data_ptr(), cap, cand.data_ptr(), tokens.data_ptr(), threads,
        )  # fmt: skip

    def head_i16(
        self,
        xq: torch.Tensor,
        panels: torch.Tensor,
        out_features: int,
        colscale: torch.Tensor,
        rowscale: torch.Tensor,
    ) -> torch.Tensor:
        """``ps_head_i16_screen`` (:class:`kernels.greedy_head.Int16Screen`): ``(xq @ Q.T) *
        colscale * rowscale[:, None]`` in float32 from the exact int32 sums, for int16 rows
        ``xq`` [rows, in] and the int16 ``panels`` [ceil(out / width), in / 2, width, 2]."""
        m, k = xq.shape
        if xq.dtype != torch.int16 or k % 2 or panels.shape[1] * 2 != k:
            raise ValueError(f"xq must be int16 [rows, {panels.shape[1] * 2}]")
        xq = xq.contiguous()
        y = torch.empty(m, out_features, dtype=torch.float32)
        self._lib.ps_head_i16_screen(
            xq.data_ptr(), m, k, xq.stride(0), panels.data_ptr(), out_features,
            colscale.data_ptr(), rowscale.data_ptr(), y.data_ptr(), y.stride(0),
            torch.get_num_threads(),
        )  # fmt: skip
        return y

    def _matmul_int8(
        self, x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ (Q * S).T (+ bias)`` for a :meth:`pack_int8` weight."""
        assert weight.scale is not None
        m, k = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        bias = _column_bias(bias, weight.out_features)
        y = torch.empty(m, weight.out_features, dtype=torch.float32)
        self._lib.ps_gemm_i8(
            x.data_ptr(), m, k, x.stride(0), weight.panels.data_ptr(), weight.out_features,
            weight.scale.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
            y.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        return y

    def _matmul_glu(
        self, x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``silu(x @ gate.T + bg) * (x @ up.T + bu)`` for a :meth:`pack_glu` weight; ``bias``
        is the plain fused one (``[2 * inter]``, gate first)."""
        m, k = x.shape
        inter = weight.out_features
        if x.stride(1) != 1:
            x = x.contiguous()
        if bias is not None:
            if bias.numel() != 2 * inter:
                raise ValueError("bias must have one value per gate and up row")
            bias = bias.detach().to(torch.float32).contiguous()
        y = torch.empty(m, inter, dtype=torch.float32)
        partial = None
        if self._lib.ps_gemm_glu_partial(m, k):
            partial = torch.empty(m, weight.panels.shape[0] * self.panel_width)
        self._lib.ps_gemm_f32_glu(
            x.data_ptr(), m, k, x.stride(0), weight.panels.data_ptr(), inter,
            None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0),
            None if partial is None else partial.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return y


def _column_bias(bias: torch.Tensor | None, columns: int) -> torch.Tensor | None:
    """``bias`` as the C GEMM reads it (contiguous float32), one value per output column."""
    if bias is None:
        return None
    bias = bias.detach().to(torch.float32).contiguous()
    if bias.numel() != columns:
        raise ValueError("bias must have one value per output column")
    return bias


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] float32 as (``Q`` int8 [out, in], ``S`` float32 [out, groups]):
    each row's runs of :data:`INT8_GROUP` inputs (the last may be shorter) scaled so that their
    largest magnitude is 127, rounded to nearest (ties to even); ``W ~ Q * S`` within half a
    step of each group, a group of zeros keeps scale 0 (what :meth:`NativeGemm.pack_int8`
    packs). :func:`dequantize_int8` gives the float32 weight the int8 product multiplies by."""
    n, k = weight.shape
    groups = -(-k // INT8_GROUP)
    padded = torch.nn.functional.pad(weight.float(), (0, groups * INT8_GROUP - k))
    blocks = padded.view(n, groups, INT8_GROUP)
    scale = blocks.abs().amax(dim=2) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / safe[:, :, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(n, -1)[:, :k].contiguous(), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``Q * S`` in float32 (each weight times its group's scale), as the int8 product uses it."""
    per_k = scale.repeat_interleave(INT8_GROUP, dim=1)[:, : q.shape[1]]
    return q.float() * per_k


def _glu_halves(rows: torch.Tensor, width: int) -> torch.Tensor:
    """``rows`` ``[n, k]`` zero-padded to a multiple of ``width`` rows, as ``[n / width, width,
    k]`` (one GLU panel's gate or up half each)."""
    n, k = rows.shape
    padded = -(-n // width) * width
    if padded != n:
        rows = torch.cat([rows, rows.new_zeros(padded - n, k)])
    return rows.reshape(padded // width, width, k)


@dataclass(frozen=True, eq=False)
class PanelWeight:
    """A projection weight in :mod:`kernels.gemm`'s panel layout (what ``linear`` takes):
    float32 panels (:meth:`NativeGemm.pack`), bfloat16 ones (:meth:`NativeGemm.pack_bf16`) or
    int8 ones with their scales (:meth:`NativeGemm.pack_int8`)."""

    panels: torch.Tensor
    out_features: int
    in_features: int
    gemm: NativeGemm
    #: bfloat16 panels multiplied on the AMX tiles (:meth:`NativeGemm.pack_bf16`).
    amx: bool = False
    #: gate and up panels whose product is ``silu(gate) * up`` (:meth:`NativeGemm.pack_glu`;
    #: ``out_features`` is then the intermediate size).
    glu: bool = False
    #: int8 panels' scales ``[panels, groups, NR]`` (:meth:`NativeGemm.pack_int8`).
    scale: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """``(out, in)``, as the plain weight's (a GLU weight's: gate and up rows)."""
        return self.out_features * (2 if self.glu else 1), self.in_features

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` over any leading dimensions of ``x``."""
        if x.dim() == 2:  # every call of the engine's: no reshapes (~2 us a call)
            return self.gemm.matmul(x, self, bias)
        lead = x.shape[:-1]
        y = self.gemm.matmul(x.reshape(-1, x.shape[-1]), self, bias)
        return y.reshape(*lead, self.out_features)


_LOADED: NativeGemm | None = None
_TRIED = False


def load(flags: list[str] | None = None) -> NativeGemm | None:
    """The library, built on first call; None (logged once) when disabled or not buildable.
    ``flags``: another build (the tests build the 8- and 16-float ones on every machine); not
    cached in the module."""
    global _LOADED, _TRIED
    if flags is not None:
        return NativeGemm(native.build(source=SOURCE, flags=flags))
    if _TRIED:
        return _LOADED
    _TRIED = True
    if native.switched_off(native.DISABLE_ENV):
        log.info("native CPU GEMM disabled by %s", native.DISABLE_ENV)
        return None
    try:
        _LOADED = NativeGemm(native.build(source=SOURCE, flags=FLAGS))
    except (OSError, RuntimeError) as exc:
        log.warning("native CPU GEMM unavailable, projections stay on oneDNN: %s", exc)
    return _LOADED


def for_packing() -> NativeGemm | None:
    """The library when projections should be packed for it (``PAGEDSERVE_NATIVE_GEMM``)."""
    if native.switched_off(native.GEMM_ENV):
        return None
    return load()


__all__ = ["NativeGemm", "PanelWeight", "dequantize_int8", "for_packing", "load", "quantize_int8"]
