"""Structured outputs in the engine (tiny random model with its trained tokenizer): every output
parses and validates against its constraint with an independent checker (``jsonschema``,
``re.fullmatch``), and constraining some rows of a batch changes nothing for the others."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from bench.structured_schemas import SCHEMAS
from pagedserve.params import SamplingParams, StructuredOutputs
from worker import LLM
from worker.outputs import RequestOutput
from worker.structured import mask_rows


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, num_kv_blocks=256, block_size=16)


def constrained(so: dict, seed: int | None = None, **kw: object) -> SamplingParams:
    opts: dict = {"temperature": 1.0, "max_tokens": 256, **kw}
    if seed is not None:
        opts["seed"] = seed
    return SamplingParams(structured_outputs=so, **opts)  # type: ignore[arg-type]


def texts(outs: list[RequestOutput]) -> list[str]:
    return [c.text for o in outs for c in o.outputs]


def assert_valid_json(out: RequestOutput, schema: dict) -> None:
    for c in out.outputs:
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        jsonschema.validate(json.loads(c.text), schema)


def test_200_generations_over_10_schemas_validate(llm: LLM) -> None:
    params = [constrained({"json": SCHEMAS[i % 10]}, seed=i) for i in range(200)]
    compiled_before = llm.engine.structured.stats.compiles
    outs = llm.generate([f"Record {i}:" for i in range(200)], params, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.error is None
        assert_valid_json(out, SCHEMAS[i % 10])
    # Seeded sampling, not one fixed string per schema.
    for k in range(10):
        assert len({texts([outs[i]])[0] for i in range(k, 200, 10)}) > 1
    assert llm.engine.structured.stats.compiles - compiled_before <= 10  # each schema once


def test_json_object_any(llm: LLM) -> None:
    outs = llm.generate(["obj"] * 8, [constrained({"json": True}, seed=s) for s in range(8)])
    done = [c.text for o in outs for c in o.outputs if c.finish_reason == "stop"]
    assert len(done) >= 4  # free-form keys and strings: a random model may run out of tokens
    assert all(isinstance(json.loads(t), dict) for t in done)


REGEXES = [
    r"[a-z]{3,8}@example\.(com|org)",
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
    r"(yes|no|maybe) [A-Z]+!",
]


@pytest.mark.parametrize("regex", REGEXES)
def test_regex_outputs_fullmatch(llm: LLM, regex: str) -> None:
    outs = llm.generate(["x"] * 10, [constrained({"regex": regex}, seed=s) for s in range(10)])
    for t in texts(outs):
        assert re.fullmatch(regex, t), t


def test_choice_outputs_are_choices(llm: LLM) -> None:
    choices = ["positive", "negative", "neutral", 'quote " and \\ back']
    outs = llm.generate(["x"] * 20, [constrained({"choice": choices}, seed=s) for s in range(20)])
    got = texts(outs)
    assert all(t in choices for t in got), got
    assert len(set(got)) > 1


def test_grammar_lark_and_gbnf(llm: LLM) -> None:
    lark = 'start: "id-" DIGIT DIGIT DIGIT\nDIGIT: /[0-9]/'
    gbnf = 'root ::= "id-" [0-9] [0-9] [0-9]'
    for g in (lark, gbnf):
        outs = llm.generate(["x"] * 4, [constrained({"grammar": g}, seed=s) for s in range(4)])
        assert all(re.fullmatch(r"id-\d{3}", t) for t in texts(outs)), texts(outs)


def test_unconstrained_rows_unchanged_by_constrained_neighbours(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = [f"plain prompt number {i}" for i in range(6)]
    alone = llm.generate(prompts, greedy)
    mixed_prompts, mixed_params = [], []
    for i, p in enumerate(prompts):
        mixed_prompts += [p, f"constrained {i}"]
        mixed_params += [greedy, constrained({"json": SCHEMAS[i]}, seed=i)]
    mixed = llm.generate(mixed_prompts, mixed_params)
    for i, out in enumerate(alone):
        assert mixed[2 * i].outputs[0].token_ids == out.outputs[0].token_ids
        assert_valid_json(mixed[2 * i + 1], SCHEMAS[i])


def test_constrained_greedy_is_batch_independent(llm: LLM) -> None:
    p = SamplingParams(temperature=0.0, max_tokens=128, structured_outputs={"json": SCHEMAS[9]})
    alone = llm.generate(["invoice"], p)[0].outputs[0].token_ids
    batch = llm.generate(["invoice", "other", "more"], [p, p, SamplingParams(max_tokens=20)])
    assert batch[0].outputs[0].token_ids == alone


def test_n_completions_each_follow_the_grammar(llm: LLM) -> None:
    p = constrained({"json": SCHEMAS[3]}, seed=7, n=6)
    out = llm.generate(["tags"], p)[0]
    assert len(out.outputs) == 6
    assert_valid_json(out, SCHEMAS[3])
    assert len({c.text for c in out.outputs}) > 1


def test_preemption_by_recompute_keeps_outputs_valid_and_equal(tiny_model_dir: Path) -> None:
    params = [constrained({"json": SCHEMAS[i]}, seed=i) for i in range(6)]
    prompts = [f"record {i} " * 6 for i in range(6)]
    roomy = LLM(tiny_model_dir, num_kv_blocks=256, block_size=8).generate(prompts, params)
    tight = LLM(tiny_model_dir, num_kv_blocks=12, block_size=8, enable_prefix_caching=False)
    outs = tight.generate(prompts, params)
    assert tight.engine.stats().preemptions > 0
    for i, (a, b) in enumerate(zip(roomy, outs, strict=True)):
        assert_valid_json(b, SCHEMAS[i])
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_length_finish_is_not_valid(llm: LLM) -> None:
    out = llm.generate(["x"], constrained({"json": SCHEMAS[4]}, seed=1, max_tokens=5))[0]
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.text)


def test_grammar_end_stops_even_with_ignore_eos(llm: LLM) -> None:
    out = llm.generate(["x"], constrained({"choice": ["alpha", "beta"]}, seed=3, ignore_eos=True))
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.text in ("alpha", "beta")


def test_stop_string_cuts_constrained_text(llm: LLM) -> None:
    p = constrained({"regex": r"ab(cd)+"}, seed=0, stop=["cd"], max_tokens=64)
    c = llm.generate(["x"], p)[0].outputs[0]
    assert c.finish_reason == "stop" and c.text == "ab"


def test_logprobs_stay_those_of_the_model(llm: LLM) -> None:
    base = {"temperature": 0.0, "max_tokens": 4, "logprobs": 0}
    free = llm.generate(["x"], SamplingParams(**base))[0].outputs[0]  # type: ignore[arg-type]
    p = SamplingParams(**base, structured_outputs={"choice": ["zz"]})  # type: ignore[arg-type]
    forced = llm.generate(["x"], p)[0].outputs[0]
    assert forced.text == "zz"
    # The forced first token is rarely the model's favourite: its raw logprob is below the top.
    assert forced.logprobs[0].logprob <= free.logprobs[0].logprob + 1e-6  # type: ignore[index]


def test_one_compile_per_distinct_constraint(tiny_model_dir: Path) -> None:
    llm = LLM(tiny_model_dir, num_kv_blocks=128)
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "boolean"}}}
    same = {"properties": {"a": {"type": "boolean"}, "b": {"type": "integer"}}, "type": "object"}
    params = [
        constrained({"json": schema if i % 2 else same}, seed=i, max_tokens=8) for i in range(30)
    ]
    llm.generate(["x"] * 30, params)
    st = llm.engine.structured.stats
    assert st.compiles == 1 and st.cache_hits >= 29


def test_cache_is_bounded(tiny_model_dir: Path) -> None:
    llm = LLM(tiny_model_dir, num_kv_blocks=64, grammar_cache_bytes=1)
    llm.generate(["x"] * 3, [constrained({"regex": f"a{{{k}}}"}) for k in (1, 2, 3)])
    assert llm.engine.structured.backend().cached() == 1


def test_no_mask_work_without_constraints(tiny_model_dir: Path) -> None:
    llm = LLM(tiny_model_dir, num_kv_blocks=64)
    llm.generate(["a", "b"], SamplingParams(max_tokens=8))
    st = llm.engine.structured.stats
    assert st.mask_steps == 0 and llm.engine.structured._backend is None


def test_mask_rows_matches_a_dense_reference() -> None:
    torch.manual_seed(0)
    for vocab, dtype in ((100, torch.float32), (64, torch.float32), (77, torch.bfloat16)):
        words = (vocab + 31) // 32
        bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32)
        logits = torch.randn(3, vocab).to(dtype)
        allowed = torch.tensor(
            [[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)] for r in range(3)]
        ).bool()
        want = logits.masked_fill(~allowed, float("-inf"))
        got = logits.clone()
        mask_rows(got, bitmask)
        assert torch.equal(got, want)


# --------------------------------------------------------------------- invalid constraints
@pytest.mark.parametrize(
    ("so", "message"),
    [
        ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum (5) is greater"),
        ({"json": {"type": "foo"}}, "Invalid type: foo"),
        ({"json": {"if": {"type": "integer"}, "then": {}}}, 'Unimplemented keys: ["if"'),
        ({"regex": "[a-"}, "unclosed character class"),
        ({"grammar": "start: nothing_here"}, 'unknown name: "nothing_here"'),
        ({"regex": "a", "choice": ["b"]}, "exactly one of json, regex, choice, grammar"),
        ({"choice": []}, "at least 1 item"),
        ({"json": False}, "give a schema object"),
    ],
)
def test_invalid_constraint_refused_with_backend_message(so: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(structured_outputs=so)  # type: ignore[arg-type]


def test_engine_refuses_constraint_without_tokenizer(tmp_path: Path, tiny_model_dir: Path) -> None:
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors", "generation_config.json"):
        if (tiny_model_dir / f).exists():
            shutil.copy(tiny_model_dir / f, bare / f)
    out = LLM(bare, num_kv_blocks=16).generate([[5, 6, 7]], constrained({"regex": "a+"}))[0]
    assert out.error is not None and "no tokenizer" in out.error


def test_constraint_key_is_canonical() -> None:
    a = StructuredOutputs(json={"b": 1, "a": {"y": 2, "x": 1}})
    b = StructuredOutputs.model_validate_json('{"json": {"a": {"x": 1, "y": 2}, "b": 1}}')
    assert a.key() == b.key()
    assert StructuredOutputs(json='{"type": "integer"}').json_ == {"type": "integer"}
    p = SamplingParams(structured_outputs={"choice": ["a"]})  # type: ignore[arg-type]
    assert SamplingParams.model_validate_json(p.model_dump_json()) == p


def test_grammar_completed_by_the_last_allowed_token_is_stop(llm: LLM) -> None:
    so = {"choice": ["alphabet soup", "beta"]}
    free = llm.generate(["x"], constrained(so, seed=5))[0].outputs[0]
    k = len(free.token_ids)  # the grammar ends with its text: no EOS step is spent
    exact = llm.generate(["x"], constrained(so, seed=5, max_tokens=k))[0].outputs[0]
    assert (exact.finish_reason, exact.text) == ("stop", free.text)
    assert exact.token_ids == free.token_ids
