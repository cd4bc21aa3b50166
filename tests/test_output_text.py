"""Outputs whose text the engine leaves out (``Engine.add_request(render_text=False)``) and the
reader renders (:class:`worker.output_text.OutputText`, the engine process's parent): output by
output the same text and ``num_new_chars`` as the engine's own rendering, on the same steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.params import SamplingParams
from worker.engine import Engine
from worker.engine_process import EngineProcess
from worker.output_text import OutputText, text_read_later
from worker.outputs import EngineConfig, RequestOutput

CFG = EngineConfig(num_kv_blocks=256, max_model_len=512, num_threads=1)
PROMPTS = ["The quick brown fox", "naïve café: 日本語の文 🙂", "def main():", [5, 17, 99, 200, 3]]


def cases(stop_token: int) -> list[SamplingParams]:
    """Greedy to its length, greedy ending at a stop token it produces (finish "stop": the
    token stays in token_ids, never in the text), seeded sampling with n=2, and one with stop
    strings, which the engine renders itself either way."""
    return [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=20, temperature=1.0, seed=7, n=2, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.0, seed=3, stop=["e", "\n"]),
    ]


def greedy_token(eng: Engine, prompt: str) -> int:
    """The 5th token greedy decoding gives ``prompt`` (a stop token the greedy case reaches)."""
    eng.add_request("probe", prompt, SamplingParams(max_tokens=5, temperature=0.0,
                                                    ignore_eos=True))  # fmt: skip
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                return out.outputs[0].token_ids[-1]
    raise AssertionError("the probe did not finish")


def add_all(eng: Engine, params: list[SamplingParams], render: bool) -> list[str]:
    ids = []
    for i, p in enumerate(PROMPTS):
        for j, sp in enumerate(params):
            rid = f"{i}-{j}"
            eng.add_request(rid, p, sp, stream=False, render_text=render)
            ids.append(rid)
    return ids


def same(got: RequestOutput, want: RequestOutput) -> None:
    assert got.request_id == want.request_id and got.finished == want.finished
    for g, w in zip(got.outputs, want.outputs, strict=True):
        assert (g.index, g.token_ids, g.finish_reason) == (w.index, w.token_ids, w.finish_reason)
        assert g.text == w.text, (got.request_id, g.index)
        assert g.num_new_chars == w.num_new_chars, (got.request_id, g.index)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_rendered_text_equals_the_engines_output_by_output(make_tiny_model, family: str) -> None:  # type: ignore[no-untyped-def]
    """Two engines on the same requests in lockstep (the same batches, so the same tokens):
    one renders its text, the other leaves it to :class:`OutputText`; every step's outputs and
    the snapshots taken every third step match, including completions ending at a stop
    token and multi-byte characters split across tokens (a byte-level vocabulary)."""
    model = make_tiny_model(family)
    ref, bare = Engine(model, CFG), Engine(model, CFG)
    params = cases(greedy_token(ref, str(PROMPTS[0])))
    greedy_token(bare, str(PROMPTS[0]))  # the same history (prefix cache) on both
    rids = add_all(ref, params, render=True)
    add_all(bare, params, render=False)
    text = OutputText(bare.tokenizer)
    rendered = {rid for rid in rids if text_read_later(params[int(rid.split("-")[1])])}
    for rid in rendered:
        text.expect(rid)
    last: dict[str, RequestOutput | None] = dict.fromkeys(rids)
    finished: list[RequestOutput] = []
    steps = 0
    while ref.has_unfinished():
        assert bare.has_unfinished()
        steps += 1
        pairs = list(zip(ref.step(), bare.step(), strict=True))
        if steps % 3 == 0:
            live = [r for r in rids if last[r] is None or not last[r].finished]  # type: ignore[union-attr]
            pairs += [(a, b) for r in live if (a := ref.snapshot(r)) and (b := bare.snapshot(r))]
        for want, got in pairs:
            if got.request_id in rendered:
                assert all(c.text == "" for c in got.outputs), (got, want)  # the engine left it out
            text.render(last[got.request_id], got)
            same(got, want)
            last[got.request_id] = got
            if got.finished:
                finished.append(got)
    assert not bare.has_unfinished() and len(text) == 0
    assert sorted(o.request_id for o in finished) == sorted(rids)
    reasons = {c.finish_reason for o in finished for c in o.outputs}
    assert reasons == {"length", "stop"}
    stopped = [o for o in finished if o.request_id.endswith("-1")]
    assert any(o.outputs[0].finish_reason == "stop" for o in stopped)  # the stop-token case ran
    assert sum(len(c.text) for o in finished for c in o.outputs if o.request_id in rendered) > 100


def test_the_engine_process_renders_text_in_the_loops_process(real_model_dir: Path) -> None:
    """End to end on SmolLM2 (its real tokenizer: EOS a special token, text in many scripts):
    the engine process's outputs, text rendered in this process, equal the in-process engine's;
    an abort returns the text rendered so far."""
    params = [
        SamplingParams(max_tokens=16, temperature=0.0),
        SamplingParams(max_tokens=12, temperature=0.8, seed=1, n=2),
        SamplingParams(max_tokens=16, temperature=0.0, stop=["."]),
    ]
    prompts = ["Write one sentence about Paris.", "Übersetze: guten Morgen", "1, 2, 3,"]
    local = Engine(real_model_dir, CFG)
    remote = EngineProcess(real_model_dir, CFG)
    try:
        for i, p in enumerate(prompts):
            for j, sp in enumerate(params):
                local.add_request(f"{i}-{j}", p, sp, stream=False)
                remote.add_request(f"{i}-{j}", p, sp, stream=False)
        want = {o.request_id: o for o in drain(local)}
        got = {o.request_id: o for o in drain(remote)}
        assert sorted(got) == sorted(want) and len(want) == 9
        for rid, out in want.items():
            same(got[rid], out)
            assert out.outputs[0].text
        long = SamplingParams(max_tokens=300, ignore_eos=True)
        remote.add_request("a", "Tell me a long story.", long)
        while not (snap := remote.snapshot("a")) or len(snap.outputs[0].token_ids) < 8:
            remote.step()
        partial = remote.abort("a")
        assert partial is not None and partial.outputs[0].finish_reason == "abort"
        assert partial.outputs[0].text
        assert remote._text is not None and len(remote._text) == 0  # nothing left behind
    finally:
        remote.close()


def drain(eng: Engine | EngineProcess) -> list[RequestOutput]:
    done = []
    while eng.has_unfinished():
        done += [o for o in eng.step() if o.finished]
    return done
