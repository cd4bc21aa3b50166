"""The engine against transformers: greedy outputs token for token, under every scheduling stress.

References come from the transformers model on the same checkpoint, decoding each prompt alone
with its KV cache (no padding), so they share nothing with our code path.
"""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest
import torch

from pagedserve.params import SamplingParams
from worker import LLM
from worker.outputs import RequestRejected

FAMILIES = ("llama", "mistral", "qwen2")


@cache
def _hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(
    model_dir: Path, prompt: list[int], n: int, repetition_penalty: float = 1.0
) -> list[int]:
    """Greedy continuation by transformers, EOS ignored."""
    model = _hf_model(model_dir)
    ids = torch.tensor([prompt])
    out = model(ids, use_cache=True)
    past, logits = out.past_key_values, out.logits[0, -1]
    seen = list(prompt)
    tokens: list[int] = []
    for _ in range(n):
        if repetition_penalty != 1.0:
            logits = logits.clone()
            idx = torch.tensor(sorted(set(seen)))
            vals = logits[idx]
            logits[idx] = torch.where(
                vals > 0, vals / repetition_penalty, vals * repetition_penalty
            )
        t = int(torch.argmax(logits))
        tokens.append(t)
        seen.append(t)
        out = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
    return tokens


def random_prompts(
    seed: int, count: int, lo: int, hi: int, shared: list[int] | None = None
) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randint(lo, hi))] for _ in range(count)]
    if shared:
        prompts = [shared + p for p in prompts]
    return prompts


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "options",
    [
        pytest.param(
            {"block_size": 16, "num_kv_blocks": 128, "max_num_batched_tokens": 512}, id="roomy"
        ),
        pytest.param(
            {"block_size": 8, "num_kv_blocks": 128, "max_num_batched_tokens": 24},
            id="chunked-prefill",
        ),
        pytest.param(
            {"block_size": 8, "num_kv_blocks": 22, "max_num_batched_tokens": 64}, id="preemption"
        ),
        pytest.param(
            {"block_size": 32, "num_kv_blocks": 64, "enable_prefix_caching": False},
            id="no-prefix-cache",
        ),
    ],
)
def test_greedy_matches_transformers(make_tiny_model, family: str, options: dict) -> None:
    model_dir = make_tiny_model(family)
    shared = random_prompts(99, 1, 40, 40)[0]  # a shared system prompt: prefix-cache hits
    prompts = random_prompts(1, 6, 1, 70) + random_prompts(2, 4, 1, 20, shared=shared)
    llm = LLM(model_dir, **options)
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.error is None
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 12), (
            f"prompt of {len(prompt)}"
        )
        assert out.outputs[0].finish_reason == "length"
    stats = llm.engine.stats()
    if options.get("num_kv_blocks") == 22:
        assert stats.preemptions > 0, "the small pool must force preemptions"
    if options.get("enable_prefix_caching", True):
        assert stats.prefix_cache["hit_tokens"] > 0
        assert sum(o.num_cached_tokens for o in outs) > 0
    occ = llm.engine.occupancy()
    assert occ.in_use == 0, "all blocks return to the pool"


def test_repetition_penalty_matches_transformers(make_tiny_model) -> None:
    model_dir = make_tiny_model("llama")
    prompts = random_prompts(5, 3, 3, 30)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.5)
    outs = LLM(model_dir, num_kv_blocks=64).generate(prompts, params)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(model_dir, p, 10, repetition_penalty=1.5)


def test_seeded_sampling_ignores_batch_neighbours(make_tiny_model) -> None:
    model_dir = make_tiny_model("llama")
    prompt = random_prompts(7, 1, 10, 10)[0]
    params = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=1234, ignore_eos=True
    )
    alone = LLM(model_dir, num_kv_blocks=64).generate([prompt], params)[0].outputs[0].token_ids
    crowd = random_prompts(8, 7, 5, 60)
    other = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    outs = LLM(model_dir, num_kv_blocks=64).generate(
        [*crowd[:3], prompt, *crowd[3:]], [other] * 3 + [params] + [other] * 4
    )
    assert outs[3].outputs[0].token_ids == alone


