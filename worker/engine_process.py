"""``pagedserve worker`` (``--engine-process``, the default): the engine steps in a child process
of its own, the service loop (claims, admission, Redis writes, heartbeats) runs in the worker's
process; ``--no-engine-process`` keeps the engine in the loop's process.

Why: with the engine in the loop's process, every piece of the service's Python work (the
loop's own, and the writer's and claimer's threads) holds the one interpreter lock that the
engine's steps need between their kernels. At fast steps (a small model on a CPU; any model on a
GPU) that cost ``bench.service --preset tiny`` 8-10% of the offline engine's throughput: 3.4% the
loop's own work, ~2% waits for the lock mid-step, 2-4% slower steps (the same steps' CPU time)
and a few steps more. In a process of its own the engine steps back to back, as offline, while
the service works beside it on the other core; what crosses is one message per step.

What :class:`EngineProcess` gives the loop is the part of :class:`worker.engine.Engine` the loop
uses, answered from what the child last reported, never by a round trip:

- ``add_request`` and ``abort`` are queued and sent before the next ``step``; a request the
  engine refuses comes back as a finished output whose ``error`` starts with ``rejected:`` (the
  loop fails the job with it, as it fails one refused in-process); ``abort`` returns the last
  output the child sent for the request (a cancelled job's partial result).
- ``step`` sends what was queued and returns the outputs of every step the child ran since the
  last call (waiting up to :data:`STEP_WAIT_S` for one). Outputs cross as increments
  (:mod:`worker.output_delta`: the prompt once, then what each completion gained) and are
  rebuilt here into the engine's cumulative outputs.
- ``snapshot`` returns the request's last output received and asks for a new one, which comes
  with the next report: progress is one flush interval behind, the first token and the final
  output are not (they come with the step that made them).
- ``free_capacity``, ``num_waiting``: the child's last report, corrected for the requests added
  since; ``heartbeat_stats`` and ``unstarted`` ask the child and wait for its next report.
- Text and chat prompts are tokenized here (the pretokenize pool), with the model's tokenizer,
  and the outputs' text is rendered here from their token ids where the engine does not need it
  (:mod:`worker.output_text`: no stop strings, no grammar), off the child's stepping thread.

Prefix-aware admission probes the child's pool through :class:`PoolView`: answers a step or so
old. Structured-output constraints compile in the child, on its stepping thread.

If the child dies, :meth:`EngineProcess.step` raises :class:`EngineDied` and the worker exits
with an error: its leases lapse and other workers reclaim the jobs. The child ignores SIGINT and
SIGTERM (the worker drains and then stops it) and exits when the worker's end of the pipe closes.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import pickle
import select
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedserve.params import SamplingParams
from pagedserve.telemetry import EngineTelemetry
from worker.model_source import resolve_model
from worker.output_delta import DeltaEncoder, OutputDelta, merge
from worker.output_text import OutputText, text_read_later
from worker.outputs import (
    CompletionOutput,
    EngineConfig,
    RequestOutput,
    RequestRejected,
    refusal,
)
from worker.tokenizing import (
    class_path,
    has_tokenizer,
    load_tokenizer_as,
    prepare_tokenizer_import,
    tokenize,
)

if TYPE_CHECKING:  # (the worker's process never imports the engine: torch)
    from worker.engine import Engine

#: How long ``step`` waits for the child's next report.
STEP_WAIT_S = 0.05
#: The longest a stepping child goes without a report (:func:`_news`).
REPORT_GAP_S = 0.01
#: How long ``heartbeat_stats`` and ``unstarted`` wait for the child's answer (a step or so).
STATS_WAIT_S = 0.5
#: How long the child may take to load the model.
START_TIMEOUT_S = 600.0
#: Large enough that ``admission_capacity(BIG)`` never hits its zero floor.
_BIG = 1 << 30


class EngineDied(RuntimeError):
    """The engine's child process ended, or could not start."""


#: Answers about cached prefix blocks kept here before they are all dropped (and asked again).
MAX_KNOWN_BLOCKS = 16_384


