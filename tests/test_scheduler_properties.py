"""Property-based tests: random operation sequences against the scheduler's invariants.

Besides the bookkeeping invariants, a shadow KV cache records what each slot would hold (the
token prefix that produced it, and the salt); after every step every computed position of every
running sequence must read back exactly its own prefix. That checks prefix-cache hits,
copy-on-write and preemption end to end, the way a model would experience them.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler.block_pool import BlockState
from scheduler.scheduler import Scheduler, SchedulerConfig, SequenceRejected
from scheduler.sequence import FinishReason, SequenceStatus, StopConditions

EOS = 0
ALPHABET = st.integers(min_value=1, max_value=3)  # a tiny alphabet makes shared prefixes common


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(min_value=2, max_value=24),
        block_size=st.sampled_from([1, 2, 4, 8]),
        budget=st.integers(min_value=1, max_value=40),
        max_seqs=st.integers(min_value=1, max_value=6),
        caching=st.booleans(),
        windows=st.booleans(),
    )
    def setup(
        self,
        num_blocks: int,
        block_size: int,
        budget: int,
        max_seqs: int,
        caching: bool,
        windows: bool,
    ) -> None:
        self.sched = Scheduler(
            SchedulerConfig(
                num_blocks=num_blocks,
                block_size=block_size,
                max_num_seqs=max_seqs,
                max_num_batched_tokens=budget,
                enable_prefix_caching=caching,
                kv_windows=windows,
            )
        )
        self.shadow: dict[int, tuple] = {}  # slot -> (salt, token prefix)
        self.runner_tables: dict[int, list[int]] = {}
        self.next_request = 0
        self.salts: dict[str, str | None] = {}
        self.cached_seen: dict = {}  # prefix hash -> tokens, as of the last check
        self.evictions_seen = 0

    # ------------------------------------------------------------ operations
    @rule(
        prompt=st.lists(ALPHABET, min_size=1, max_size=40),
        max_tokens=st.integers(min_value=1, max_value=12),
        priority=st.sampled_from([0, 1]),
        salt=st.sampled_from([None, None, "tenant-a"]),
        ignore_eos=st.booleans(),
    )
    def add(
        self, prompt: list[int], max_tokens: int, priority: int, salt: str | None, ignore_eos: bool
    ) -> None:
        rid = f"r{self.next_request}"
        self.next_request += 1
        stop = StopConditions(
            max_tokens=max_tokens, eos_token_ids=frozenset({EOS}), ignore_eos=ignore_eos
        )
        capacity = self.sched.pool.num_blocks * self.sched.block_size
        try:
            self.sched.add_sequence(rid, prompt, stop, priority=priority, cache_salt=salt)
        except SequenceRejected:
            assert len(prompt) + 1 > capacity
            return
        self.salts[rid] = salt

    @rule(tokens=st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=6))
    def step(self, tokens: list[int]) -> None:
        moves_before = self.sched.pool.stats.moved_blocks
        out = self.sched.schedule()
        for seq_id in out.released_seq_ids + out.preempted_seq_ids:
            self.runner_tables.pop(seq_id, None)
        # Block copies (copy-on-write, moved prefixes) before the forward pass, as the runner
        # makes them: every source read first, then every destination written (one gather and
        # one scatter), so a chain of copies in one step would show here.
        bs = self.sched.block_size
        dsts = [dst for _, dst in out.block_copies]
        assert len(set(dsts)) == len(dsts), "two copies into one block"
        copied = {
            dst * bs + off: self.shadow.get(src * bs + off)
            for src, dst in out.block_copies
            for off in range(bs)
        }
        for slot, held in copied.items():
            if held is None:
                self.shadow.pop(slot, None)
            else:
                self.shadow[slot] = held
        # Coverage markers (pytest --hypothesis-show-statistics shows how often each occurs).
        if out.preempted_seq_ids:
            event("preemption")
        if out.block_copies:
            event("block copy")
        if self.sched.pool.stats.moved_blocks > moves_before:
            event("prefix moved to take the next block")
        if any(s.block_offset == 0 and s.start_pos > 0 for s in out.scheduled):
            event("prefix-cache hit or resume")
        if any(not s.sample for s in out.scheduled):
            event("chunked prefill")
        assert out.num_batched_tokens == sum(s.num_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= self.sched.config.max_num_batched_tokens
        assert len({s.seq_id for s in out.scheduled}) == len(out.scheduled)
        for s in out.scheduled:
            table = self.runner_tables.get(s.seq_id, [])
            assert s.block_offset <= len(table)
            table = table[: s.block_offset] + s.new_block_ids
            self.runner_tables[s.seq_id] = table
            seq = self.sched.seqs[s.seq_id]
            assert table == seq.block_table
            assert len(s.slot_mapping) == len(s.token_ids)
            salt = self.salts[s.request_id]
            full = seq.token_ids
            for i, slot in enumerate(s.slot_mapping):
                pos = s.start_pos + i
                assert table[pos // bs] * bs + pos % bs == slot
                self.shadow[slot] = (salt, tuple(full[: pos + 1]))
        sampled = [
            (s.seq_id, tokens[i % len(tokens)]) for i, s in enumerate(out.scheduled) if s.sample
        ]
        self.sched.postprocess(sampled)

    @precondition(lambda self: any(s.num_output_tokens > 0 for s in self.sched.running))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        candidates = [s for s in self.sched.running if s.num_output_tokens > 0]
        parent = data.draw(st.sampled_from(candidates))
        child = self.sched.fork(parent.seq_id)
        assert child.token_ids == parent.token_ids
        assert child.block_table == parent.block_table

    @precondition(lambda self: bool(self.sched.requests))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        before = self.sched.pool.num_free
        aborted = self.sched.abort(rid)
        assert aborted and all(s.finish_reason is FinishReason.ABORT for s in aborted)
        assert rid not in self.sched.requests
        assert self.sched.pool.num_free >= before

    @precondition(lambda self: bool(self.sched.running))
    @rule(data=st.data())
    def stop_string(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.sched.running))
        self.sched.finish(seq, FinishReason.STOP)
        assert seq.status is SequenceStatus.FINISHED

    # ------------------------------------------------------------ invariants
    @invariant()
    def pool_accounting(self) -> None:
        pool = self.sched.pool
        in_use = sum(1 for r in pool.ref_counts if r > 0)
        assert pool.num_free + in_use == pool.num_blocks
        for b in pool.free_blocks():
            assert pool.ref_counts[b] == 0, "a free block is referenced"
        # The queue's two parts: blocks holding no prefix, and those holding one under the
        # stamp of their recency (a moved prefix keeps its stamp).
        assert all(pool._hash_of[b] is None for b in pool._fresh)
        assert all(
            pool._hash_of[b] is not None and pool._stamp[b] == k for k, b in pool._lru.items()
        )
        assert len(set(pool.free_blocks())) == pool.num_free
        # The snapshot's per-block states, block by block from the counts and the prefix table.
        occ = pool.occupancy()
        expected = bytes(
            BlockState.SHARED if r >= 2 else BlockState.IN_USE if r == 1
            else BlockState.CACHED if pool._hash_of[b] is not None else BlockState.FREE
            for b, r in enumerate(pool.ref_counts)
        )  # fmt: skip
        assert occ.block_states == expected
        assert occ.in_use == in_use and occ.shared == sum(r >= 2 for r in pool.ref_counts)
        assert occ.cached_evictable == expected.count(BlockState.CACHED)

    @invariant()
    def tokens_stored_counts_each_block_once(self) -> None:
        """The snapshot's token fill against a per-block pass: each block holds the most any
        running sequence filled it with."""
        bs = self.sched.block_size
        fill: dict[int, int] = {}
        for seq in self.sched.running:
            for j, b in enumerate(seq.block_table):
                fill[b] = max(fill.get(b, 0), min(bs, max(0, seq.num_computed - j * bs)))
        occ = self.sched.occupancy()
        assert occ.tokens_stored == sum(fill.values())
        assert occ.fragmentation_slots == occ.in_use * bs - occ.tokens_stored

    @invariant()
    def prefix_table_is_consistent(self) -> None:
        """Every cached hash names a block that holds it, and only those blocks are marked
        (``BlockPool.take`` moves prefixes between blocks)."""
        pool = self.sched.pool
        for block_hash, block in pool._cached.items():
            assert pool._hash_of[block] == block_hash and pool._hashed[block] == 1
            assert pool._tokens_of[block] is not None
        assert sum(pool._hashed) == len(pool._cached)
        assert sum(h is not None for h in pool._hash_of) == len(pool._cached)

    @invariant()
    def windows_are_disjoint_and_open_blocks_free(self) -> None:
        """Each sequence's window (``BlockPool``'s class docstring) is its own: no two overlap,
        the pool's reserved bytes are exactly their union, a waiting sequence has none, and
        the open blocks (where a window may be placed) are the free blocks outside every
        window and this step's prefix-move destinations."""
        pool = self.sched.pool
        marked = bytearray(pool.num_blocks)
        for seq in self.sched.seqs.values():
            lo, hi = seq.kv_window
            if seq.status is SequenceStatus.WAITING:
                assert (lo, hi) == (0, 0)
            assert not any(marked[lo:hi]), "two windows overlap"
            marked[lo:hi] = b"\x01" * (hi - lo)
        assert pool.reserved == marked
        expected = bytearray(
            not (r or marked[b] or b in pool._moved_to) for b, r in enumerate(pool.ref_counts)
        )
        assert pool._open == expected

    @invariant()
    def prefixes_stay_found_until_an_eviction(self) -> None:
        """While ``pool.evictions`` has not moved, every prefix cached at the last check is still
        found by a lookup (moved or not): what the worker's admission counts on to skip its
        probes (worker/admission.py)."""
        pool = self.sched.pool
        if pool.evictions == self.evictions_seen:
            for block_hash, tokens in self.cached_seen.items():
                assert pool.lookup(block_hash, list(tokens)) is not None
        else:
            assert pool.evictions > self.evictions_seen
        self.cached_seen = {h: pool._tokens_of[b] for h, b in pool._cached.items()}
        self.evictions_seen = pool.evictions

    @invariant()
    def ref_counts_match_tables(self) -> None:
        holders = [0] * self.sched.pool.num_blocks
        for seq in self.sched.seqs.values():
            if seq.status is SequenceStatus.WAITING:
                assert seq.block_table == [] and seq.num_computed == 0
            for b in seq.block_table:
                holders[b] += 1
        assert holders == self.sched.pool.ref_counts

    @invariant()
    def cache_holds_each_sequences_own_prefix(self) -> None:
        bs = self.sched.block_size
        for seq in self.sched.running:
            salt = self.salts[seq.request_id]
            assert len(seq.block_table) * bs >= seq.num_computed
            for pos in range(seq.num_computed):
                slot = seq.block_table[pos // bs] * bs + pos % bs
                got = self.shadow.get(slot)
                want = (salt, tuple(seq.token_ids[: pos + 1]))
                assert got == want, f"seq {seq.seq_id} pos {pos} reads {got}, expected {want}"

    @invariant()
    def queues_are_consistent(self) -> None:
        running = self.sched.running
        assert running == sorted(running, key=lambda s: s.sort_key)
        assert all(s.status is SequenceStatus.RUNNING for s in running)
        waiting = [s for q in self.sched.waiting.values() for s in q]
        assert all(s.status is SequenceStatus.WAITING for s in waiting)
        assert len(running) + len(waiting) == len(self.sched.seqs)

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        # Drain: every request must finish and give every block back.
        for _ in range(2000):
            if not self.sched.has_work():
                break
            self.step([1])
        assert not self.sched.has_work(), "work left after draining: a livelock"
        assert all(r == 0 for r in self.sched.pool.ref_counts), "blocks still in use"
        assert self.sched.pool.num_free == self.sched.pool.num_blocks


SchedulerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase
