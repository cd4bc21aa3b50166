"""Offline generation with the API vLLM users know: ``LLM(model_dir).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedserve.params import SamplingParams
from worker.engine import Engine
from worker.outputs import RequestOutput

Prompt = str | list[int] | dict[str, Any]


class LLM:
    """Runs prompts to completion through the continuous-batching engine.

    ``engine_options`` are EngineConfig fields: block_size, num_kv_blocks or kv_cache_memory,
    max_num_seqs, max_num_batched_tokens, max_model_len, dtype, device, enable_prefix_caching.
    """

    def __init__(self, model: str | Path, **engine_options: Any) -> None:
        self.engine = Engine(model, **engine_options)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        priority: str = "interactive",
    ) -> list[RequestOutput]:
        """One output per prompt, in prompt order. A prompt that cannot be served gets an
        output with ``error`` set and no completions; the others run normally."""
        batch = self._as_list(prompts)
        plist = self._params_list(params, len(batch))
        ids = []
        results: dict[str, RequestOutput] = {}
        for prompt, p in zip(batch, plist, strict=True):
            rid = f"gen-{next(self._ids)}"
            ids.append(rid)
            try:
                if isinstance(prompt, dict):
                    self.engine.add_request(
                        rid, prompt.get("prompt_token_ids", prompt.get("prompt")), p, priority,
                        messages=prompt.get("messages"), stream=False,
                    )  # fmt: skip
                else:  # only the final outputs are read: no per-step outputs
                    self.engine.add_request(rid, prompt, p, priority, stream=False)
            except ValueError as exc:
                results[rid] = RequestOutput(rid, [], [], finished=True, error=str(exc))
        show = use_tqdm if use_tqdm is not None else len(batch) >= 32
        bar = None
        if show:
            from tqdm import tqdm

            bar = tqdm(total=len(batch), desc="generate", unit="req", initial=len(results))
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Replies to one conversation or a list of them, via the tokenizer's chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([{"messages": c} for c in convs], params, use_tqdm)  # type: ignore[misc]

    @staticmethod
    def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str | dict):
            return [prompts]
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
            return [prompts]  # one prompt given as token ids
        return list(prompts)  # type: ignore[arg-type]

    @staticmethod
    def _params_list(
        params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        return list(params)