@dataclass
class PoolView:
    """The child's KV pool as prefix admission (:mod:`worker.admission`) probes it from here.

    ``lookup`` answers from what the child last said about that block (None until it said
    anything) and asks it again with the next orders, so an answer is at most a step or so old;
    except a block the child said is cached, while it has evicted nothing since: a cached block
    leaves the cache only by an eviction (it may move to another block, which admission does not
    count by). Why: every admission round probes its groups again, and prompts that share
    nothing make a group each: ``bench.service --preset tiny --rounds 1`` sent 14,947 lookups
    to the child over its worker's life (a 96-job warm-up, a 384-job round), 7,347 with this.
    ``evictions`` is a version of this view rather than the pool's eviction count: it moves
    when the child evicted a prefix and whenever an answer changed, which is what admission
    uses it for (a group counted at the current value needs no new count)."""

    num_blocks: int
    block_size: int
    evictions: int = 0
    known: dict[Any, int | None] = field(default_factory=dict)
    asked: dict[Any, tuple[int, ...]] = field(default_factory=dict)
    child_evictions: int = 0
    #: The child's eviction count when each block it said is cached was said so.
    cached_at: dict[Any, int] = field(default_factory=dict)

    def lookup(self, block_hash: Any, tokens: Any) -> int | None:
        self._ask(block_hash, tokens)
        return self.known.get(block_hash)

    def prefetch(self, blocks: Sequence[tuple[Any, Any]]) -> None:
        """Ask about a whole chain of blocks at once. Why: a count stops at the first block not
        known cached, so asking only the blocks it reached learned one block more per round
        trip (a heartbeat each): a 4-block prefix took 4 heartbeats to be shown whole."""
        for h, tokens in blocks:
            self._ask(h, tokens)

    def _ask(self, block_hash: Any, tokens: Any) -> None:
        if self.cached_at.get(block_hash) != self.child_evictions:
            self.asked[block_hash] = tuple(tokens)

    def take(self, evictions: int, answers: dict[Any, int | None]) -> None:
        """The child's eviction count and answers, from one report."""
        changed = evictions != self.child_evictions
        self.child_evictions = evictions
        if len(self.known) + len(answers) > MAX_KNOWN_BLOCKS:
            self.known.clear()
            self.cached_at.clear()
            changed = True
        for h, block in answers.items():
            changed |= self.known.get(h, -1) != block
            self.known[h] = block
            if block is None:
                self.cached_at.pop(h, None)
            else:
                self.cached_at[h] = evictions
        self.evictions += changed


@dataclass
class SchedulerView:
    pool: PoolView


@dataclass
class Report:
    """What the child sends after each step, or after orders that came while it was idle."""

    outputs: list[OutputDelta] = field(default_factory=list)  # the step's (worker.output_delta)
    snapshots: list[OutputDelta] = field(default_factory=list)  # asked for, made before the step
    orders_done: int = 0  # order batches applied so far
    capacity: int = 0  # admission_capacity(n) - n for a large n: the seats and blocks left
    waiting: int = 0
    unstarted: list[str] | None = None  # with the stats: when asked, and when idle
    evictions: int = 0  # the pool's count of evicted prefix blocks
    lookups: dict[Any, int | None] = field(default_factory=dict)  # asked-for prefix blocks
    stats: EngineTelemetry | None = None


@dataclass
class Ready:
    """The child's first message: the engine is loaded."""

    model_name: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    tokenizer_class: str | None = None  # worker.tokenizing.class_path of the engine's


class Inbox:
    """Whether one end of the pipe has something to read, waiting up to ``wait_s``.

    Why not ``Connection.poll``: it builds, registers and closes a selector on every call
    (``multiprocessing.connection.wait``): 27 us a call in the child right after a step (median,
    a throwaway timer, ``bench.service --preset tiny`` on a 2-vCPU Xeon, steps of 1-10 ms).
    One ``poll`` object registered once answers in a few. A closed other end reads as ready
    (the ``recv`` that follows raises ``EOFError``), as with ``Connection.poll``."""

    def __init__(self, conn: Any) -> None:
        self._poller = select.poll()
        self._poller.register(conn.fileno(), select.POLLIN)

    def ready(self, wait_s: float = 0.0) -> bool:
        return bool(self._poller.poll(max(0.0, wait_s) * 1e3))


def send_report(conn: Any, rep: Report) -> None:
    """A report as plain pickle bytes. Why not ``Connection.send``: its pickler is built per
    message with a copy of the registry of reducers (sockets, descriptors, tensors), which
    reports never hold; right after a step (cold caches) it took the child 52 us a report
    against 30 for plain ``pickle`` (medians, the same timer as :class:`Inbox`)."""
    conn.send_bytes(pickle.dumps(rep, protocol=pickle.HIGHEST_PROTOCOL))


