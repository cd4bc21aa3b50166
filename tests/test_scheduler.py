"""Exact small-pool tests: eviction order, copy-on-write pairs, chunk budgets, preemptions."""

from __future__ import annotations

import pytest

from scheduler.block_pool import BlockPool, BlockState, hash_block
from scheduler.scheduler import Scheduler, SchedulerConfig, SequenceRejected
from scheduler.sequence import FinishReason, Priority, SequenceStatus, StopConditions

STOP = StopConditions(max_tokens=100, ignore_eos=True)


def make(
    num_blocks: int = 16,
    block_size: int = 4,
    budget: int = 64,
    max_seqs: int = 8,
    caching: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            enable_prefix_caching=caching,
            watermark=0.0,
        )
    )


def run_step(s: Scheduler, token: int = 9):
    out = s.schedule()
    s.postprocess([(x.seq_id, token) for x in out.scheduled if x.sample])
    return out


# ------------------------------------------------------------------ block pool
def test_pool_hands_out_uncached_blocks_before_evicting_cached_ones() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    table = [pool.allocate() for _ in range(3)]
    assert table == [0, 1, 2]
    h0 = hash_block(None, [1, 2], None)
    h1 = hash_block(h0, [3, 4], None)
    pool.register(0, h0, [1, 2])
    pool.register(1, h1, [3, 4])
    pool.release_table(table)  # tail first: 2 (uncached), 1, 0
    assert pool.num_free == 4 and pool.num_cached_evictable == 2
    # uncached blocks first (2 was just freed and goes to the front; 3 was never used) ...
    assert pool.allocate() == 2
    assert pool.allocate() == 3
    # ... then the least recently used cached blocks, the tail block before the head block
    assert pool.allocate() == 1
    assert pool.lookup(h1, [3, 4]) is None, "an evicted block must leave the cache"
    assert pool.lookup(h0, [1, 2]) == 0
    assert pool.allocate() == 0
    assert pool.allocate() is None


def test_pool_hit_is_confirmed_against_tokens() -> None:
    pool = BlockPool(num_blocks=2, block_size=2)
    b = pool.allocate()
    h = hash_block(None, [5, 6], None)
    pool.register(b, h, [5, 6])
    assert pool.lookup(h, [5, 6]) == b
    assert pool.lookup(h, [6, 5]) is None  # same key, other tokens: a collision never shares


def test_pool_rejects_non_power_of_two_block_size() -> None:
    with pytest.raises(ValueError, match="power of two"):
        BlockPool(num_blocks=4, block_size=12)


def test_acquire_removes_cached_block_from_free_queue() -> None:
    pool = BlockPool(num_blocks=3, block_size=1)
    b = pool.allocate()
    pool.register(b, hash_block(None, [1], None), [1])
    pool.release(b)
    assert pool.num_free == 3
    pool.acquire(b)  # a prefix hit on a freed, still cached block
    assert pool.num_free == 2 and pool.ref_counts[b] == 1
    assert b not in [pool.allocate(), pool.allocate()]


# ------------------------------------------------------------ windows
def consecutive(table: list[int]) -> bool:
    return table == list(range(table[0], table[0] + len(table)))


def test_sequences_growing_side_by_side_each_stay_in_one_run_of_blocks() -> None:
    """Two sequences decoding at once: each is placed in a window long enough for its prompt
    and max_tokens, so the other one's first block is never its next one (before windows, the
    second took block 1, right after the first's block 0, and the two tables interleaved)."""
    s = make(num_blocks=64, block_size=4)
    stop = StopConditions(max_tokens=28, ignore_eos=True)  # 32 tokens in all: 8 blocks each
    a = s.add_sequence("a", [1, 2, 3, 4], stop)
    b = s.add_sequence("b", [5, 6, 7, 8], stop)
    for _ in range(27):  # the prompt's step and 26 decode steps: 31 tokens computed
        run_step(s)
        assert consecutive(a.block_table) and consecutive(b.block_table)
    assert len(a.block_table) == len(b.block_table) == 8
    assert not set(a.block_table) & set(b.block_table)
    assert s.pool.stats.moved_blocks == 0  # fresh blocks, nothing cached in the way