def test_parallel_sampling_shares_the_prompt_copy_on_write(make_tiny_model) -> None:
    """Completion i of an n=3 request equals an n=1 request seeded seed+i: the forked children
    read the shared prompt blocks and their private copies correctly."""
    model_dir = make_tiny_model("qwen2")
    prompt = random_prompts(11, 1, 21, 21)[0]  # ends mid-block: the partial block is shared
    llm = LLM(model_dir, num_kv_blocks=64, block_size=8)
    base = dict(temperature=1.0, max_tokens=10, ignore_eos=True)
    multi = llm.generate([prompt], SamplingParams(n=3, seed=40, **base))[0]
    assert [c.index for c in multi.outputs] == [0, 1, 2]
    singles = llm.generate([prompt] * 3, [SamplingParams(seed=40 + i, **base) for i in range(3)])
    for i in range(3):
        assert multi.outputs[i].token_ids == singles[i].outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in multi.outputs}) > 1
    greedy = llm.generate(
        [prompt], SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True)
    )[0]
    ref = hf_greedy(model_dir, prompt, 10)
    assert [c.token_ids for c in greedy.outputs] == [ref, ref]
    assert llm.engine.occupancy().in_use == 0


def test_stop_strings_end_the_text_and_never_appear(make_tiny_model) -> None:
    model_dir = make_tiny_model("llama")
    llm = LLM(model_dir, num_kv_blocks=64)
    prompt = "def main():"
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    text = full.outputs[0].text
    assert len(text) > 12
    stop = text[6:9]
    cut = text.index(stop)
    engine = llm.engine
    engine.add_request(
        "s", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    )
    deltas, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.outputs[0].text_delta)
            final = out
    assert final is not None and final.finished
    comp = final.outputs[0]
    assert comp.finish_reason == "stop"
    assert comp.text == text[:cut]
    assert "".join(deltas) == comp.text
    assert all(stop not in d for d in deltas)


def test_stop_token_ids_and_eos(make_tiny_model) -> None:
    model_dir = make_tiny_model("llama")
    llm = LLM(model_dir, num_kv_blocks=64)
    prompt = random_prompts(3, 1, 8, 8)[0]
    ref = hf_greedy(model_dir, prompt, 10)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ref[4]])
    )[0]
    first = ref.index(ref[4])
    assert out.outputs[0].token_ids == ref[: first + 1] and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == llm.tokenizer.decode(ref[:first])  # the stop token's text is not


def test_logprobs_are_the_models(make_tiny_model) -> None:
    model_dir = make_tiny_model("llama")
    prompt = random_prompts(4, 1, 9, 9)[0]
    out = LLM(model_dir, num_kv_blocks=64).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)
    )[0]
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == 3
    with torch.inference_mode():
        ref = torch.log_softmax(_hf_model(model_dir)(torch.tensor([prompt])).logits[0, -1], -1)
    assert lps[0].token_id == int(torch.argmax(ref))
    assert lps[0].logprob == pytest.approx(float(ref.max()), abs=1e-4)
    assert len(lps[0].top) == 2 and max(lps[0].top.values()) == pytest.approx(lps[0].logprob)


def test_bad_requests_fail_alone(make_tiny_model) -> None:
    model_dir = make_tiny_model("llama")
    llm = LLM(model_dir, num_kv_blocks=16, block_size=8, max_model_len=256)
    good = random_prompts(6, 2, 5, 10)
    outs = llm.generate([good[0], list(range(300)), [10**6], good[1]], GREEDY)
    assert outs[0].error is None and outs[3].error is None
    assert "context length" in (outs[1].error or "")
    assert "token ids must be integers" in (outs[2].error or "")
    with pytest.raises(RequestRejected, match="can never fit"):
        LLM(model_dir, num_kv_blocks=2, block_size=8).engine.add_request(
            "x", list(range(5, 40)), GREEDY
        )