# ------------------------------------------------------------------------------- the child
@dataclass(frozen=True, slots=True)
class LogSetup:
    """The worker's logging, repeated in the child (a spawned process starts with none: the
    engine's own lines, the weight mode or the attention backend it chose, were lost)."""

    level: int
    format: str | None

    @staticmethod
    def of_this_process() -> LogSetup:
        root = logging.getLogger()
        fmt = next((h.formatter._fmt for h in root.handlers if h.formatter), None)
        return LogSetup(root.getEffectiveLevel(), fmt)

    def apply(self) -> None:
        logging.basicConfig(level=self.level, format=self.format, stream=sys.stderr)


def _serve(conn: Any, model: str, cfg: EngineConfig, logs: LogSetup) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logs.apply()
    try:
        from worker.engine import Engine  # (torch: imported in the child only)

        eng = Engine(model, cfg)
    except BaseException as e:
        conn.send(EngineDied(f"the engine did not load: {type(e).__name__}: {e}"))
        return
    pool = eng.scheduler.pool
    conn.send(Ready(eng.model_name, eng.max_model_len, eng.vocab_size, pool.num_blocks,
                    pool.block_size, class_path(eng.tokenizer)))  # fmt: skip
    done, stats_wanted, enc, inbox = 0, False, DeltaEncoder(), Inbox(conn)
    last, sent_at = None, 0.0  # the last report sent, and when
    while True:
        rep = Report()
        if not eng.has_unfinished() or inbox.ready():
            try:
                batches = [conn.recv()]
                while inbox.ready():
                    batches.append(conn.recv())
            except (EOFError, OSError):  # the worker is gone
                return
            for orders in batches:
                if orders is None:  # stop
                    return
                stats_wanted |= _apply(eng, orders, rep, enc)
                done += 1
        if eng.has_unfinished():
            rep.outputs += map(enc.encode, eng.step())
        rep.orders_done = done
        rep.capacity = eng.free_capacity(_BIG) - _BIG
        rep.waiting = eng.num_waiting()
        rep.evictions = eng.scheduler.pool.evictions
        if stats_wanted or not eng.has_unfinished():  # (idle: the last word for a while)
            stats_wanted = False
            rep.stats = eng.heartbeat_stats()
            rep.unstarted = eng.unstarted()
        now = time.monotonic()
        if now - sent_at < REPORT_GAP_S and not _news(rep, last):
            continue
        try:
            send_report(conn, rep)
        except (BrokenPipeError, OSError):
            return
        last, sent_at = rep, now


def _news(rep: Report, last: Report | None) -> bool:
    """Whether a report tells the loop something its last one did not: outputs, answers,
    orders applied, a change in what it claims by (waiting requests, evictions), or more room.

    Why not a report at every step: each is a pickle and a write that wakes the loop's thread
    on the other core (on a KVM guest 40-100 us of the child's time), and at ``bench.service
    --preset tiny`` 41% of the steps had nothing to tell (no request started or ended, no
    orders came). What those steps change is the room left as running requests grow, which the
    loop reads only to size its next claim: a claim sized by the last room leaves a job or so
    waiting in the engine. A quiet child still reports every :data:`REPORT_GAP_S`: the loop
    waits for reports, and takes its claims' and tokenizers' results between them."""
    if last is None or rep.outputs or rep.snapshots or rep.lookups or rep.stats is not None:
        return True
    return (
        rep.orders_done != last.orders_done
        or rep.waiting != last.waiting
        or rep.evictions != last.evictions
        or rep.capacity > last.capacity
        or last.capacity > 0 >= rep.capacity  # no room left: the loop stops claiming
    )


def _apply(eng: Engine, orders: list[tuple[Any, ...]], rep: Report, enc: DeltaEncoder) -> bool:
    """Carry out one batch of orders; True if it asks for the stats."""
    stats = False
    for op, *args in orders:
        if op == "add":
            rid, prompt, params, priority, messages, render_text = args
            try:
                eng.add_request(rid, prompt, params, priority=priority, messages=messages,
                                stream=False, render_text=render_text)  # fmt: skip
            except Exception as e:  # worded as the loop words an in-process refusal
                rep.outputs.append(enc.encode(_refused(rid, refusal(e))))
        elif op == "abort":
            eng.abort(args[0])
            enc.forget(args[0])
        elif op == "snapshot":
            for rid in args[0]:
                snap = eng.snapshot(rid)
                if snap is not None:
                    rep.snapshots.append(enc.encode(snap))
        elif op == "stats":
            stats = True
        elif op == "lookup":
            pool = eng.scheduler.pool
            for h, tokens in args[0]:
                rep.lookups[h] = pool.lookup(h, tokens)
    return stats


def _stale(prev: RequestOutput | None, delta: OutputDelta) -> bool:
    """An increment of an earlier request of the same id (aborted here, then added again while
    the child's reports about the first one were on their way): it builds on an output this
    request never had. A new request's first output carries its prompt."""
    return prev is None and delta[1] is None


