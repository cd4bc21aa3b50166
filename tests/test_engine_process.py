"""``pagedserve worker --engine-process``: the engine stepping in a child process, seen from the
service loop through :class:`worker.engine_process.EngineProcess` (and end to end with Redis in
tests/test_service.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import time
from pathlib import Path

import pytest

from pagedserve.client import Client
from pagedserve.params import SamplingParams
from pagedserve.schemas import JobStatus
from tests.fixtures.workers import StartWorker, children, wait_for
from worker.engine import Engine
from worker.engine_process import EngineDied, EngineProcess, Inbox, PoolView, Report, send_report
from worker.outputs import EngineConfig, RequestOutput
from worker.service_config import ServiceConfig

CFG = EngineConfig(num_kv_blocks=256, max_model_len=512, num_threads=1)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture
def model_dir(make_tiny_model) -> Path:  # type: ignore[no-untyped-def]
    return make_tiny_model("llama")


@pytest.fixture
def remote(model_dir: Path):  # type: ignore[no-untyped-def]
    eng = EngineProcess(model_dir, CFG)
    try:
        yield eng
    finally:
        eng.close()


def run_all(eng: Engine | EngineProcess) -> dict[str, RequestOutput]:
    done: dict[str, RequestOutput] = {}
    deadline = time.monotonic() + 60
    while eng.has_unfinished() and time.monotonic() < deadline:
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_the_pipes_inbox_and_reports() -> None:
    """The child's and the loop's check for something to read: nothing, then a report (plain
    pickle bytes, read back whole), then the other end closed, which reads as ready and then
    ends the reads (how the child notices that its worker is gone)."""
    a, b = mp.Pipe()
    inbox = Inbox(a)
    assert not inbox.ready() and not inbox.ready(0.01)
    rep = Report(capacity=7, waiting=2, lookups={("h", 1): 3, ("h", 2): None})
    send_report(b, rep)
    assert inbox.ready(1.0)
    assert pickle.loads(a.recv_bytes()) == rep
    b.close()
    assert inbox.ready(1.0)
    with pytest.raises(EOFError):
        a.recv_bytes()


def test_outputs_equal_the_in_process_engine(model_dir: Path, remote: EngineProcess) -> None:
    prompts: list[str | list[int]] = ["The quick brown fox", [5, 17, 99, 200, 3], "def main():"]
    local = Engine(model_dir, CFG)
    for i, p in enumerate(prompts):
        local.add_request(str(i), p, GREEDY, stream=False)
        remote.add_request(str(i), p, GREEDY, stream=False)
    assert remote.free_capacity() <= CFG.max_num_seqs - len(prompts)
    want, got = run_all(local), run_all(remote)
    assert sorted(got) == sorted(want) == ["0", "1", "2"]
    for rid, out in want.items():
        assert got[rid].outputs[0].token_ids == out.outputs[0].token_ids
        assert got[rid].outputs[0].text == out.outputs[0].text
        assert got[rid].prompt_token_ids == out.prompt_token_ids and got[rid].error is None
    assert not remote.has_unfinished()
    stats = wait_for(lambda: (s := remote.heartbeat_stats()).steps > 0 and s, what="stats")
    assert stats.tokens_generated == 30 and stats.pool is not None


def test_steps_with_nothing_to_tell_send_no_report(
    remote: EngineProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request alone for 60 steps (~1 ms each): reports come with its orders applied, its
    first token, its end and the idle stats, and otherwise every ``REPORT_GAP_S`` (10 ms), not
    at each step (61 reports before); what the loop reads from them is current at the end."""
    reports: list[Report] = []
    take = remote._take
    monkeypatch.setattr(remote, "_take", lambda rep: (reports.append(rep), take(rep)))
    remote.add_request("a", [4, 5, 6], SamplingParams(max_tokens=60, ignore_eos=True))
    done = run_all(remote)
    assert len(done["a"].outputs[0].token_ids) == 60
    stats = remote.heartbeat_stats()
    assert stats.tokens_generated == 60 and stats.running == 0
    assert 2 <= len(reports) < 40, [(len(r.outputs), r.orders_done) for r in reports]
    assert remote.free_capacity() == CFG.max_num_seqs and remote.num_waiting() == 0