def test_chat_and_multibyte_text(make_tiny_model) -> None:
    model_dir = make_tiny_model("qwen2")
    llm = LLM(model_dir, num_kv_blocks=64)
    out = llm.chat(
        [{"role": "user", "content": "Grüß dich, 日本語!"}],
        SamplingParams(temperature=0, max_tokens=5),
    )[0]
    assert out.error is None and out.prompt and "<|im_start|>" in out.prompt
    # Incremental deltas over a multi-byte text never split a character.
    from worker.detokenizer import IncrementalDetokenizer

    tok = llm.tokenizer
    text = "Grüß dich, 日本語 — ça va? ✓"
    ids = tok.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [])
    parts = [det.add([t])[0] for t in ids]
    parts.append(det.flush())
    assert "".join(parts) == text
    assert all("\ufffd" not in p for p in parts)


def test_bfloat16_runs_on_cpu(make_tiny_model) -> None:
    model_dir = make_tiny_model("llama")
    prompts = random_prompts(9, 3, 4, 30)
    outs = LLM(model_dir, num_kv_blocks=64, dtype="bfloat16").generate(prompts, GREEDY)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)


def test_outputs_are_cumulative_and_abort_returns_the_partial_output(make_tiny_model) -> None:
    """Each step's output holds the whole completion so far; its deltas are exactly what is new
    since the previous output; abort hands back what was generated, ended by "abort"."""
    model_dir = make_tiny_model("llama")
    llm = LLM(model_dir, num_kv_blocks=64)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=2, seed=1)
    engine.add_request("a", "def main():", params)
    seen: dict[int, tuple[list[int], str]] = {0: ([], ""), 1: ([], "")}
    for _ in range(6):
        for out in engine.step():
            for c in out.outputs:
                ids, text = seen[c.index]
                assert c.token_ids == ids + c.new_token_ids and c.text == text + c.text_delta
                seen[c.index] = (list(c.token_ids), c.text)
    assert all(len(ids) >= 4 for ids, _ in seen.values())
    partial = engine.abort("a")
    assert partial is not None and partial.finished and not engine.has_unfinished()
    assert [c.finish_reason for c in partial.outputs] == ["abort", "abort"]
    assert {c.index: (c.token_ids, c.text) for c in partial.outputs} == seen
    assert engine.abort("a") is None and engine.abort("never") is None


def test_unstreamed_requests_report_first_token_and_end_and_snapshot_between(
    make_tiny_model,
) -> None:
    """``stream=False``: step reports the request at its first token and at its end only;
    ``snapshot`` in between holds everything so far with deltas since the previous output;
    the tokens and text equal those of the same request streamed (greedy, same batch)."""
    model_dir = make_tiny_model("llama")
    llm = LLM(model_dir, num_kv_blocks=64)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2, seed=1)
    engine.add_request("lazy", "def main():", params, stream=False)
    engine.add_request("live", "def main():", params)
    assert engine.snapshot("lazy") is not None  # before its first token: nothing yet
    reports: list[int] = []  # steps at which "lazy" was reported
    live_steps = 0
    step = 0
    final = {}
    seen: dict[int, list[int]] = {0: [], 1: []}
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            live_steps += out.request_id == "live"
            if out.request_id == "lazy":
                reports.append(step)
                for c in out.outputs:
                    assert c.token_ids == seen[c.index] + c.new_token_ids
                    seen[c.index] = list(c.token_ids)
            if out.finished:
                final[out.request_id] = out
        if step in (6, 11):  # a caller reading progress at intervals
            snap = engine.snapshot("lazy")
            assert snap is not None and not snap.finished
            for c in snap.outputs:
                assert c.token_ids == seen[c.index] + c.new_token_ids
                seen[c.index] = list(c.token_ids)
            assert all(len(ids) >= 3 for ids in seen.values())
    assert len(reports) == 2 and live_steps >= 20  # first token and end vs every step
    assert engine.snapshot("lazy") is None  # finished: reported by step, then gone
    lazy, live = final["lazy"], final["live"]
    assert [(c.token_ids, c.text) for c in lazy.outputs] == [
        (c.token_ids, c.text) for c in live.outputs
    ]
    assert all(len(c.token_ids) == 24 for c in lazy.outputs)  # (its deltas checked above)


