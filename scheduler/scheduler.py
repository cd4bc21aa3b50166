"""The iteration-level scheduler: every step, one token budget over running and waiting sequences.

Running sequences are served first, in priority order (interactive before bulk, then arrival);
waiting sequences are admitted afterwards while the budget, ``max_num_seqs`` and free blocks allow.
A prompt longer than the remaining budget is prefilled in chunks over several steps. When a running
sequence cannot get a block, the lowest-priority, most recently arrived running sequence is
preempted by recompute: it loses its blocks (their prefixes stay in the cache) and waits at the
front of its queue with every token it generated.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from scheduler.block_pool import BlockPool, PoolOccupancy
from scheduler.output import ScheduledSequence, SchedulerOutput
from scheduler.sequence import (
    FinishReason,
    Priority,
    Sequence,
    SequenceStatus,
    StopConditions,
)


class SequenceRejected(ValueError):
    """A request that can never run (e.g. its prompt cannot fit in the whole pool)."""


@dataclass(slots=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    # Blocks kept free when admitting new work, so running sequences can grow without
    # immediately preempting each other.
    watermark: float = 0.01

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


@dataclass(slots=True)
class TokenUpdate:
    """What postprocess did with one sampled token."""

    seq: Sequence
    token_id: int
    finish_reason: FinishReason | None


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    num_steps: int = 0
    num_batched_tokens_total: int = 0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(config.num_blocks, config.block_size, config.enable_prefix_caching)
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
        # Sequences schedule() itself had to end (one that outgrew the whole pool); the engine
        # drains this list after each step to report them.
        self.finished_in_schedule: list[Sequence] = []

    # ---------------------------------------------------------------- requests
    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

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
        if _ceil_div(n + 1, self.block_size) > self.pool.num_blocks:
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
        self.pool.release_table(seq.block_table)
        seq.block_table = []
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
            if n == 1 and start & mask and (start + 1) & mask:
                # Hot path: one decode token landing inside an unshared, already allocated block,
                # not completing it (so no allocation, copy or cache registration to do).
                table = seq.block_table
                block = table[start >> shift]
                if refs[block] == 1:
                    offset = seq.synced_blocks
                    new_blocks = table[offset:] if offset < len(table) else []
                    seq.synced_blocks = len(table)
                    seq.num_computed = start + 1
                    scheduled.append(
                        ScheduledSequence(
                            seq.seq_id,
                            seq.request_id,
                            seq.token_ids[start:],
                            start,
                            offset,
                            new_blocks,
                            [(block << shift) | (start & mask)],
                            True,
                        )
                    )
                    budget -= 1
                    i += 1
                    continue
            if n > budget:
                n = budget
            if n <= 0:  # its last token is still waiting for postprocess
                i += 1
                continue
            while not self._grow(seq, n, out.block_copies):
                preempted = True
                if len(running) == 1:
                    # Alone and still out of blocks: the pool cannot hold this sequence at all.
                    self.finish(seq, FinishReason.LENGTH)
                    self.finished_in_schedule.append(seq)
                    break
                victim = running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(self._emit(seq, n))
                budget -= n
                i += 1
                continue
            if seq.status is not SequenceStatus.RUNNING:
                # seq itself left the running list; the next one now sits at index i
                continue
        out.num_batched_tokens += start_budget - budget
        return preempted

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        pool = self.pool
        bs = self.block_size
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self._peek_waiting()
            if seq is None:
                break
            hits = self._prefix_hits(seq)
            n_cached = len(hits) * bs
            n = min(seq.num_tokens - n_cached, budget)
            new_blocks = _ceil_div(n_cached + n, bs) - len(hits)
            hits_free = sum(1 for b in hits if pool.ref_counts[b] == 0)
            if pool.num_free - hits_free - new_blocks < self._watermark_blocks and self.running:
                break
            if pool.num_free - hits_free < new_blocks:
                if not self.running and _ceil_div(seq.num_tokens, bs) > pool.num_blocks:
                    # Its tokens (prompt plus what it generated before a preemption) outgrew
                    # the whole pool: it can never run again.
                    self.finish(seq, FinishReason.LENGTH)
                    self.finished_in_schedule.append(seq)
                    continue
                break
            self.waiting[seq.priority].popleft()
            for b in hits:
                pool.acquire(b)
            pool.stats.queried_tokens += seq.num_tokens
            pool.stats.hit_tokens += n_cached
            pool.stats.queried_blocks += seq.num_tokens // bs
            pool.stats.hit_blocks += len(hits)
            seq.num_registered = len(hits)
            seq.block_table = hits
            seq.block_table.extend(pool.allocate_many(new_blocks) or [])
            seq.num_computed = n_cached
            seq.synced_blocks = 0
            if not seq.admitted_once:
                seq.num_cached_tokens = n_cached
                seq.admitted_once = True
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            out.scheduled.append(self._emit(seq, n))
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
            needed = _ceil_div(first_chunk, self.block_size) + self._watermark_blocks
            seats = len(self.running) < self.config.max_num_seqs
            if seats and self.pool.num_free >= needed:
                return
            self._preempt(victim)

    def _grow(self, seq: Sequence, n: int, copies: list[tuple[int, int]]) -> bool:
        """Give ``seq`` the blocks to hold ``n`` more tokens (copy-on-write included), or say no."""
        pool = self.pool
        bs = self.block_size
        table = seq.block_table
        start = seq.num_computed
        need = _ceil_div(start + n, bs) - len(table)
        idx = start // bs
        cow = idx < len(table) and pool.ref_counts[table[idx]] > 1
        if need + cow > pool.num_free:
            return False
        if cow:
            src = table[idx]
            dst = pool.allocate()
            assert dst is not None
            pool.release(src)
            table[idx] = dst
            copies.append((src, dst))
            if seq.synced_blocks > idx:
                seq.synced_blocks = idx
        for _ in range(need):
            table.append(pool.allocate())  # type: ignore[arg-type]
        return True

    def _emit(self, seq: Sequence, n: int) -> ScheduledSequence:
        bs = self.block_size
        table = seq.block_table
        start = seq.num_computed
        end = start + n
        if n == 1:
            slots = [table[start // bs] * bs + start % bs]
        else:
            slots = []
            pos = start
            while pos < end:
                block_end = min(end, (pos // bs + 1) * bs)
                base = table[pos // bs] * bs - (pos // bs) * bs
                slots.extend(range(base + pos, base + block_end))
                pos = block_end
        offset = seq.synced_blocks
        new_blocks = table[offset:] if offset < len(table) else []
        seq.synced_blocks = len(table)
        seq.num_computed = end
        full = end // bs
        if full > seq.num_registered and self.pool.enable_prefix_caching:
            hashes = seq.full_block_hashes(full, bs)
            tokens = seq.token_ids
            for j in range(seq.num_registered, full):
                self.pool.register(table[j], hashes[j], tokens[j * bs : (j + 1) * bs])
            seq.num_registered = full
        return ScheduledSequence(
            seq.seq_id,
            seq.request_id,
            seq.token_ids[start:end],
            start,
            offset,
            new_blocks,
            slots,
            end == len(seq.token_ids),
        )

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.release_table(seq.block_table)
        seq.block_table = []
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

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks for the longest cached prefix of ``seq``; its last token is never a hit."""
        if not self.pool.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        if max_blocks == 0:
            return []
        hashes = seq.full_block_hashes(max_blocks, bs)
        tokens = seq.token_ids
        hits: list[int] = []
        for i in range(max_blocks):
            block = self.pool.lookup(hashes[i], tokens[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits

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
        occ = self.pool.occupancy()
        bs = self.block_size
        fill: dict[int, int] = {}
        for seq in self.running:
            computed = seq.num_computed
            for j, block in enumerate(seq.block_table):
                f = min(bs, max(0, computed - j * bs))
                if f > fill.get(block, -1):
                    fill[block] = f
        occ.tokens_stored = sum(fill.values())
        occ.fragmentation_slots = occ.in_use * bs - occ.tokens_stored
        if with_tables:
            occ.block_tables = {
                f"{s.request_id}/{s.seq_id}": list(s.block_table) for s in self.running
            }
        return occ

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1