def test_a_window_is_a_preference_not_a_reservation() -> None:
    """Windows are placed on open runs only, and never hold back admission: a sequence arriving
    when no open block is left takes blocks from the queue, inside others' windows; every
    sequence finishes and leaves no window behind."""
    s = make(num_blocks=12, block_size=4)
    a = s.add_sequence("a", [1, 2, 3, 4], StopConditions(max_tokens=24, ignore_eos=True))
    run_step(s)
    assert a.block_table == [0] and a.kv_window == (0, 7)  # 28 tokens: 7 blocks
    b = s.add_sequence("b", list(range(10, 22)), STOP)  # 28 blocks wanted: 3 found open
    run_step(s)
    assert b.block_table == [7, 8, 9] and b.kv_window == (7, 10)
    assert s.pool.reserved == bytearray([1] * 10 + [0, 0])
    c = s.add_sequence("c", list(range(30, 38)), STOP)  # 2 blocks; 10 and 11 open
    out = run_step(s)
    assert c.seq_id in {x.seq_id for x in out.scheduled}
    assert b.block_table == [7, 8, 9, 10]  # grew past its window into an open block
    assert c.block_table == [11, 2]  # the last open block, then the queue's front (a's)
    assert a.block_table == [0, 1]
    for _ in range(200):
        if not s.has_work():
            break
        run_step(s)
    assert not s.has_work() and s.pool.num_free == 12 and not any(s.pool.reserved)


# ------------------------------------------------------------ chunked prefill
def test_chunked_prefill_spends_one_budget_running_first() -> None:
    s = make(num_blocks=64, block_size=4, budget=32)
    a = s.add_sequence("a", list(range(1, 51)), STOP)
    b = s.add_sequence("b", [7] * 10, STOP)
    out = run_step(s)
    assert [(x.seq_id, x.num_tokens, x.sample) for x in out.scheduled] == [(a.seq_id, 32, False)]
    out = run_step(s)
    assert [(x.seq_id, x.start_pos, x.num_tokens, x.sample) for x in out.scheduled] == [
        (a.seq_id, 32, 18, True),
        (b.seq_id, 0, 10, True),
    ]
    out = run_step(s)
    assert [(x.seq_id, x.num_tokens) for x in out.scheduled] == [(a.seq_id, 1), (b.seq_id, 1)]
    assert out.num_batched_tokens == 2


def test_slot_mapping_and_incremental_block_tables() -> None:
    s = make(num_blocks=8, block_size=4)
    a = s.add_sequence("a", [1, 2, 3, 4, 5, 6], STOP)
    out = run_step(s)
    x = out.scheduled[0]
    assert x.block_offset == 0 and x.new_block_ids == a.block_table and len(a.block_table) == 2
    t = a.block_table
    assert x.slot_mapping == [t[0] * 4 + i for i in range(4)] + [t[1] * 4, t[1] * 4 + 1]
    out = run_step(s)  # position 6 lies in the second block: nothing new for the runner
    assert out.scheduled[0].new_block_ids == [] and out.scheduled[0].block_offset == 2
    run_step(s)  # position 7 fills the block
    out = run_step(s)  # position 8 needs a third block: only that one is sent
    assert out.scheduled[0].block_offset == 2 and out.scheduled[0].new_block_ids == [
        a.block_table[2]
    ]


# ------------------------------------------------------------ copy-on-write
def test_fork_shares_blocks_and_copies_the_partial_block_on_first_write() -> None:
    s = make(num_blocks=8, block_size=4)
    parent = s.add_sequence("a", [1, 2, 3, 4, 5, 6], STOP)
    run_step(s)  # prefill; parent samples token 9 at position 6
    child = s.fork(parent.seq_id)
    s.seqs[child.seq_id].token_ids[-1] = 8  # the second sample drew another token
    full, partial = parent.block_table
    assert child.block_table == [full, partial]
    assert s.pool.ref_counts[full] == 2 and s.pool.ref_counts[partial] == 2
    out = s.schedule()
    # The parent writes first and gets a private copy; the child then owns the original alone.
    assert len(out.block_copies) == 1
    src, dst = out.block_copies[0]
    assert src == partial and parent.block_table == [full, dst]
    assert child.block_table == [full, partial]
    assert s.pool.ref_counts[full] == 2 and s.pool.ref_counts[partial] == 1
    sp = {x.seq_id: x for x in out.scheduled}
    assert sp[parent.seq_id].block_offset == 1 and sp[parent.seq_id].new_block_ids == [dst]
    assert sp[child.seq_id].block_offset == 0 and sp[child.seq_id].new_block_ids == [full, partial]
    assert s.occupancy().shared == 1


# ------------------------------------------------------------ prefix caching
def test_prefix_hit_reuses_full_blocks_and_leaves_last_token_to_compute() -> None:
    s = make(num_blocks=16, block_size=4)
    prompt = list(range(1, 13))  # exactly three blocks
    a = s.add_sequence("a", prompt, STOP)
    run_step(s)
    s.abort("a")
    b = s.add_sequence("b", prompt, STOP)
    out = run_step(s)
    # Two of three blocks hit: the last block is recomputed so its last token yields logits.
    assert b.num_cached_tokens == 8
    assert out.scheduled[0].start_pos == 8 and out.scheduled[0].num_tokens == 4
    assert b.block_table[:2] == a.block_table[:2] or s.pool.stats.hit_blocks == 2
    assert s.pool.stats.hit_tokens == 8


