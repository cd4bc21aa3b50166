"""Per-sequence block tables over the pool: prefix lookup, growth, slot mapping, registration.

The scheduler decides *which* sequences run and how many tokens each computes; this module does
what that means for their block tables. ``emit`` is the one place a sequence's progress
(``num_computed``) and the runner's view of its table (``synced_blocks``) move forward, for a
prefill chunk and a decode token alike.
"""

from __future__ import annotations

from scheduler.block_pool import BlockPool, PoolOccupancy
from scheduler.output import ScheduledSequence
from scheduler.sequence import Sequence

#: The longest window a sequence is placed in, in blocks (see ``BlockPool``): past a few dozen
#: blocks in a row, one more jump costs the decode kernel nothing measurable, and a long
#: ``max_tokens`` should not hold a large share of the pool's runs.
MAX_WINDOW = 64


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def tokens_stored(running: list[Sequence], block_size: int) -> int:
    """Tokens the running sequences' blocks hold, each block counted once: a block shared by
    several (a cached prefix, a forked sample's copy-on-write block) holds the most any of them
    filled. Each sequence's full blocks go in with one dict update (a per-block Python loop over
    256 sequences' tables took ~2 ms of every heartbeat on the service loop); only the partly
    filled block is looked at alone."""
    full: dict[int, None] = {}
    partial: dict[int, int] = {}
    for seq in running:
        table, computed = seq.block_table, seq.num_computed
        n = computed // block_size
        full.update(dict.fromkeys(table[:n]))
        left = computed - n * block_size
        if left and n < len(table) and partial.get(table[n], 0) < left:
            partial[table[n]] = left
    return block_size * len(full) + sum(f for b, f in partial.items() if b not in full)


