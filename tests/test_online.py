"""The online endpoints (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``) through
the official ``openai`` client against a live stack: a private redis-server, one real worker on
the tiny Llama checkpoint (it has a chat template) and ``pagedserve api`` under gunicorn.

References come from the offline engine (``LLM``) on the same checkpoint, greedy.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from pagedserve.params import SamplingParams
from tests.api_live import HOST
from tests.online_live import Stack, live_stack, stack

openai = pytest.importorskip("openai", reason="pip install openai (a dev dependency)")
__all__ = ["stack"]  # the module-scoped live stack fixture

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture(scope="module")
def llm(stack: Stack) -> Any:
    from worker import LLM

    return LLM(stack.model_dir, block_size=16, num_kv_blocks=256, max_model_len=512)


def greedy(max_tokens: int = 12, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


# ----------------------------------------------------------------------------- models
def test_models_list_and_retrieve(stack: Stack) -> None:
    oa = stack.client()
    models = oa.models.list()
    assert [m.id for m in models.data] == [stack.model]
    m = oa.models.retrieve(stack.model)
    assert m.id == stack.model and m.object == "model" and m.owned_by == "pagedserve"
    assert m.model_extra and m.model_extra["max_model_len"] == 512
    with pytest.raises(openai.NotFoundError) as e:
        oa.models.retrieve("no-such-model")
    assert "no-such-model" in e.value.message and e.value.code == "model_not_found"


# ----------------------------------------------------------------------------- chat
def test_chat_greedy_equals_llm_chat(stack: Stack, llm: Any) -> None:
    want = llm.chat(MESSAGES, greedy())[0].outputs[0]
    resp = stack.client().chat.completions.create(
        model=stack.model, messages=MESSAGES, temperature=0, max_tokens=12
    )
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    (choice,) = resp.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason
    u = resp.usage
    assert u.completion_tokens == len(want.token_ids)
    assert u.prompt_tokens == len(llm.chat(MESSAGES, greedy(1))[0].prompt_token_ids)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_chunks(stack: Stack, llm: Any) -> None:
    want = llm.chat(MESSAGES, greedy())[0].outputs[0]
    chunks = list(
        stack.client().chat.completions.create(
            model=stack.model,
            messages=MESSAGES,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    first, *middle, final, usage = chunks
    assert first.choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in middle) == want.text
    assert all(c.choices[0].finish_reason is None for c in [first, *middle])
    assert final.choices[0].finish_reason == want.finish_reason
    assert usage.choices == [] and usage.usage.completion_tokens == len(want.token_ids)


def test_sse_wire_format_ends_with_done(stack: Stack) -> None:
    body = {"model": stack.model, "messages": MESSAGES, "max_tokens": 4, "stream": True}
    conn = http.client.HTTPConnection(HOST, stack.api.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    data = [x[6:] for x in resp.read().decode().split("\n\n") if x.startswith("data: ")]
    conn.close()
    assert data[-1] == "[DONE]"
    assert json.loads(data[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_chat_n_and_seeded_sampling(stack: Stack) -> None:
    kw = {"model": stack.model, "messages": MESSAGES, "max_tokens": 8, "n": 3, "seed": 7}
    a = stack.client().chat.completions.create(temperature=1.0, **kw)
    b = stack.client().chat.completions.create(temperature=1.0, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


# ----------------------------------------------------------------------------- completions
def test_completions_list_of_prompts(stack: Stack, llm: Any) -> None:
    prompts = ["Once upon a time", "The capital of"]
    want = [o.outputs[0] for o in llm.generate(prompts, greedy(8, ignore_eos=True))]
    resp = stack.client().completions.create(
        model=stack.model, prompt=prompts, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert resp.object == "text_completion"
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [w.text for w in want]
    assert [c.finish_reason for c in resp.choices] == ["length", "length"]
    assert resp.usage.completion_tokens == 16


def test_completions_stream_token_ids(stack: Stack, llm: Any) -> None:
    ids = [5, 17, 42, 99, 100, 7]
    want = llm.generate([ids], greedy(6, ignore_eos=True))[0].outputs[0]
    chunks = list(
        stack.client().completions.create(
            model=stack.model, prompt=ids, max_tokens=6, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_prefix_cache_hits_reported(stack: Stack) -> None:
    prompt = list(range(3, 3 + 70))  # 4 full blocks of 16 tokens
    oa = stack.client()
    kw = {"model": stack.model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    oa.completions.create(**kw)
    again = oa.completions.create(**kw)
    assert again.usage.prompt_tokens == 70
    assert again.usage.prompt_tokens_details.cached_tokens == 64


# ----------------------------------------------------------------------------- async
def test_async_client(stack: Stack, llm: Any) -> None:
    want = llm.chat(MESSAGES, greedy())[0].outputs[0].text

    async def run() -> tuple[str, str]:
        oa = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
        kw = {"model": stack.model, "messages": MESSAGES, "temperature": 0, "max_tokens": 12}
        plain, stream = await asyncio.gather(
            oa.chat.completions.create(**kw), oa.chat.completions.create(stream=True, **kw)
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await oa.close()
        return plain.choices[0].message.content, text

    assert asyncio.run(run()) == (want, want)


# ----------------------------------------------------------------------------- errors
def test_unknown_model_is_404_at_once(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        stack.client().chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert "'gpt-4o'" in e.value.message and stack.model in e.value.message
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


@pytest.mark.parametrize(
    ("extra", "words", "param"),
    [
        ({"temperature": "hot"}, "temperature", "temperature"),
        ({"extra_body": {"frobnicate": 1, "zap": 2}}, "['frobnicate', 'zap']", None),
        ({"top_p": 0}, "top_p", "top_p"),
        ({"response_format": {"type": "xml"}}, "response_format", None),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream_options"),
    ],
)
def test_bad_parameter_is_400(stack: Stack, extra: dict[str, Any], words: str, param: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        stack.client().chat.completions.create(model=stack.model, messages=MESSAGES, **extra)
    assert words in e.value.message and "params." not in e.value.message
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"


def test_over_long_prompt_is_400(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        stack.client().completions.create(model=stack.model, prompt="word " * 20000)
    assert e.value.code == "context_length_exceeded" and "512" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        stack.client().completions.create(model=stack.model, prompt=[1] * 600, max_tokens=4)
    assert "600 tokens" in e.value.message


def test_response_format_text_is_accepted(stack: Stack) -> None:
    resp = stack.client().chat.completions.create(
        model=stack.model, messages=MESSAGES, max_tokens=2, response_format={"type": "text"}
    )
    assert resp.usage.completion_tokens >= 1


def test_response_format_json_schema_is_enforced_online(stack: Stack) -> None:
    schema = {"type": "string", "enum": ["yes", "no"]}
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }
    resp = stack.client().chat.completions.create(
        model=stack.model,
        messages=MESSAGES,
        max_tokens=32,
        response_format=fmt,  # type: ignore[arg-type]
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and json.loads(choice.message.content) in ("yes", "no")


# ----------------------------------------------------------------------------- package shape
def test_public_imports_and_version() -> None:
    import subprocess
    import sys
    from importlib.metadata import version

    code = (
        "import sys\n"
        "from pagedserve import Client, SamplingParams, JobRequest, JobStatus, Batch, JobStore\n"
        "from worker import SamplingParams as S\n"
        "assert S is SamplingParams and Client.__module__ == 'pagedserve.client'\n"
        "print(sorted(m for m in ('torch', 'flask') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"  # the contract loads neither torch nor flask
    cli = [sys.executable, "-m", "stack", "--version"]
    got = subprocess.run(cli, capture_output=True, text=True, check=True).stdout.strip()
    assert got == f"pagedserve {version('pagedserve')}"


def test_real_model_chat_equals_llm_chat(real_model_dir: Path, tmp_path: Path) -> None:
    """SmolLM2-135M-Instruct: the same greedy answer online (streamed and not) and offline."""
    from worker import LLM

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ref: list[str] = []

    def offline() -> None:  # loads while the worker process loads the same model
        ref.append(
            LLM(real_model_dir, max_model_len=512).chat(messages, greedy(24))[0].outputs[0].text
        )

    t = threading.Thread(target=offline)
    t.start()
    with live_stack(tmp_path, real_model_dir, threads=8) as s:
        t.join()
        (want,) = ref
        kw = {"model": s.model, "messages": messages, "temperature": 0, "max_tokens": 24}
        plain = s.client().chat.completions.create(**kw)
        streamed = s.client().chat.completions.create(stream=True, **kw)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert "Paris" in want
    assert plain.choices[0].message.content == want == text


# ----------------------------------------------------------------------------- conversion
def test_body_requests_online_and_batch_share_one_conversion() -> None:
    from pagedserve.openai_input import CHAT_URL, COMPLETIONS_URL, body_requests, parse_line
    from pagedserve.openai_output import batch_line
    from pagedserve.schemas import Completion, JobResult

    parts = [{"type": "text", "text": "hi"}]
    chat = {"model": "m", "messages": [{"role": "user", "content": parts}],
            "max_completion_tokens": 5, "top_k": 3, "priority": 1, "stream": True}  # fmt: skip
    (req,) = body_requests(CHAT_URL, chat, online=True)
    assert req.priority == "bulk" and req.params.max_tokens == 5 and req.params.top_k == 3
    assert req.messages[0].content == "hi"
    assert (
        body_requests(CHAT_URL, {**chat, "priority": -2}, online=True)[0].priority == "interactive"
    )
    with pytest.raises(ValueError, match="'stream' is not supported in a batch"):
        body_requests(CHAT_URL, chat)
    reqs = body_requests(COMPLETIONS_URL, {"model": "m", "prompt": ["a", [1, 2]]}, online=True)
    assert [r.prompt for r in reqs] == ["a", [1, 2]] and reqs[0].priority == "interactive"
    line = json.dumps({"custom_id": "c", "method": "POST", "url": COMPLETIONS_URL,
                       "body": {"model": "m", "prompt": ["a", "b"]}})  # fmt: skip
    with pytest.raises(ValueError, match="one prompt"):
        parse_line(line, 1)
    comp = Completion(index=0, text="x", token_ids=[4], finish_reason="length")
    result = JobResult(completions=[comp], prompt_tokens=40, cached_prompt_tokens=32,
                       completion_tokens=1)  # fmt: skip
    ok, out = batch_line("c", COMPLETIONS_URL, "m", "j1", "succeeded", result)
    usage = json.loads(out)["response"]["body"]["usage"]
    assert ok and usage["prompt_tokens_details"] == {"cached_tokens": 32}