def test_prefix_cache_stats_count_every_admission_and_are_a_copy() -> None:
    s = make(num_blocks=16, block_size=4)
    prompt = list(range(1, 13))
    s.add_sequence("a", prompt, STOP)
    run_step(s)  # a miss: 12 tokens (3 full blocks) queried, none hit
    s.add_sequence("b", [*prompt, 99], STOP)
    run_step(s)  # 13 tokens queried; all 3 full blocks hit (the 13th token is computed)
    stats = s.prefix_cache_stats()
    assert (stats.queried_tokens, stats.hit_tokens) == (25, 12)
    assert (stats.queried_blocks, stats.hit_blocks) == (6, 3)
    assert stats.hit_rate == 12 / 25
    stats.hit_tokens = 0  # the caller's copy: the scheduler's counters are not touched
    assert s.prefix_cache_stats().hit_tokens == 12


def test_admission_capacity_counts_seats_and_average_blocks_per_running_sequence() -> None:
    s = make(num_blocks=16, block_size=4, max_seqs=8)
    assert s.admission_capacity() == 8  # empty: one block each, the seats are the limit
    for i in range(2):
        s.add_sequence(f"r{i}", [i + 1] * 5, STOP)
    run_step(s)  # each holds 2 blocks (5 prompt tokens computed)
    assert s.pool.num_free == 12
    assert s.admission_capacity() == 6  # min(8 - 2 seats, 12 free // 2 per sequence)
    s.add_sequence("w", [7] * 5, STOP)  # waiting: takes a seat and a share of the blocks
    assert s.admission_capacity() == 5
    for i in range(6):
        s.add_sequence(f"more{i}", [7], STOP)
    assert s.admission_capacity() == 0  # no seats left


def test_lookahead_lets_sequences_wait_beyond_seats_and_blocks() -> None:
    s = make(num_blocks=16, block_size=4, max_seqs=2)
    for i in range(2):
        s.add_sequence(f"r{i}", [i + 1] * 5, STOP)
    run_step(s)  # both seats taken, 2 blocks each
    assert s.admission_capacity() == 0
    assert s.admission_capacity(lookahead=3) == 3  # may wait here for a seat
    s.add_sequence("w", [7] * 5, STOP)
    assert s.admission_capacity(lookahead=3) == 2  # the waiting one counts against them
    assert s.unstarted() == ["w"]


def test_unstarted_leaves_out_running_and_preempted_sequences() -> None:
    s = make(num_blocks=4, block_size=4, max_seqs=4)
    s.add_sequence("a", [1] * 7, STOP)
    s.add_sequence("b", [2] * 7, STOP)
    run_step(s)  # both prefilled: 4 blocks in use
    s.add_sequence("c", [3] * 3, STOP)
    assert s.unstarted() == ["c"]
    for _ in range(3):  # growing past a block preempts "b" (recompute): started before
        run_step(s)
    assert s.stats.num_preemptions >= 1
    assert "b" not in s.unstarted() and "c" in s.unstarted()


def test_salt_separates_prefix_caches() -> None:
    s = make(num_blocks=16, block_size=4)
    prompt = list(range(1, 10))
    s.add_sequence("a", prompt, STOP, cache_salt="tenant-1")
    run_step(s)
    b = s.add_sequence("b", prompt, STOP, cache_salt="tenant-2")
    c = s.add_sequence("c", prompt, STOP, cache_salt="tenant-1")
    run_step(s)
    assert b.num_cached_tokens == 0 and c.num_cached_tokens == 8


def test_occupancy_counts_tokens_and_fragmentation() -> None:
    s = make(num_blocks=8, block_size=4)
    s.add_sequence("a", [1, 2, 3, 4, 5], STOP)
    run_step(s)
    occ = s.occupancy(with_tables=True)
    assert occ.in_use == 2 and occ.tokens_stored == 5 and occ.fragmentation_slots == 3
    assert occ.free == 6 and occ.block_states.count(bytes([BlockState.IN_USE])) == 2
    assert list(occ.block_tables.values()) == [s.running[0].block_table]
    s.abort("a")
    occ = s.occupancy()
    assert occ.in_use == 0 and occ.cached_evictable == 1  # the one full block stays cached
    assert set(occ.block_states) <= {BlockState.FREE, BlockState.CACHED}
    assert BlockState.SHARED not in occ.block_states