def _refused(rid: str, reason: str) -> RequestOutput:
    return RequestOutput(rid, [], [CompletionOutput(0, finish_reason="abort")], finished=True,
                         error=reason)  # fmt: skip


# ------------------------------------------------------------------------------- the loop's side
class EngineProcess:
    """The engine in a child process, seen from the service loop (see the module docstring)."""

    def __init__(self, model: str | Path, cfg: EngineConfig) -> None:
        """Start the child on the resolved checkpoint (a GGUF file converted once, here), and
        import the tokenizers' module while it loads the model; then load the tokenizer as the
        class the child's ``AutoTokenizer`` chose (:func:`worker.tokenizing.load_tokenizer_as`:
        no torch in this process; SmolLM2's in 0.15 s, 121 MB peak, against 3.4 s and 470 MB
        through ``AutoTokenizer``). Why in that order: the worker imported neither torch nor
        ``transformers`` yet, so the child starts at once and the imports overlap its load."""
        try:
            model_dir = resolve_model(model)
        except Exception as e:
            raise EngineDied(f"the engine did not load: {type(e).__name__}: {e}") from e
        ctx = mp.get_context("spawn")  # no fork of a process holding threads
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_serve,
            args=(child, str(model_dir), cfg, LogSetup.of_this_process()),
            name="pagedserve-engine",
            daemon=True,
        )
        self.proc.start()
        child.close()
        try:
            if has_tokenizer(model_dir):
                prepare_tokenizer_import()
            ready = self._first_message()
            self.tokenizer = load_tokenizer_as(model_dir, ready.tokenizer_class)
        except BaseException:
            self.proc.kill()
            raise
        #: The outputs whose text is rendered here (None: the model has no tokenizer, no text).
        self._text = OutputText(self.tokenizer) if self.tokenizer is not None else None
        self._inbox = Inbox(self.conn)
        self.config = cfg
        self.model_name = ready.model_name
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.scheduler = SchedulerView(PoolView(ready.num_blocks, ready.block_size))
        self._orders: list[tuple[Any, ...]] = []
        self._sent = 0  # order batches sent
        self._live: dict[str, RequestOutput | None] = {}  # added, not finished: last output
        self._wanted: set[str] = set()
        self._report = Report(capacity=cfg.max_num_seqs)
        self._queued_adds = 0  # requests added and not sent yet
        self._sent_adds: deque[tuple[int, int]] = deque()  # (batch number, adds): not yet applied
        self._stats = EngineTelemetry()
        self._unstarted: list[str] = []
        self._outputs: list[RequestOutput] = []  # received, for the next step()
        self._stats_asked = False

    def tokenize(
        self, prompt: str | list[int] | None, messages: list[dict] | None
    ) -> tuple[str | None, list[int]]:
        """Text and chat prompts are tokenized here, as the engine does."""
        return tokenize(self.tokenizer, self.vocab_size, prompt, messages)

    def _first_message(self) -> Ready:
        if not self.conn.poll(START_TIMEOUT_S):
            self.proc.kill()
            raise EngineDied(f"the engine did not load in {START_TIMEOUT_S:.0f} s")
        try:
            got = self.conn.recv()
        except EOFError:
            raise EngineDied(f"the engine process exited ({self.proc.exitcode})") from None
        if isinstance(got, EngineDied):
            raise got
        return got

    # ----------------------------------------------------------------- requests
    def prepare(self, params: Any) -> None:
        """Constraints compile in the child (when the request joins it)."""

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None = None,
        params: Any = None,
        priority: str | int = "interactive",
        messages: list[dict] | None = None,
        stream: bool = False,
    ) -> None:
        if request_id in self._live:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        here = self._text is not None and text_read_later(params or SamplingParams())
        self._orders.append(("add", request_id, prompt, params, priority, messages, not here))
        if here:
            self._text.expect(request_id)  # type: ignore[union-attr]
        self._live[request_id] = None
        self._queued_adds += 1

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request; its last output received (unfinished completions as "abort")."""
        if request_id not in self._live:
            return None
        self._orders.append(("abort", request_id))
        out = self._live.pop(request_id)
        if self._text is not None:
            self._text.forget(request_id)
        self._send_orders()  # now: with nothing left here, no step() would send it
        if out is not None:
            for c in out.outputs:
                c.finish_reason = c.finish_reason or "abort"
        return out

    def snapshot(self, request_id: str) -> RequestOutput | None:
        if request_id not in self._live:
            return None
        self._wanted.add(request_id)
        return self._live[request_id]

    # ----------------------------------------------------------------- state
    def has_unfinished(self) -> bool:
        """Requests running, or outputs received and not yet returned by ``step`` (a request's
        last output may come in while the loop asks for the stats)."""
        return bool(self._live) or bool(self._outputs)

    def _unapplied(self) -> int:
        """Requests added here that the child's last report does not count yet."""
        return self._queued_adds + sum(n for _, n in self._sent_adds)

    def free_capacity(self, lookahead: int = 0) -> int:
        seats = self.config.max_num_seqs + lookahead - len(self._live)
        return max(0, min(seats, self._report.capacity + lookahead - self._unapplied()))

    def num_waiting(self) -> int:
        return self._report.waiting + self._unapplied()

    def unstarted(self) -> list[str]:
        self._fresh_stats()
        return [r for r in self._unstarted if r in self._live]

    def heartbeat_stats(self) -> EngineTelemetry:
        """The child's counters and pool snapshot, asked for now (waiting up to a step for
        them; else the last ones). Built only when asked: at every step they cost the child
        ~1% of its time."""
        self._fresh_stats()
        return self._stats

    def _fresh_stats(self) -> None:
        self._stats_asked = True
        self._orders.append(("stats",))
        self._send_orders()
        deadline = time.monotonic() + STATS_WAIT_S
        while self._stats_asked and (left := deadline - time.monotonic()) > 0:
            self._receive(left)

    # ----------------------------------------------------------------- stepping
    def step(self) -> list[RequestOutput]:
        """Send what was queued; the outputs of the steps the child ran since the last call."""
        self._send_orders()
        if not self._outputs:
            self._receive(STEP_WAIT_S)
        outs, self._outputs = self._outputs, []
        return outs

    def _receive(self, wait_s: float) -> None:
        """Take every report the child sent (waiting up to ``wait_s`` for the first)."""
        try:
            if not self._inbox.ready(wait_s):
                self._check_alive()
                return
            while True:
                self._take(pickle.loads(self.conn.recv_bytes()))  # (send_report)
                if not self._inbox.ready():
                    return
        except (EOFError, OSError) as e:
            raise EngineDied(f"the engine process ended ({self.proc.exitcode})") from e

    def _send_orders(self) -> None:
        if self._wanted:
            self._orders.append(("snapshot", sorted(self._wanted)))
            self._wanted.clear()
        pool = self.scheduler.pool
        if pool.asked:
            self._orders.append(("lookup", list(pool.asked.items())))
            pool.asked = {}
        if not self._orders:
            return
        try:
            self.conn.send(self._orders)
        except (BrokenPipeError, OSError) as e:
            raise EngineDied(f"the engine process ended ({self.proc.exitcode})") from e
        self._orders = []
        self._sent += 1
        if self._queued_adds:
            self._sent_adds.append((self._sent, self._queued_adds))
            self._queued_adds = 0

    def _check_alive(self) -> None:
        if not self.proc.is_alive():
            raise EngineDied(f"the engine process ended ({self.proc.exitcode})")

    def _take(self, rep: Report) -> None:
        """Book one report; its outputs wait in ``_outputs`` for the next ``step``."""
        self._report = rep
        self.scheduler.pool.take(rep.evictions, rep.lookups)
        while self._sent_adds and self._sent_adds[0][0] <= rep.orders_done:
            self._sent_adds.popleft()
        if rep.stats is not None:
            self._stats = rep.stats
            self._stats_asked = False
        if rep.unstarted is not None:
            self._unstarted = rep.unstarted
        live = self._live
        for delta in rep.snapshots:
            if (rid := delta[0]) in live and not _stale(live[rid], delta):
                live[rid] = self._merge(live[rid], delta)
        for delta in rep.outputs:
            if (rid := delta[0]) not in live or _stale(live[rid], delta):  # aborted meanwhile
                continue
            out = self._merge(live[rid], delta)
            if out.finished:
                del live[rid]
            else:
                live[rid] = out
            self._outputs.append(out)

    def _merge(self, prev: RequestOutput | None, delta: OutputDelta) -> RequestOutput:
        """The output ``delta`` encodes, its text rendered here where the child left it out."""
        out = merge(prev, delta)
        if self._text is not None:
            self._text.render(prev, out)
        return out

    def close(self, timeout: float = 10.0) -> None:
        """Stop the child (what it still runs is dropped: the loop handed it back)."""
        with contextlib.suppress(BrokenPipeError, OSError):
            self.conn.send(None)
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(1.0)
        self.conn.close()