def test_refused_request_comes_back_as_an_error(remote: EngineProcess) -> None:
    remote.add_request("long", [1] * 600, GREEDY)  # longer than max_model_len 512
    remote.add_request("ok", [1, 2, 3], GREEDY)
    done = run_all(remote)
    assert done["long"].finished and done["long"].error is not None
    assert done["long"].error.startswith("rejected: prompt of 600 tokens exceeds")
    assert done["ok"].error is None and len(done["ok"].outputs[0].token_ids) == 10


def test_abort_returns_the_last_output_and_frees_the_request(remote: EngineProcess) -> None:
    remote.add_request("a", [4, 5, 6], SamplingParams(max_tokens=400, ignore_eos=True))
    wait_for(lambda: remote.step() or remote.snapshot("a"), what="a first output")
    wait_for(lambda: (remote.step(), s := remote.snapshot("a"))[1] and s.outputs[0].token_ids,
             what="a snapshot with tokens")  # fmt: skip
    partial = remote.abort("a")
    assert partial is not None and partial.outputs[0].finish_reason == "abort"
    assert 0 < len(partial.outputs[0].token_ids) < 400
    assert not remote.has_unfinished() and remote.abort("a") is None
    # The child dropped it: its pool has nothing in use once it reports again.
    wait_for(lambda: (s := remote.heartbeat_stats()).running == 0 and s.pool is not None
             and s.pool.in_use == 0, what="the pool empty")  # fmt: skip


def test_outputs_received_while_asking_for_stats_reach_step(remote: EngineProcess) -> None:
    remote.add_request("a", [4, 5, 6], GREEDY)
    remote.step()  # sent
    wait_for(lambda: remote.heartbeat_stats().tokens_generated == 10, what="the request done")
    assert remote.has_unfinished()  # its last output is still to be returned
    outs = remote.step()
    assert [o.request_id for o in outs if o.finished] == ["a"] and not remote.has_unfinished()


def test_prefix_admission_sees_the_childs_cached_blocks(remote: EngineProcess) -> None:
    from worker.admission import _probe_of

    prompt = list(range(10, 60))  # three full blocks of 16 (the last token's block is not probed)
    remote.add_request("a", prompt, GREEDY)
    assert "a" in run_all(remote)
    pool = remote.scheduler.pool
    probe = _probe_of(prompt, pool.block_size)
    assert len(probe) == 3
    version = pool.evictions
    assert all(pool.lookup(h, toks) is None for h, toks in probe)  # not asked yet: unknown
    remote.heartbeat_stats()  # the questions go with the orders; the answers come back
    blocks = [pool.lookup(h, toks) for h, toks in probe]
    assert all(isinstance(b, int) for b in blocks) and len(set(blocks)) == 3
    assert pool.evictions > version  # the view changed: admission counts the groups again
    other = _probe_of(list(range(500, 550)), pool.block_size)
    pool.lookup(*other[0])
    remote.heartbeat_stats()
    assert pool.lookup(*other[0]) is None  # a prefix the pool never held


def test_the_pool_view_asks_again_about_a_cached_block_only_after_an_eviction() -> None:
    """A block the child said is cached stays so until the child evicts something (it may move
    to another block, not out of the cache); one it said is not cached may be any time."""
    view = PoolView(num_blocks=64, block_size=16)
    a, b = ("a", (1,) * 16), ("b", (2,) * 16)
    assert view.lookup(*a) is None and view.lookup(*b) is None
    assert sorted(view.asked) == ["a", "b"]
    view.asked = {}  # (sent with the next orders)
    view.take(3, {"a": 7, "b": None})
    assert view.lookup(*a) == 7 and view.lookup(*b) is None
    view.prefetch([a, b])
    assert list(view.asked) == ["b"]  # a: cached, nothing evicted since
    view.asked = {}
    view.take(4, {"b": 9})  # the child evicted a block meanwhile
    assert view.lookup(*a) == 7 and view.lookup(*b) == 9
    assert list(view.asked) == ["a"]  # b was said cached at the new count
    view.asked = {}
    view.take(4, {"a": None})
    assert view.lookup(*a) is None and list(view.asked) == ["a"]


