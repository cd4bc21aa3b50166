"""The iteration-level scheduler: every step, one token budget over running and waiting sequences.

Running sequences are served first, in priority order (interactive before bulk, then arrival);
waiting sequences are admitted afterwards while the budget, ``max_num_seqs`` and free blocks allow.
A prompt longer than the remaining budget is prefilled in chunks over several steps. When a running
sequence cannot get a block, the lowest-priority, most recently arrived running sequence is
preempted by recompute: it loses its blocks (their prefixes stay in the cache) and waits at the
front of its queue with every token it generated.

What a block table does per step (prefix lookup, growth with copy-on-write, slots, registration)
lives in :mod:`scheduler.kv_cache_manager`. Callers such as the engine use only the facade:
``schedule`` / ``postprocess``, ``take_finished`` (sequences schedule() ended itself),
``get_sequence``, ``admission_capacity``, ``occupancy`` (a typed ``PoolOccupancy``) and
``prefix_cache_stats``; the queues, maps and pool stay the scheduler's own.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from dataclasses import replace

from scheduler.block_pool import BlockPool, PoolOccupancy, PrefixCacheStats
from scheduler.config import SchedulerConfig, SchedulerStats, SequenceRejected
from scheduler.kv_cache_manager import KVCacheManager, ceil_div
from scheduler.output import SchedulerOutput, TokenUpdate
from scheduler.sequence import (
    FinishReason,
    Priority,
    Sequence,
    SequenceStatus,
    StopConditions,
)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, windows=config.kv_windows)
        self.running: list[Sequence] = []  # sorted by Sequence.sort_key
        self.waiting: dict[int, deque[Sequence]] = {}
        self.seqs: dict[int, Sequence] = {}
        self.requests: dict[str, list[int]] = {}
        self.stats = SchedulerStats()
        self._watermark_blocks = int(config.watermark * config.num_blocks)
        self._next_seq_id = 0
        self._arrivals = 0
        self._released: list[int] = []
        self._preempted: list[int] = []
        # Sequences schedule() itself had to end (one that outgrew the whole pool), until
        # take_finished() hands them over.
        self._finished: list[Sequence] = []

    # ---------------------------------------------------------------- requests
    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def get_sequence(self, seq_id: int) -> Sequence | None:
        """The live (waiting or running) sequence ``seq_id``; None once it finished."""
        return self.seqs.get(seq_id)

    def take_finished(self) -> list[Sequence]:
        """The sequences schedule() ended itself since the last call (they outgrew the pool).

        Sequences finished by postprocess, ``finish`` or ``abort`` are reported there instead.
        """
        finished, self._finished = self._finished, []
        return finished

    def admission_capacity(self, lookahead: int = 0) -> int:
        """How many more sequences to admit now without overcommitting the KV pool.

        A sequence is counted as needing as many blocks as the running ones hold on average (at
        least one); sequences already waiting count against the seats. ``lookahead``: that many
        more may wait beyond the seats and blocks (a worker's local queue, admitted the step a
        seat frees instead of a claim round trip later).
        """
        seats = self.config.max_num_seqs + lookahead - self.num_running - self.num_waiting
        if seats <= 0:
            return 0
        free = self.pool.num_free
        used = self.pool.num_blocks - free
        per_seq = max(1, used // self.num_running) if self.num_running else 1
        return max(0, min(seats, free // per_seq + lookahead - self.num_waiting))

    def unstarted(self) -> list[str]:
        """Request ids of the waiting sequences never scheduled (nothing computed, never
        preempted), in queue order: what a draining worker hands back untouched."""
        return [
            seq.request_id
            for prio in sorted(self.waiting)
            for seq in self.waiting[prio]
            if seq.num_computed == 0 and seq.num_preemptions == 0
        ]

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """A copy of the prefix cache's cumulative lookup counters."""
        return replace(self.pool.stats)

    def add_sequence(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        stop: StopConditions,
        priority: int = Priority.INTERACTIVE,
        cache_salt: str | None = None,
        max_model_len: int = 1 << 30,
    ) -> Sequence:
        """Queue a new sequence; raises SequenceRejected for one that could never run."""
        n = len(prompt_token_ids)
        if n == 0:
            raise SequenceRejected("the prompt is empty")
        if n >= max_model_len:
            raise SequenceRejected(
                f"prompt of {n} tokens leaves no room to generate within the model's context "
                f"length of {max_model_len} tokens"
            )
        capacity = self.pool.num_blocks * self.block_size
        if ceil_div(n + 1, self.block_size) > self.pool.num_blocks:
            raise SequenceRejected(
                f"prompt of {n} tokens can never fit in the KV cache, which holds {capacity} tokens"
            )
        if request_id in self.requests:
            raise SequenceRejected(f"request id {request_id!r} is already in use")
        seq = Sequence(
            seq_id=self._new_seq_id(),
            request_id=request_id,
            token_ids=list(prompt_token_ids),
            prompt_len=n,
            stop=stop,
            priority=int(priority),
            arrival=self._arrivals,
            cache_salt=cache_salt,
            max_model_len=max_model_len,
        )
        self._arrivals += 1
        self.seqs[seq.seq_id] = seq
        self.requests[request_id] = [seq.seq_id]
        self.waiting.setdefault(seq.priority, deque()).append(seq)
        return seq

    def fork(self, seq_id: int) -> Sequence:
        """A child sharing every block of a running sequence, including its partial last block.

        The first write into a shared partial block is redirected by copy-on-write.
        """
        parent = self.seqs[seq_id]
        if parent.status is not SequenceStatus.RUNNING:
            raise ValueError("only running sequences can be forked")
        child = Sequence(
            seq_id=self._new_seq_id(),
            request_id=parent.request_id,
            token_ids=list(parent.token_ids),
            prompt_len=parent.prompt_len,
            stop=parent.stop,
            priority=parent.priority,
            arrival=parent.arrival,
            cache_salt=parent.cache_salt,
            max_model_len=parent.max_model_len,
            status=SequenceStatus.RUNNING,
            num_computed=parent.num_computed,
            num_cached_tokens=parent.num_cached_tokens,
            block_table=list(parent.block_table),
            block_hashes=list(parent.block_hashes),
            num_registered=parent.num_registered,
            admitted_once=True,
        )
        for block in child.block_table:
            self.pool.acquire(block)
        self.seqs[child.seq_id] = child
        self.requests[parent.request_id].append(child.seq_id)
        bisect.insort(self.running, child, key=lambda s: s.sort_key)
        return child

    def abort(self, request_id: str) -> list[Sequence]:
        """Stop every sequence of a request, in any state; their blocks are freed at once."""
        ids = self.requests.get(request_id, [])
        aborted = []
        for seq_id in list(ids):
            seq = self.seqs.get(seq_id)
            if seq is not None:
                self.finish(seq, FinishReason.ABORT)
                aborted.append(seq)
        return aborted

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence (stop string found, abort, ...) and free its blocks now."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._released.append(seq.seq_id)
        else:
            self.waiting[seq.priority].remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.seqs[seq.seq_id]
        ids = self.requests[seq.request_id]
        ids.remove(seq.seq_id)
        if not ids:
            del self.requests[seq.request_id]

    # --------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(released_seq_ids=self._released)
        self._released = []
        self.pool.new_step()
        budget = self.config.max_num_batched_tokens
        self._preempt_for_priority(budget)
        preempted = self._schedule_running(out, budget)
        budget -= out.num_batched_tokens
        if not preempted:
            self._admit_waiting(out, budget)
        out.preempted_seq_ids = self._preempted
        self._preempted = []
        self.stats.num_steps += 1
        self.stats.num_batched_tokens_total += out.num_batched_tokens
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> bool:
        running = self.running
        scheduled = out.scheduled
        kv = self.kv
        emit = kv.emit
        refs = self.pool.ref_counts
        mask = self.block_size - 1
        shift = self.block_size.bit_length() - 1
        start_budget = budget
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            start = seq.num_computed
            n = len(seq.token_ids) - start
            if (
                n == 1
                and start & mask
                and (start + 1) & mask
                and refs[seq.block_table[start >> shift]] == 1
            ):
                # Hot path: one decode token landing inside an unshared, allocated block without
                # completing it, so there is no block to grow, copy or register.
                scheduled.append(emit(seq, 1))
                budget -= 1
                i += 1
                continue
            if n > budget:
                n = budget
            if n <= 0:  # its last token is still waiting for postprocess
                i += 1
                continue
            grew = kv.grow(seq, n, out.block_copies)
            if not grew:
                preempted = True
                grew = self._preempt_until_grown(seq, n, out.block_copies)
            if grew:
                scheduled.append(emit(seq, n))
                budget -= n
                i += 1
            # otherwise seq itself left the running list; the next one now sits at index i
        out.num_batched_tokens += start_budget - budget
        return preempted

    def _preempt_until_grown(self, seq: Sequence, n: int, copies: list[tuple[int, int]]) -> bool:
        """Preempt from the back until ``seq`` can grow by ``n`` tokens; False if seq left."""
        running = self.running
        while True:
            if len(running) == 1:
                # Alone and still out of blocks: the pool cannot hold this sequence at all.
                self.finish(seq, FinishReason.LENGTH)
                self._finished.append(seq)
                return False
            victim = running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
            if self.kv.grow(seq, n, copies):
                return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        pool = self.pool
        bs = self.block_size
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self._peek_waiting()
            if seq is None:
                break
            hits = self.kv.prefix_hits(seq)
            n_cached = len(hits) * bs
            n = min(seq.num_tokens - n_cached, budget)
            new_blocks = ceil_div(n_cached + n, bs) - len(hits)
            hits_free = sum(1 for b in hits if pool.ref_counts[b] == 0)
            if pool.num_free - hits_free - new_blocks < self._watermark_blocks and self.running:
                break
            if pool.num_free - hits_free < new_blocks:
                if not self.running and ceil_div(seq.num_tokens, bs) > pool.num_blocks:
                    # Its tokens (prompt plus what it generated before a preemption) outgrew
                    # the whole pool: it can never run again.
                    self.finish(seq, FinishReason.LENGTH)
                    self._finished.append(seq)
                    continue
                break
            self.waiting[seq.priority].popleft()
            self.kv.admit(seq, hits, new_blocks, out.block_copies)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            out.scheduled.append(self.kv.emit(seq, n))
            out.num_batched_tokens += n
            budget -= n

    def _preempt_for_priority(self, budget: int) -> None:
        """Make room for a waiting sequence that outranks the lowest-priority running one."""
        while self.running:
            head = self._peek_waiting()
            victim = self.running[-1]
            if head is None or head.priority >= victim.priority:
                return
            first_chunk = min(head.num_tokens, budget)
            needed = ceil_div(first_chunk, self.block_size) + self._watermark_blocks
            seats = len(self.running) < self.config.max_num_seqs
            if seats and self.pool.num_free >= needed:
                return
            self._preempt(victim)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed = 0
        seq.num_registered = 0
        seq.synced_blocks = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.setdefault(seq.priority, deque()).appendleft(seq)
        self._preempted.append(seq.seq_id)
        self.stats.num_preemptions += 1

    def _peek_waiting(self) -> Sequence | None:
        for prio in sorted(self.waiting):
            q = self.waiting[prio]
            if q:
                return q[0]
        return None

    # ------------------------------------------------------------ postprocess
    def postprocess(self, sampled: Iterable[tuple[int, int]]) -> list[TokenUpdate]:
        """Append each (seq_id, token) sampled this step, apply stop conditions, free finishers."""
        updates: list[TokenUpdate] = []
        seqs = self.seqs
        for seq_id, token in sampled:
            seq = seqs.get(seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted between schedule and postprocess
            tokens = seq.token_ids
            tokens.append(token)
            stop = seq.stop
            reason = None
            if (
                len(tokens) - seq.prompt_len >= stop.max_tokens
                or len(tokens) >= seq.max_model_len
                or token in stop.stop_token_ids
                or token in stop.eos_token_ids
            ):
                reason = seq.check_stop(token)
                if reason is not None:
                    self.finish(seq, reason)
            updates.append(TokenUpdate(seq, token, reason))
        return updates

    # -------------------------------------------------------------- snapshots
    def occupancy(self, with_tables: bool = False) -> PoolOccupancy:
        """A typed snapshot of the pool; ``with_tables`` adds every running block table."""
        return self.kv.occupancy(self.running, with_tables)

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1