def test_loading_freezes_the_heap_and_raises_the_young_threshold(make_tiny_model) -> None:
    """``freeze_gc`` (the default): after loading, what exists is frozen and the youngest
    generation's threshold is at least ``GC_GEN0_THRESHOLD`` (a higher one is kept); with
    ``freeze_gc=False`` the collector is left as it was."""
    import gc

    from worker.engine import GC_GEN0_THRESHOLD

    model_dir = make_tiny_model("llama")
    saved, was_frozen = gc.get_threshold(), gc.get_freeze_count() > 0
    try:
        gc.unfreeze()
        gc.set_threshold(700, *saved[1:])
        LLM(model_dir, num_kv_blocks=16, freeze_gc=False)
        assert gc.get_threshold()[0] == 700 and gc.get_freeze_count() == 0
        LLM(model_dir, num_kv_blocks=16)
        assert gc.get_threshold() == (GC_GEN0_THRESHOLD, *saved[1:])
        assert gc.get_freeze_count() > 0
        gc.set_threshold(5 * GC_GEN0_THRESHOLD, *saved[1:])
        LLM(model_dir, num_kv_blocks=16)
        assert gc.get_threshold()[0] == 5 * GC_GEN0_THRESHOLD
    finally:
        gc.unfreeze()
        if was_frozen:  # as the engines loaded before this test left the process
            gc.freeze()
        gc.set_threshold(*saved)


@pytest.mark.parametrize("which", ["llama", "qwen2", "smollm2"])
def test_the_direct_decoder_renders_what_the_tokenizer_decodes(
    which: str, make_tiny_model, request: pytest.FixtureRequest
) -> None:
    """The detokenizer calls a fast tokenizer's Rust ``decode`` directly (``decoder_of``): the
    text must be what ``tokenizer.decode`` gives, window by window, with and without special
    tokens, for the tiny checkpoints' tokenizers and the real SmolLM2's."""
    from worker.detokenizer import decoder_of
    from worker.tokenizing import load_tokenizer

    if which == "smollm2":
        model_dir = request.getfixturevalue("real_model_dir")
    else:
        model_dir = make_tiny_model(which)
    tok = load_tokenizer(model_dir)
    assert tok is not None
    rng = random.Random(7)
    specials = list(tok.all_special_ids)
    text = "Grüß dich, 日本語 — ça va? ✓ def main():\n    return 42  # ok"
    ids = tok.encode(text, add_special_tokens=False)
    for skip in (True, False):
        fast = decoder_of(tok, skip)
        assert fast.func == tok.backend_tokenizer.decode  # the direct path, for these tokenizers
        windows = [ids[i : i + n] for i in range(len(ids)) for n in (1, 2, 7)]
        windows += [rng.sample(range(tok.vocab_size), 12) + rng.sample(specials, 1)
                    for _ in range(200)]  # fmt: skip
        for w in windows:
            assert fast(w) == tok.decode(w, skip_special_tokens=skip), w