def test_admission_learns_a_whole_prefix_in_one_round_trip(remote: EngineProcess) -> None:
    """A count of a group's cached blocks asks about every block of its prefix at once (it
    used to learn one block more per heartbeat: the count stops at the first unknown)."""
    from worker.admission import Group, PrefixAdmission, _probe_of

    prompt = list(range(100, 180))  # four full blocks probed
    remote.add_request("p", prompt, GREEDY)
    assert "p" in run_all(remote)
    pool = remote.scheduler.pool
    adm = PrefixAdmission(ServiceConfig(worker_id="w"), remote, {})
    g = Group(sig="s", probe=_probe_of(prompt, pool.block_size))
    assert len(g.probe) == 4
    assert adm._cached_blocks(g) == 0  # nothing known yet: all four asked
    remote.heartbeat_stats()
    assert adm._cached_blocks(g) == 4


def test_a_dead_child_is_an_error(remote: EngineProcess) -> None:
    remote.add_request("a", [4, 5, 6], SamplingParams(max_tokens=400, ignore_eos=True))
    remote.step()
    os.kill(remote.proc.pid, signal.SIGKILL)
    with pytest.raises(EngineDied):
        for _ in range(200):
            remote.step()


def test_a_model_that_does_not_load_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(EngineDied, match="did not load"):
        EngineProcess(tmp_path / "no-such-model", CFG)


def engine_child(pid: int) -> int:
    """The worker's engine process (multiprocessing also starts a resource tracker)."""
    kids = children(pid)
    engine = [k for k in kids if b"pipe_handle" in Path(f"/proc/{k}/cmdline").read_bytes()]
    assert len(engine) == 1, kids
    return engine[0]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_worker_exits_with_an_error_when_its_engine_dies(
    redis_url: str, model_dir: Path, start_worker: StartWorker
) -> None:
    w = start_worker(redis_url, model_dir, "w1", "--engine-process")
    client = Client(redis_url)
    done = client.submit([1, 2, 3], GREEDY.model_dump())
    assert client.wait(done, timeout=60).status == JobStatus.SUCCEEDED
    os.kill(engine_child(w.proc.pid), signal.SIGKILL)
    assert w.wait(timeout=30) == 1
    assert "engine process ended" in w.log()


def test_drain_stops_the_child(redis_url: str, model_dir: Path, start_worker: StartWorker) -> None:
    w = start_worker(redis_url, model_dir, "w1", "--engine-process")
    client = Client(redis_url)
    jid = client.submit("a prompt", {"max_tokens": 6, "temperature": 0})
    assert client.wait(jid, timeout=60).status == JobStatus.SUCCEEDED
    child = engine_child(w.proc.pid)
    w.terminate()
    assert w.wait(timeout=30) == 0
    wait_for(lambda: not alive(child), what="the engine's process to end")


def test_the_child_ends_with_a_killed_worker(
    redis_url: str, model_dir: Path, start_worker: StartWorker
) -> None:
    w = start_worker(redis_url, model_dir, "w1", "--engine-process")
    child = engine_child(w.proc.pid)
    w.kill()  # SIGKILL: no drain, no close; the child sees its pipe closed
    wait_for(lambda: not alive(child), timeout=20, what="the orphaned engine process to end")


