"""The job store's shared core: loading the Lua scripts and running script calls in one round
trip (EVALSHA, reloaded on NOSCRIPT), and adding batch lines of jobs that ended outside a
worker's final write.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from importlib import resources
from typing import Any

import hiredis
import redis
from redis.commands.core import Script

from pagedserve.jobstore.records import TRANSIENT_REPLY_ERRORS, ClaimStats, Entry, Lease, LineAdd
from pagedserve.keys import GROUP, PRIORITIES, Keys
from pagedserve.tenants import TenantBook

log = logging.getLogger("pagedserve.store")

_SCRIPTS = (
    "enqueue",
    "lease",
    "renew",
    "finish",
    "progress",
    "release",
    "cancel",
    "pop_cancels",
    "batch_line",
    "batch_count",
    "admission",
    "affinity",
    "reclaim",
    "heartbeat",
)

#: One script call: (script name, KEYS, ARGV).
Call = tuple[str, Sequence[str], Sequence[Any]]


def _load_lua(name: str) -> str:
    base = resources.files("pagedserve") / "lua"
    common = (base / "_common.lua").read_text()
    return common + "\n" + (base / f"{name}.lua").read_text()


def _pack(conn: Any, commands: Sequence[Sequence[Any]]) -> list[bytes]:
    """The commands in RESP, packed by hiredis in C (arguments are str, bytes, int or float;
    the bytes are those redis-py's encoder makes), or by the connection for any other argument
    (redis-py's checks and its error for, say, a bool)."""
    try:
        return [b"".join(hiredis.pack_command(tuple(c)) for c in commands)]
    except TypeError:
        return conn.pack_commands(commands)  # type: ignore[no-any-return]


def _roundtrip(conn: Any, commands: Sequence[Sequence[Any]]) -> list[Any]:
    """Send the commands as one pipeline on ``conn`` and read every reply; an error reply is
    returned in its place (the other commands ran). A connection that fails mid-way is
    disconnected (what it had sent may have run)."""
    try:
        conn.send_packed_command(_pack(conn, commands))
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(conn.read_response())
            except redis.ResponseError as e:
                replies.append(e)
        return replies
    except BaseException:
        conn.disconnect()
        raise


class StoreBase:
    """What every part of :class:`~pagedserve.store.JobStore` shares: the connection, key names,
    settings, and running script calls (set up by ``JobStore.__init__``)."""

    r: redis.Redis
    keys: Keys
    #: Whether ``r`` is a Redis Cluster client: every script call then touches one slot, and the
    #: steps that span slots (a batch's line when its job ends) run apart (see ``add_batch_lines``).
    cluster: bool
    retention_s: int
    lease_ms: int
    max_deliveries: int
    events_maxlen: int
    stats: ClaimStats
    tenants: TenantBook
    malformed: list[tuple[Lease, str]]
    _scripts: dict[str, Script]
    _groups_ready: bool
    _pending_cursor: dict[tuple[str, str], str | None]
    _stash: dict[str, list[Entry]]
    _reclaim_cursor: dict[str, str]
    _block_turn: int

    def ensure_groups(self) -> None:
        """Create the priority streams and their consumer group (idempotent)."""
        if self._groups_ready:
            return
        if self.cluster:
            self.check_shards()
        for stream in self.all_streams():
            try:
                self.r.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
        self._groups_ready = True

    def check_shards(self) -> None:
        """Raise ``ValueError`` when this cluster's deployment was started with another shard
        count (jobs of the shards a process does not know would never run)."""
        key, n = self.keys.shard_count, self.keys.shards
        self.r.set(key, n, nx=True)
        got = int(self.r.get(key) or n)
        if got != n:
            raise ValueError(
                f"this Redis Cluster's deployment (prefix {self.keys.prefix!r}) uses {got} "
                f"shards; this process was given {n} (PAGEDSERVE_SHARDS must be the same in "
                "every process)"
            )

    def all_streams(self, priorities: Sequence[str] = PRIORITIES) -> list[str]:
        """Every shard's stream of each priority, priority-major (interactive first)."""
        return [self.keys.stream(p, k) for p in priorities for k in range(self.keys.shards)]

    def script(self, name: str) -> Script:
        return self._scripts[name]

    def load_scripts(self) -> None:
        """SCRIPT LOAD every script (after a server restart flushed the script cache), in one
        MULTI so that no other client sees the cache half loaded (on a cluster, SCRIPT LOAD goes
        to every master, one script after another)."""
        if self.cluster:
            for sc in self._scripts.values():
                self.r.script_load(sc.script)
            return
        pipe = self.r.pipeline(transaction=True)
        for sc in self._scripts.values():
            pipe.script_load(sc.script)
        pipe.execute()

    def _exec(
        self, calls: Sequence[Call], *, raise_errors: bool = True, transaction: bool = False
    ) -> list[Any]:
        """Run script calls as EVALSHA in one pipeline (MULTI/EXEC with ``transaction``): one
        round trip.

        A call that got NOSCRIPT (an empty or half-loaded script cache after a Redis restart or
        a SCRIPT FLUSH) did nothing, while the other calls of the pipeline ran: after loading the
        scripts, only the calls that got NOSCRIPT are sent again, so no call runs twice. With
        ``raise_errors=False`` a call's error is returned in its place (the others still count),
        except transient ones (:data:`TRANSIENT_REPLY_ERRORS`), which are raised.
        """
        replies = self._send(calls, transaction) if calls else []
        missing = [
            i for i, x in enumerate(replies) if isinstance(x, redis.exceptions.NoScriptError)
        ]
        if missing:
            self.load_scripts()
            for i, x in zip(
                missing, self._send([calls[i] for i in missing], transaction), strict=True
            ):
                replies[i] = x
        for x in replies:
            if isinstance(x, Exception) and (raise_errors or isinstance(x, TRANSIENT_REPLY_ERRORS)):
                raise x
        return replies

    def _send(self, calls: Sequence[Call], transaction: bool) -> list[Any]:
        if transaction and self.cluster:
            return self._send_per_slot(calls)
        return self._pipe(calls, transaction)

    def _pipe(self, calls: Sequence[Call], transaction: bool) -> list[Any]:
        if not transaction and not self.cluster:
            return self._pipe_direct(calls)
        pipe = self.r.pipeline(transaction=transaction)
        for name, keys, args in calls:
            # execute_command: a cluster pipeline blocks its evalsha method, not the command
            # (routed by its first key).
            pipe.execute_command("EVALSHA", self._scripts[name].sha, len(keys), *keys, *args)
        return list(pipe.execute(raise_on_error=False))

    def _pipe_direct(self, calls: Sequence[Call]) -> list[Any]:
        """The calls as one pipeline written straight to a pooled connection, each reply read
        as it comes (an error reply in its place), retried as the client's ``Retry`` says (as
        ``Redis.pipeline`` does). Why not ``Redis.pipeline``: its per-command bookkeeping
        (command stack, argument encoding in Python, response callbacks, instrumentation) ran
        on the worker's writer and claimer threads, holding the interpreter lock that the
        engine's steps wait on at fast steps (``bench.service --preset tiny``)."""
        commands = [
            ("EVALSHA", self._scripts[name].sha, len(keys), *keys, *args)
            for name, keys, args in calls
        ]
        pool = self.r.connection_pool
        conn = pool.get_connection()
        try:
            return conn.retry.call_with_retry(  # type: ignore[no-any-return]
                lambda: _roundtrip(conn, commands), lambda _: conn.disconnect()
            )
        finally:
            pool.release(conn)

    def _send_per_slot(self, calls: Sequence[Call]) -> list[Any]:
        """Cluster: a MULTI/EXEC spans one slot, so the calls run as one transaction per slot
        (a job's calls, e.g. its enqueue and its tenant tag, share its shard's slot)."""
        by_slot: dict[int, list[int]] = {}
        for i, (_, keys, _) in enumerate(calls):
            by_slot.setdefault(self.r.keyslot(keys[0]), []).append(i)  # type: ignore[attr-defined]
        replies: list[Any] = [None] * len(calls)
        for idx in by_slot.values():
            part = [calls[i] for i in idx]
            one = self._pipe(part, len(idx) > 1)
            for i, x in zip(idx, one, strict=True):
                replies[i] = x
        return replies

    def add_batch_lines(self, adds: Sequence[LineAdd]) -> int:
        """Add batch lines of jobs that ended without their worker's final write (one round
        trip); each is added only for a member of its batch, once. Returns how many were (an
        error of one batch is logged, not raised)."""
        calls = [self._batch_line_call(a) for a in adds]
        added = 0
        for a, reply in zip(adds, self._exec(calls, raise_errors=False), strict=True):
            if isinstance(reply, Exception):
                # A broken batch (a key of the wrong type) must not fail the cancel, claim or
                # release that ended the job; the batch's own finalisation reports it.
                log.warning(
                    "batch %s: line of job %s not added: %s", a.ref.batch_id, a.job_id, reply
                )
            else:
                added += int(reply)
        return added

    def _batch_line_call(self, a: LineAdd) -> Call:
        """``batch_line.lua`` (the job's status and batch fields checked in the same step), or
        on a cluster ``batch_count.lua``, which touches the batch's slot only: the caller read
        the job's end and its batch ref from the job record first (a second, idempotent step)."""
        bid = a.ref.batch_id
        keys = [
            self.keys.batch(bid),
            self.keys.batch_members(bid),
            self.keys.batch_counted(bid),
            self.keys.batch_output(bid) if a.ok else self.keys.batch_errors(bid),
        ]
        field_ = "completed" if a.ok else "failed"
        if self.cluster:
            return ("batch_count", keys, [a.job_id, a.line, field_])
        flags = ["1" if a.allow_missing else "0", "1" if a.allow_running else "0"]
        return (
            "batch_line",
            [self.keys.job(a.job_id), *keys],
            [a.job_id, bid, a.line, field_, *flags],
        )