# ------------------------------------------------------------ preemption
def test_growth_preempts_latest_arrival_which_keeps_its_tokens() -> None:
    s = make(num_blocks=4, block_size=4, budget=64)
    a = s.add_sequence("a", [1, 2, 3, 4, 5, 6, 7], STOP)  # 2 blocks
    b = s.add_sequence("b", [1, 1, 1, 1, 1, 1, 1], STOP)  # 2 blocks
    run_step(s)
    assert s.pool.num_free == 0
    out = run_step(s)  # both write position 7 (still in block 2): no growth needed
    assert len(out.scheduled) == 2
    out = s.schedule()  # position 8 needs a block each: b (latest arrival) is preempted
    assert out.preempted_seq_ids == [b.seq_id]
    assert [x.seq_id for x in out.scheduled] == [a.seq_id]
    assert b.status is SequenceStatus.WAITING and b.num_computed == 0 and b.block_table == []
    assert b.token_ids == [1] * 7 + [9, 9] and b.num_preemptions == 1
    assert s.stats.num_preemptions == 1
    s.postprocess([(a.seq_id, 9)])
    s.abort("a")
    out = run_step(s)  # b resumes by recomputing prompt and generated tokens ...
    x = out.scheduled[0]
    assert x.seq_id == b.seq_id and x.sample
    # ... except its first full block, which its preemption left in the prefix cache
    assert x.start_pos == 4 and x.token_ids == [1, 1, 1, 9, 9]


def test_interactive_request_preempts_bulk_work() -> None:
    s = make(num_blocks=4, block_size=4)
    bulk1 = s.add_sequence("bulk1", [1] * 7, STOP, priority=Priority.BULK)
    bulk2 = s.add_sequence("bulk2", [2] * 7, STOP, priority=Priority.BULK)
    run_step(s)
    assert s.pool.num_free == 0
    hot = s.add_sequence("hot", [3] * 3, STOP, priority=Priority.INTERACTIVE)
    out = s.schedule()
    assert bulk2.seq_id in out.preempted_seq_ids and bulk1.status is SequenceStatus.RUNNING
    assert hot.seq_id in {x.seq_id for x in out.scheduled}
    assert s.running[0] is hot  # interactive work runs first from now on


def test_lone_sequence_that_outgrows_the_pool_finishes_with_length() -> None:
    s = make(num_blocks=2, block_size=2)
    a = s.add_sequence("a", [1, 2, 3], StopConditions(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        run_step(s)
    assert a.status is SequenceStatus.FINISHED and a.finish_reason is FinishReason.LENGTH
    assert s.take_finished() == [a] and s.take_finished() == []
    assert s.pool.num_free == 2


def test_max_num_seqs_limits_admission() -> None:
    s = make(max_seqs=2)
    for i in range(3):
        s.add_sequence(f"r{i}", [1, 2, 3], STOP)
    out = run_step(s)
    assert len(out.scheduled) == 2 and s.num_waiting == 1


# ------------------------------------------------------------ stop conditions and errors
def test_stop_conditions() -> None:
    s = make()
    eos = s.add_sequence("eos", [1, 2], StopConditions(max_tokens=10, eos_token_ids=frozenset({0})))
    ign = s.add_sequence(
        "ign", [1, 2], StopConditions(max_tokens=2, eos_token_ids=frozenset({0}), ignore_eos=True)
    )
    stp = s.add_sequence(
        "stp", [1, 2], StopConditions(max_tokens=10, stop_token_ids=frozenset({0}), min_tokens=2)
    )
    run_step(s, token=0)
    assert eos.finish_reason is FinishReason.STOP
    assert (
        ign.status is SequenceStatus.RUNNING and stp.status is SequenceStatus.RUNNING
    )  # min_tokens
    run_step(s, token=0)
    assert ign.finish_reason is FinishReason.LENGTH and stp.finish_reason is FinishReason.STOP
    assert s.pool.num_free == s.pool.num_blocks


def test_rejections_are_clear() -> None:
    s = make(num_blocks=2, block_size=4)
    with pytest.raises(SequenceRejected, match="can never fit"):
        s.add_sequence("big", list(range(1, 9)), STOP)
    with pytest.raises(SequenceRejected, match="empty"):
        s.add_sequence("empty", [], STOP)
    with pytest.raises(SequenceRejected, match="context length"):
        s.add_sequence("long", [1, 2, 3], STOP, max_model_len=3)
    s.add_sequence("ok", [1], STOP)
    with pytest.raises(SequenceRejected, match="already in use"):
        s.add_sequence("ok", [1], STOP)


def test_abort_frees_blocks_in_every_state() -> None:
    s = make(num_blocks=8, block_size=4, budget=4)
    s.add_sequence("running", [1] * 6, STOP)
    s.add_sequence("waiting", [2] * 6, STOP)
    run_step(s)  # "running" is mid-prefill, "waiting" not admitted
    assert s.pool.num_free == 7
    assert [x.request_id for x in s.abort("running")] == ["running"]
    assert s.pool.num_free == 8
    s.abort("waiting")
    assert not s.has_work()
    assert s.abort("unknown") == []
    out = s.schedule()
    assert out.released_seq_ids == [0]  # the runner is told to drop the aborted table