@pytest.mark.parametrize("which", ["llama", "qwen2", "smollm2"])
def test_lazy_detokenizer_renders_what_the_token_by_token_one_does(
    which: str, make_tiny_model, request: pytest.FixtureRequest
) -> None:
    """Without stop strings the detokenizer decodes when its text is read (``lazy``): read after
    every token, every few tokens or only at the end, its deltas join to the text the eager one
    renders token by token (multi-byte characters, random ids, special tokens in between), and
    no delta splits a character the eager one keeps whole. Stop strings stay eager."""
    from worker.detokenizer import IncrementalDetokenizer
    from worker.tokenizing import load_tokenizer

    model_dir = request.getfixturevalue("real_model_dir") if which == "smollm2" else (
        make_tiny_model(which)
    )  # fmt: skip
    tok = load_tokenizer(model_dir)
    assert tok is not None
    rng = random.Random(11)
    text = "Grüß dich, 日本語 — ça va? ✓ 🎉🎉 def main():\n    return 42  # ok"
    prompt = tok.encode("Say:", add_special_tokens=False)
    streams = [tok.encode(text, add_special_tokens=False)]
    streams += [rng.sample(range(tok.vocab_size), 40) for _ in range(30)]
    streams += [s[:7] + list(tok.all_special_ids) + s[7:] for s in streams[:3]]
    for ids in streams:
        eager = IncrementalDetokenizer(tok, prompt)
        eager_parts = [eager.add([t])[0] for t in ids] + [eager.flush()]
        for every in (1, 3, 16, len(ids) + 1):
            lazy = IncrementalDetokenizer(tok, prompt, lazy=True)
            parts = []
            for i, t in enumerate(ids, 1):
                assert lazy.add([t]) == ("", False)
                if i % every == 0:
                    parts.append(lazy.sync())
            parts.append(lazy.flush())
            assert "".join(parts) == "".join(eager_parts) == eager.text == lazy.text, ids
            if all("\ufffd" not in p for p in eager_parts):
                assert all("\ufffd" not in p for p in parts), (ids, every, parts)
    # Bytes that never complete a character (a lead byte, repeated) are not held back forever.
    lead = tok.convert_tokens_to_ids("æ")  # byte 0xE6 in these byte-level vocabularies
    assert tok.decode([lead]) == "\ufffd"
    eager, lazy = (
        IncrementalDetokenizer(tok, prompt),
        IncrementalDetokenizer(tok, prompt, lazy=True),
    )
    for _ in range(12):
        eager.add([lead])
        lazy.add([lead])
    held = eager.text[: eager.emitted]
    assert held and lazy.sync().startswith(held)
    eager.flush()
    lazy.flush()
    assert lazy.text == eager.text
    with pytest.raises(ValueError, match="stop strings"):
        IncrementalDetokenizer(tok, prompt, ["\n"], lazy=True)


def test_moved_prefixes_keep_their_kv_when_tables_grow_in_place(make_tiny_model) -> None:
    """Turns of conversations in two groups on a small pool: a growing table takes the block
    after its last one, moving the prefix that block cached (the other group's history) into the
    block at the front of the free queue (``BlockPool.take``). The other group's next
    turn then reads its history from the moved blocks: greedy tokens still equal transformers'."""
    model_dir = make_tiny_model("llama")
    llm = LLM(model_dir, block_size=8, num_kv_blocks=40, max_num_batched_tokens=64)
    pool = llm.engine.scheduler.pool
    moved: set[int] = set()
    hit_moved: set[int] = set()
    move_prefix, acquire = pool._move_prefix, pool.acquire

    def spy_move(src: int, dst: int, copies: list[tuple[int, int]]) -> None:
        moved.add(dst)
        move_prefix(src, dst, copies)

    def spy_acquire(block: int) -> None:
        if block in moved:
            hit_moved.add(block)
        acquire(block)

    pool._move_prefix, pool.acquire = spy_move, spy_acquire  # record, then do the real work
    rng = random.Random(3)
    groups = [random_prompts(11, 3, 8, 30), random_prompts(12, 3, 8, 30)]
    for _turn in range(4):
        for g, prompts in enumerate(groups):
            outs = llm.generate(prompts, GREEDY)
            for prompt, out in zip(prompts, outs, strict=True):
                assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 12)
            groups[g] = [
                p
                + o.outputs[0].token_ids
                + [rng.randrange(5, 500) for _ in range(rng.randint(2, 6))]
                for p, o in zip(prompts, outs, strict=True)
            ]
    assert pool.stats.moved_blocks > 0 and hit_moved, "a moved prefix was read by a later turn"
    stats = llm.engine.stats().prefix_cache
    assert stats["hit_tokens"] > 0 and stats["moved_blocks"] == pool.stats.moved_blocks
    assert llm.engine.occupancy().in_use == 0
