"""Which grammar engine: xgrammar against llguidance on the real SmolLM2 tokenizer.

For every schema of ``bench.structured_schemas``: cold compile time (a fresh compiler, no cache),
then a seeded random walk through the grammar (each step: fill the row's token bitmask, draw a
uniformly random allowed token, accept it) timing the mask fill per step; and which extra schema
features (``COVERAGE_SCHEMAS``) each engine compiles. Engines alternate per schema, in one process.
Needs both libraries installed (the project keeps only one; ``pip install xgrammar llguidance``).

    python -m bench.grammar_engines [--steps 64] [--walks 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from bench.common import emit
from bench.structured_schemas import COVERAGE_SCHEMAS, SCHEMAS


def _allowed(bitmask: torch.Tensor, vocab: int) -> list[int]:
    bits = (bitmask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return torch.nonzero(bits.flatten()[:vocab]).flatten().tolist()


class Xgr:
    name = "xgrammar"

    def __init__(self, tok: Any, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.vocab = vocab

    def compile(self, schema: dict) -> Any:
        comp = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return comp.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(1, self.vocab)

    def fill(self, m: Any, bm: torch.Tensor) -> None:
        m.fill_next_token_bitmask(bm, 0)

    def accept(self, m: Any, t: int) -> bool:
        return bool(m.accept_token(t))

    def done(self, m: Any) -> bool:
        return bool(m.is_terminated())


class Llg:
    name = "llguidance"

    def __init__(self, tok: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.vocab = vocab

    def compile(self, schema: dict) -> Any:
        opts = {"whitespace_flexible": False}
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=opts)
        err = self.llg.LLMatcher.validate_grammar(grammar, self.tok)
        if err:
            raise ValueError(err)
        return grammar

    def matcher(self, grammar: Any) -> Any:
        return self.llg.LLMatcher(self.tok, grammar, log_level=0)

    def bitmask(self) -> torch.Tensor:
        return self.lt.allocate_token_bitmask(1, self.vocab)

    def fill(self, m: Any, bm: torch.Tensor) -> None:
        self.lt.fill_next_token_bitmask(m, bm, 0)

    def accept(self, m: Any, t: int) -> bool:
        return bool(m.consume_token(t))

    def done(self, m: Any) -> bool:
        return bool(m.is_stopped())


def walk(eng: Any, compiled: Any, rng: random.Random, steps: int, eos: int) -> list[float]:
    """Mask-fill times (s) along one random path; allowed EOS ends the walk half the time."""
    m, bm, times = eng.matcher(compiled), eng.bitmask(), []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.fill(m, bm)
        times.append(time.perf_counter() - t0)
        allowed = _allowed(bm, eng.vocab)
        if eos in allowed and (len(allowed) == 1 or rng.random() < 0.5):
            break
        tok = rng.choice([t for t in allowed if t != eos])
        if not eng.accept(m, tok) or eng.done(m):
            break
    return times


def measure(engines: list[Any], steps: int, walks: int, eos: int) -> dict[str, Any]:
    per: dict[str, dict[str, list[float]]] = {e.name: {"compile": [], "mask": []} for e in engines}
    for i, schema in enumerate(SCHEMAS):
        for eng in engines:  # alternating per schema
            t0 = time.perf_counter()
            compiled = eng.compile(schema)
            per[eng.name]["compile"].append(time.perf_counter() - t0)
            for w in range(walks):
                per[eng.name]["mask"] += walk(eng, compiled, random.Random(i * 100 + w), steps, eos)
    out: dict[str, Any] = {}
    for name, d in per.items():
        out[name] = {
            "compile_ms_mean": round(1e3 * statistics.mean(d["compile"]), 2),
            "compile_ms_max": round(1e3 * max(d["compile"]), 2),
            "mask_us_median": round(1e6 * statistics.median(d["mask"]), 1),
            "mask_us_mean": round(1e6 * statistics.mean(d["mask"]), 1),
            "mask_us_p99": round(1e6 * sorted(d["mask"])[int(0.99 * len(d["mask"]))], 1),
            "mask_steps": len(d["mask"]),
        }
    return out


def coverage(engines: list[Any]) -> dict[str, dict[str, str]]:
    res: dict[str, dict[str, str]] = {}
    for key, schema in COVERAGE_SCHEMAS.items():
        res[key] = {}
        for eng in engines:
            try:
                eng.compile(schema)
                res[key][eng.name] = "ok"
            except Exception as exc:
                res[key][eng.name] = f"error: {str(exc)[:100]}"
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--walks", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from worker.gguf import cached_hf_dir
    from worker.model_source import default_model_path, model_cache_dir

    model_dir = cached_hf_dir(default_model_path(), model_cache_dir())
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    t0 = time.perf_counter()
    engines: list[Any] = [Xgr(tok, vocab)]
    t1 = time.perf_counter()
    engines.append(Llg(tok, vocab))
    t2 = time.perf_counter()
    figures = measure(engines, args.steps, args.walks, tok.eos_token_id)
    figures["xgrammar"]["tokenizer_setup_s"] = round(t1 - t0, 2)
    figures["llguidance"]["tokenizer_setup_s"] = round(t2 - t1, 2)
    emit(
        "grammar_engines",
        {"tokenizer": "SmolLM2-135M-Instruct", "vocab": vocab, "schemas": len(SCHEMAS),
         **figures, "coverage": coverage(engines)},
    )  # fmt: skip


if __name__ == "__main__":
    main()