class KVCacheManager:
    def __init__(self, pool: BlockPool, windows: bool = True) -> None:
        self.pool = pool
        self.windows = windows
        self.block_size = bs = pool.block_size
        self._mask = bs - 1
        self._shift = bs.bit_length() - 1  # block_size is a power of two (BlockPool checks)
        self._caching = pool.enable_prefix_caching

    def prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks for the longest cached prefix of ``seq``; its last token is never a hit."""
        if not self._caching:
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

    def admit(
        self, seq: Sequence, hits: list[int], num_new_blocks: int, copies: list[tuple[int, int]]
    ) -> None:
        """Give a waiting sequence its cached prefix blocks plus ``num_new_blocks`` fresh ones,
        each after the one before where the pool allows (``copies``: the step's block copies).

        The caller has checked that the pool holds enough free blocks.
        """
        pool = self.pool
        for b in hits:
            pool.acquire(b)
        pool.record_lookup(seq.num_tokens, len(hits))
        n_cached = len(hits) * self.block_size
        seq.num_registered = len(hits)
        seq.block_table = hits
        self._extend(seq, num_new_blocks, copies)
        seq.num_computed = n_cached
        seq.synced_blocks = 0
        if not seq.admitted_once:
            seq.num_cached_tokens = n_cached
            seq.admitted_once = True

    def grow(self, seq: Sequence, n: int, copies: list[tuple[int, int]]) -> bool:
        """Give ``seq`` the blocks to hold ``n`` more tokens (copy-on-write included), or say no."""
        pool = self.pool
        table = seq.block_table
        start = seq.num_computed
        need = ceil_div(start + n, self.block_size) - len(table)
        idx = start >> self._shift
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
        if need > 0:
            self._extend(seq, need, copies)
        return True

    def _extend(self, seq: Sequence, n: int, copies: list[tuple[int, int]]) -> None:
        """Append ``n`` blocks to ``seq``'s table (the caller checked the pool has them)."""
        table = seq.block_table
        for _ in range(n):
            table.append(self._next_block(seq, copies))

    def _next_block(self, seq: Sequence, copies: list[tuple[int, int]]) -> int:
        """The block after the table's last one if it is free and in no other sequence's
        window; else the start of a new window for the blocks the sequence may still need
        (``BlockPool`` docstring); else, every free block lying in other windows, the queue's
        front block."""
        pool, table = self.pool, seq.block_table
        lo, hi = seq.kv_window
        if table:
            want = table[-1] + 1
            free_to_me = want < pool.num_blocks and (lo <= want < hi or not pool.reserved[want])
            if free_to_me and pool.take(want, copies):
                return want
        self._close_window(seq)
        if self.windows:
            block = self._open_window(seq)
            if block is not None and pool.take(block, copies):
                return block
            self._close_window(seq)
        block = pool.allocate()
        assert block is not None, "the caller checked the pool's free blocks"
        return block

    def _open_window(self, seq: Sequence) -> int | None:
        """Reserve a window for the blocks ``seq`` may still need (prompt and max_tokens, at
        most ``MAX_WINDOW``) on the first open run that long, else half as long...; its start."""
        total = min(seq.prompt_len + seq.stop.max_tokens, seq.max_model_len)
        left = ceil_div(total, self.block_size) - len(seq.block_table)
        run = self.pool.find_run(max(1, min(left, MAX_WINDOW)))
        if run is None:
            return None
        self.pool.reserve(*run)
        seq.kv_window = run
        return run[0]

    def _close_window(self, seq: Sequence) -> None:
        """Give back what is left of ``seq``'s window, if it has one."""
        if seq.kv_window[1] > seq.kv_window[0]:
            self.pool.unreserve(*seq.kv_window)
            seq.kv_window = (0, 0)

    def emit(self, seq: Sequence, n: int) -> ScheduledSequence:
        """Schedule the next ``n`` tokens of ``seq`` into blocks it already holds.

        The one place ``num_computed`` and ``synced_blocks`` move forward. It runs for every
        scheduled sequence every step, so each attribute is read once.
        """
        table = seq.block_table
        start = seq.num_computed
        end = seq.num_computed = start + n
        offset = seq.synced_blocks
        num_table = seq.synced_blocks = len(table)
        shift = self._shift
        if n == 1:
            slots = [(table[start >> shift] << shift) | (start & self._mask)]
        else:
            slots = self._slots(table, start, end)
        if self._caching and end >> shift > seq.num_registered:
            self._register(seq, end >> shift)
        tokens = seq.token_ids
        return ScheduledSequence(
            seq.seq_id,
            seq.request_id,
            tokens[start:end],
            start,
            offset,
            table[offset:] if offset < num_table else [],
            slots,
            end == len(tokens),
        )

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        slots: list[int] = []
        pos = start
        while pos < end:
            block_end = min(end, (pos // bs + 1) * bs)
            base = table[pos // bs] * bs - (pos // bs) * bs
            slots.extend(range(base + pos, base + block_end))
            pos = block_end
        return slots

    def _register(self, seq: Sequence, full: int) -> None:
        """Offer the newly completed full blocks of ``seq`` to the prefix cache."""
        bs = self.block_size
        hashes = seq.full_block_hashes(full, bs)
        tokens = seq.token_ids
        table = seq.block_table
        for j in range(seq.num_registered, full):
            self.pool.register(table[j], hashes[j], tokens[j * bs : (j + 1) * bs])
        seq.num_registered = full

    def free(self, seq: Sequence) -> None:
        """Drop every block of ``seq`` (their prefixes stay cached until evicted)."""
        self.pool.release_table(seq.block_table)
        seq.block_table = []
        self._close_window(seq)

    def occupancy(self, running: list[Sequence], with_tables: bool = False) -> PoolOccupancy:
        """The pool snapshot plus the token fill of the blocks the running sequences hold."""
        occ = self.pool.occupancy()
        occ.tokens_stored = tokens_stored(running, self.block_size)
        occ.fragmentation_slots = occ.in_use * self.block_size - occ.tokens_stored
        if with_tables:
            occ.block_tables = {f"{s.request_id}/{s.seq_id}": list(s.block_table) for s in running}
        return occ
