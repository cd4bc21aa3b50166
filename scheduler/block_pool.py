"""The physical block pool: reference counts, the free queue, and the prefix-cache table.

Pure bookkeeping: block ids are integers ``0 .. num_blocks-1``; the KV tensors they index live in
the model runner. Nothing here raises on exhaustion: allocation answers ``None``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import IntEnum
from itertools import repeat

BlockHash = bytes


def hash_block(
    parent: BlockHash | None, tokens: list[int] | tuple[int, ...], extra: str | None
) -> BlockHash:
    """Chained digest of one full block: parent digest, the block's token ids, an optional salt.

    A 128-bit BLAKE2b digest makes accidental collisions practically impossible; the pool still
    checks the stored token ids on every hit, so a collision could at worst miss, never share
    wrong keys and values.
    """
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(array("q", tokens).tobytes())
    if extra:
        h.update(b"\x00salt\x00")
        h.update(extra.encode())
    return h.digest()


class BlockState(IntEnum):
    """The state of one block in ``PoolOccupancy.block_states`` (one byte per block).

    This is the only definition of the codes inside the engine. The heartbeat's wire format has
    its own characters (``pagedserve.telemetry.BLOCK_*``): ``scheduler/`` may import only the
    standard library and ``pagedserve/`` may not import ``scheduler/``, so neither package can
    use the other's names. ``worker.engine`` translates these codes into the wire characters, by
    name, in one table at the boundary.
    """

    FREE = 0  # reference count 0, no reusable prefix
    IN_USE = 1  # reference count 1
    CACHED = 2  # reference count 0 but holding a reusable prefix (evictable)
    SHARED = 3  # reference count >= 2


#: Reference count (0..255) -> state code, for ``bytes.translate``.
_REF_STATES = bytes([BlockState.FREE, BlockState.IN_USE] + [BlockState.SHARED] * 254)
#: Reference count (0..255) -> 1 if unreferenced, else 0.
_UNREFERENCED = bytes([1] + [0] * 255)


@dataclass(slots=True)
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    queried_blocks: int = 0
    hit_blocks: int = 0
    #: Cached prefixes moved into another block so that a table could take the block after its
    #: last one (``BlockPool.take``): one block copy each.
    moved_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(slots=True)
class PoolOccupancy:
    """A snapshot of the pool, cheap enough to take once a second."""

    num_blocks: int
    block_size: int
    free: int  # reference count 0 (includes cached_evictable)
    in_use: int  # reference count >= 1
    cached_evictable: int  # free but still holding a reusable prefix
    shared: int  # reference count >= 2
    tokens_stored: int = 0
    fragmentation_slots: int = 0  # allocated slots not holding a token
    block_states: bytes = b""  # one BlockState byte per block, in block-id order
    block_tables: dict[str, list[int]] = field(default_factory=dict)

    @property
    def usage(self) -> float:
        return self.in_use / self.num_blocks if self.num_blocks else 0.0


class BlockPool:
    """Reference-counted blocks; the LRU free queue doubles as the prefix-cache eviction order.

    The free queue has two parts, each an ``OrderedDict`` (O(1) removal from the middle when a
    cached block is hit): blocks that hold no reusable prefix, handed out first; then blocks
    that do, in the order they were released, so the least recently used prefix is evicted
    first. The second part is keyed by a stamp, not by block: a prefix that moves to another
    block (below) keeps its place in the eviction order.

    A growing table asks for the block right after its last one (:meth:`take`) and gets it
    whenever it is free: if it caches a prefix, that prefix moves into the block at the front of
    the queue (the one allocation would hand out, and whose own prefix it would evict, now)
    through a block copy the runner makes before the step's forward pass, as for copy-on-write.
    Why: taking the front block every time scattered each table across the pool once it had
    turned over (2% of consecutive entries adjacent by the fifth ``mixed`` wave,
    ``bench.kv_layout``), and the CPU decode kernel reads a scattered table 1.1-1.35x slower
    than a contiguous one; taking the neighbour and dropping its prefix halved multi-turn chats'
    prefix hits instead (bench/README.md). Until the forty-seventh session a moved prefix went
    to the back of the queue (most recently used), ahead of prefixes used since; keeping its
    place served multi-turn chats in a full pool 0.811 / 0.447 / 0.153 of their prompt tokens
    on turns 2-4 instead of 0.782 / 0.415 / 0.136 (``bench.kv_replay``, 6 seeds).

    **Windows.** A neighbour is only free if no other table started there: a sequence placed
    at the front of the queue landed right after another one's last block as often as not, and
    both then went on in pieces (54-79% of consecutive entries adjacent in a 2 GiB pool, 44% in
    a full one). So a sequence's blocks are placed as a *window*
    (:class:`~scheduler.kv_cache_manager.KVCacheManager`): a run of open blocks (free, in no
    other window) as long as its prompt and ``max_tokens`` need, found by :meth:`find_run` and
    marked in :attr:`reserved` until the sequence leaves it (99-100% adjacent in the 2 GiB
    pool). A window is a preference, not a promise: allocation from the queue (:meth:`allocate`:
    copy-on-write, and new blocks when every free block lies in some window) may still take its
    blocks, and the owner then opens a new window further on. ``num_free`` counts windows'
    blocks as free: admission is as before.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        if block_size <= 0 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts: list[int] = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._tokens_of: list[tuple[int, ...] | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        #: One byte per block, 1 while it holds a registered prefix (``_hash_of`` is set): the
        #: snapshot's cached blocks are these and the unreferenced ones, in bytes operations.
        self._hashed = bytearray(num_blocks)
        #: The free queue, in two parts. Free blocks holding no prefix, handed out first, front
        #: first; and free blocks holding one, least recently released first, keyed by a stamp
        #: so that a prefix moving to another block keeps its place (:meth:`_move_prefix`).
        self._fresh: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._lru: OrderedDict[int, int] = OrderedDict()  # stamp -> block
        self._stamp: list[int] = [0] * num_blocks  # a block's key in ``_lru`` while it is there
        self._next_stamp = 0
        #: One byte per block, 1 inside a sequence's window (see the class docstring).
        self.reserved = bytearray(num_blocks)
        #: One byte per block, 1 while it is free, in no window and not this step's prefix-move
        #: destination: what :meth:`find_run` may place a window on.
        self._open = bytearray(b"\x01") * num_blocks
        #: This step's prefix moves (:meth:`take`): destination -> source, and the
        #: step's copy list they were added to. Cleared by :meth:`new_step`.
        self._moved_to: dict[int, int] = {}
        self._copies: list[tuple[int, int]] = []
        self.stats = PrefixCacheStats()
        #: Prefixes dropped from the cache so far. While it stays the same, every lookup that
        #: found a prefix still finds it (a moved prefix is found under its new block): the
        #: worker's admission re-probes its groups only when it moved (worker/admission.py).
        self.evictions = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free(self) -> int:
        return len(self._fresh) + len(self._lru)

    @property
    def num_cached_evictable(self) -> int:
        return len(self._lru)

    def free_blocks(self) -> list[int]:
        """The free queue in allocation order (for tests and tools; O(free blocks))."""
        return [*self._fresh, *self._lru.values()]

    def record_lookup(self, num_tokens: int, num_hit_blocks: int) -> None:
        """Count one prefix lookup: a sequence of ``num_tokens`` found ``num_hit_blocks`` cached."""
        st = self.stats
        st.queried_tokens += num_tokens
        st.hit_tokens += num_hit_blocks * self.block_size
        st.queried_blocks += num_tokens // self.block_size
        st.hit_blocks += num_hit_blocks

    def lookup(self, block_hash: BlockHash, tokens: list[int]) -> int | None:
        """The cached block holding exactly ``tokens`` under ``block_hash``, or None."""
        block = self._cached.get(block_hash)
        if block is None or self._tokens_of[block] != tuple(tokens):
            return None
        return block

    # --------------------------------------------------------------- mutation
    def allocate(self) -> int | None:
        """Take the block at the front of the free queue (evicting its cached prefix, if any)."""
        if self._fresh:
            block, _ = self._fresh.popitem(last=False)
        elif self._lru:
            _, block = self._lru.popitem(last=False)
        else:
            return None
        if block in self._moved_to:  # a prefix moved here this step: dropped, copy and all
            self._copies.remove((self._moved_to.pop(block), block))
        self._evict(block)
        self.ref_counts[block] = 1
        self._open[block] = 0
        return block

    def take(self, block: int, copies: list[tuple[int, int]]) -> bool:
        """Take free ``block`` itself; a prefix it caches moves to the block allocation would
        hand out now (by a ``(source, destination)`` pair appended to ``copies``, this step's
        block copies). False if it is in use, or a destination of this step's moves. See the
        class docstring."""
        if self.ref_counts[block] or block in self._moved_to:
            return False
        if self._hash_of[block] is None:
            del self._fresh[block]
        elif self._fresh:  # the prefix moves into a block holding none: nothing evicted
            self._move_prefix(block, next(iter(self._fresh)), copies)
        else:
            stamp, front = next(iter(self._lru.items()))
            if front == block:  # the least recently used prefix: evicted, as allocate() would
                del self._lru[stamp]
                self._evict(block)
            elif front in self._moved_to:
                return False
            else:
                self._move_prefix(block, front, copies)
        self.ref_counts[block] = 1
        self._open[block] = 0
        return True

    def find_run(self, length: int) -> tuple[int, int] | None:
        """``(start, end)`` of the first run of ``length`` open blocks, else of half as many,
        down to one block; runs of blocks caching no prefix first (taking them moves nothing).
        None when every free block lies in a window. Two ``bytes.find`` calls per length:
        microseconds for 100k blocks."""
        open_ = self._open
        fresh = open_
        if self._cached:
            mask = int.from_bytes(open_, "little") & ~int.from_bytes(self._hashed, "little")
            fresh = mask.to_bytes(self.num_blocks, "little")
        while length >= 1:
            pattern = b"\x01" * length
            start = fresh.find(pattern)
            if start < 0 and fresh is not open_:
                start = open_.find(pattern)
            if start >= 0:
                return start, start + length
            length //= 2
        return None

    def reserve(self, start: int, end: int) -> None:
        """Mark blocks ``start .. end-1`` as one sequence's window (no other run covers them)."""
        self.reserved[start:end] = b"\x01" * (end - start)
        self._open[start:end] = bytes(end - start)

    def unreserve(self, start: int, end: int) -> None:
        """End a window: its free blocks are open again."""
        self.reserved[start:end] = bytes(end - start)
        refs, open_ = self.ref_counts, self._open
        for block in range(start, end):
            if not refs[block] and block not in self._moved_to:
                open_[block] = 1

    def _move_prefix(self, src: int, dst: int, copies: list[tuple[int, int]]) -> None:
        """Re-register free ``src``'s cached prefix under free block ``dst`` (the queue's
        front: evicting dst's own prefix, if any), dst taking src's place in the queue (the
        prefix keeps its recency), src leaving the queue; and ask for the copy of its K/V."""
        if self._hash_of[dst] is None:
            del self._fresh[dst]
        else:
            del self._lru[self._stamp[dst]]
            self._evict(dst)
        stamp = self._stamp[src]
        self._lru[stamp] = dst
        self._stamp[dst] = stamp
        block_hash, tokens = self._hash_of[src], self._tokens_of[src]
        assert block_hash is not None
        self._hash_of[src], self._tokens_of[src], self._hashed[src] = None, None, 0
        self._cached[block_hash] = dst
        self._hash_of[dst], self._tokens_of[dst], self._hashed[dst] = block_hash, tokens, 1
        copies.append((src, dst))
        self._moved_to[dst] = src
        self._open[dst] = 0
        self._copies = copies
        self.stats.moved_blocks += 1

    def new_step(self) -> None:
        """Forget the last step's prefix moves (their copies are made before its forward)."""
        if self._moved_to:
            refs, reserved, open_ = self.ref_counts, self.reserved, self._open
            for dst in self._moved_to:
                if not refs[dst] and not reserved[dst]:
                    open_[dst] = 1
            self._moved_to = {}
            self._copies = []

    def acquire(self, block: int) -> None:
        """Take one more reference to ``block`` (a prefix-cache hit or a fork)."""
        if self.ref_counts[block] == 0:
            if self._hash_of[block] is None:
                del self._fresh[block]
            else:
                del self._lru[self._stamp[block]]
            self._open[block] = 0
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        ref = self.ref_counts[block] - 1
        if ref < 0:
            raise AssertionError(f"block {block} released more often than acquired")
        self.ref_counts[block] = ref
        if ref == 0:
            self._open[block] = not (self.reserved[block] or block in self._moved_to)
            if self._hash_of[block] is None:
                self._fresh[block] = None
                self._fresh.move_to_end(block, last=False)
            else:
                self._next_stamp += 1
                self._lru[self._next_stamp] = block
                self._stamp[block] = self._next_stamp

    def release_table(self, table: list[int]) -> None:
        """Release a whole table, tail first, so tail blocks are evicted before head blocks."""
        for block in reversed(table):
            self.release(block)

    def register(self, block: int, block_hash: BlockHash, tokens: list[int]) -> None:
        """Record that ``block`` holds the full block ``tokens`` (first writer wins)."""
        if not self.enable_prefix_caching or self._hash_of[block] is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is cached already; this one stays private
        self._cached[block_hash] = block
        self._hash_of[block] = block_hash
        self._hashed[block] = 1
        self._tokens_of[block] = tuple(tokens)

    def _evict(self, block: int) -> None:
        h = self._hash_of[block]
        if h is not None:
            self.evictions += 1
            del self._cached[h]
            self._hash_of[block] = None
            self._hashed[block] = 0
            self._tokens_of[block] = None

    # --------------------------------------------------------------- snapshot
    def occupancy(self) -> PoolOccupancy:
        """The pool's snapshot. The heartbeat takes one a second, on the worker's loop: every
        per-block pass runs in C (reference counts as bytes, clamped to 255, translated to state
        codes; the cached blocks are the unreferenced ones among those holding a prefix, one AND
        of two byte masks read as integers). A Python loop over the cached blocks took 3 ms at
        16k blocks (half of them cached), 8 ms at 64k: ~0.5% of a fast worker's loop."""
        n = self.num_blocks
        try:
            refs = bytes(self.ref_counts)  # every count below 256: the usual case
        except ValueError:
            refs = bytes(map(min, self.ref_counts, repeat(255)))
        # Bytes are 0 or 1 in both masks, so the AND is per block; adding it, times CACHED - FREE,
        # to the state codes turns FREE into CACHED exactly where a block is cached (no carry:
        # those bytes are FREE, 0).
        cached_mask = int.from_bytes(refs.translate(_UNREFERENCED), "little") & int.from_bytes(
            self._hashed, "little"
        )
        codes = int.from_bytes(refs.translate(_REF_STATES), "little")
        codes += (BlockState.CACHED - BlockState.FREE) * cached_mask
        in_use = n - refs.count(0)
        shared = in_use - refs.count(1)
        cached = cached_mask.to_bytes(n, "little").count(1)
        states = codes.to_bytes(n, "little")
        return PoolOccupancy(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            free=self.num_free,
            in_use=in_use,
            cached_evictable=cached,
            shared=shared,
            block_states=states,
        )