def test_a_worker_keeps_its_cache_in_bfloat16_when_told(
    redis_url: str, model_dir: Path, start_worker: StartWorker
) -> None:
    """``pagedserve worker --kv-cache-dtype bfloat16`` (here with the engine in a process of its
    own): jobs answer token for token as the in-process engine does with the same cache, and the
    heartbeat says what the pool holds."""
    from api.state import parse_heartbeats
    from pagedserve.store import JobStore

    start_worker(redis_url, model_dir, "w1", "--engine-process", "--kv-cache-dtype", "bfloat16")
    client = Client(redis_url)
    jid = client.submit([5, 17, 99, 200, 3], GREEDY.model_dump())
    rec = client.wait(jid, timeout=60)
    assert rec.status == JobStatus.SUCCEEDED and rec.result is not None
    local = Engine(model_dir, EngineConfig(num_kv_blocks=256, kv_cache_dtype="bfloat16"))
    local.add_request("a", [5, 17, 99, 200, 3], GREEDY, stream=False)
    want = run_all(local)["a"].outputs[0].token_ids
    assert rec.result.completions[0].token_ids == want
    pools = [hb.pool for hb in parse_heartbeats(JobStore(redis_url).workers()).values()]
    assert [p.kv_cache_dtype if p else None for p in pools] == ["bfloat16"]


@pytest.mark.parametrize("which", ["llama", "qwen2", "mistral", "smollm2"])
def test_the_workers_tokenizer_is_the_class_autotokenizer_chose(
    which: str, make_tiny_model, request: pytest.FixtureRequest
) -> None:
    """The worker's process loads its tokenizer as the class the engine's ``AutoTokenizer``
    chose (``load_tokenizer_as``): the same class, the same ids, chat renderings and special
    tokens, for the tiny checkpoints' tokenizers and the real SmolLM2's. Class paths outside
    transformers are refused."""
    from worker.tokenizing import class_path, load_tokenizer, load_tokenizer_as, tokenize

    model_dir = request.getfixturevalue("real_model_dir") if which == "smollm2" else (
        make_tiny_model(which)
    )  # fmt: skip
    auto = load_tokenizer(model_dir)
    path = class_path(auto)
    assert path is not None
    direct = load_tokenizer_as(model_dir, path)
    assert type(direct) is type(auto)
    assert direct.all_special_ids == auto.all_special_ids
    assert direct.eos_token_id == auto.eos_token_id and len(direct) == len(auto)
    vocab = len(auto)
    for text in ["The quick brown fox", "Grüß dich, 日本語 — ça va? ✓\n  x = 42", ""]:
        assert tokenize(direct, vocab, text, None) == tokenize(auto, vocab, text, None)
    if auto.chat_template is not None:
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓"}]
        assert tokenize(direct, vocab, None, chat) == tokenize(auto, vocab, None, chat)
    for bad in ["os:system", "pickle:loads", "transformers.x:not-a-name"]:
        with pytest.raises(ValueError, match="not a tokenizer class"):
            load_tokenizer_as(model_dir, bad)


def test_the_workers_process_never_imports_torch(real_model_dir: Path) -> None:
    """With the engine in its own process, the worker's process (claims, tokenizing, writes)
    never imports torch: its tokenizer is loaded without ``AutoTokenizer`` (whose module pulls
    torch in through transformers' configuration code: ~350 MB and 3 s more), and renders its
    outputs' text there (:mod:`worker.output_text`) without it either."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from worker.engine_process import EngineProcess\n"
        "from worker.outputs import EngineConfig\n"
        f"e = EngineProcess(Path({str(real_model_dir)!r}), EngineConfig(num_kv_blocks=64,"
        " max_model_len=256, num_threads=1))\n"
        "from pagedserve.params import SamplingParams\n"
        "text, ids = e.tokenize(None, [{'role': 'user', 'content': 'Hi'}])\n"
        "e.add_request('a', ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))\n"
        "out = None\n"
        "while e.has_unfinished():\n"
        "    out = ([o for o in e.step() if o.finished] or [out])[0]\n"
        "e.close()\n"
        "print('torch' in sys.modules, 'transformers.models.auto' in sys.modules, len(ids) > 3,"
        " bool(out.outputs[0].text))\n"
    )
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parent.parent, timeout=300)  # fmt: skip
    assert out.stdout.split() == ["False", "False", "True", "True"], out.stderr[-2000:]
