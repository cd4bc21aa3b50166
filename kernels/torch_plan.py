"""The CPU backend's per-step plan: everything that depends only on the step's metadata.

Built once per forward pass and reused by every layer (see :mod:`kernels.torch_backend`): the
decode rows and their chunks (gather indices, additive masks), each prefill chunk's mask, the rows
for the C decode kernel. Shared-prefix grouping is planned in :mod:`kernels.torch_cascade`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.metadata import AttentionMetadata
from kernels.native import DecodeRows, PrefillChunks

# Bytes of gathered K+V per decode chunk: small enough to stay in L2/L3 between the gather and
# the attention that reads it, large enough to amortise per-op overhead.
CHUNK_BYTES = 6 * 1024 * 1024


@dataclass
class DecodeRow:
    first_block: int  # first block the query reads here (window start, or end of shared prefix)
    num_blocks: int
    seq_index: int
    token_row: int
    seq_len: int
    shared_slot: int = -1  # row in the step's shared-prefix results, -1 when not in a group


@dataclass
class Merge:
    """Rows of a decode chunk whose context starts with a shared prefix computed separately."""

    local: torch.Tensor | None  # int64 [m]: rows of the chunk; None: all of them, in order
    slots: torch.Tensor | slice  # rows of the step's shared-prefix results (a slice if a range)


@dataclass
class DecodeChunk:
    """Decode tokens that read the same (padded) number of blocks."""

    token_idx: torch.Tensor  # int64 [n]: rows of the flat batch
    block_ids: torch.Tensor  # int64 [n * num_blocks]
    num_blocks: int
    mask: torch.Tensor | None  # additive 0/-inf [n, 1, 1, num_blocks * block_size], or None
    merge: Merge | None = None


@dataclass
class SharedGroup:
    """Query tokens (decodes, prefill chunks) of sequences whose block tables start with the
    same ``num_blocks`` physical blocks, which every one of them sees whole."""

    token_idx: torch.Tensor  # int64 [G]: rows of the flat batch
    block_ids: torch.Tensor  # int64 [num_blocks]
    first_id: int  # block_ids[0]
    contiguous: bool  # block_ids == first_id + arange(num_blocks): read as a slice, no gather
    num_blocks: int
    seq_index: int  # a member's row of the block table (its first num_blocks are the prefix)


# Where the tiled prefill kernel does not apply (see next), prefill chunks whose context is at
# most this long run in the C decode kernel, each query token a decode row over the (already
# written) cache: against torch's causal SDPA on a Zen 5 EPYC (2 threads; 8/4 and 9/3 heads,
# head_dim 64) 1.4-2.8x at 16-96 tokens, 1.2-1.6x at 264, 1.0-1.6x at 512, 0.7-1.0x at 1024
# (one query per pass over the keys: it does not tile queries).
NATIVE_PREFILL_MAX_LEN = 768
# Chunks of at most this much context run in the tiled prefill kernel
# (kernels/csrc/paged_prefill.h; 1.7-1.8x the decode rows at 768 on a Zen 4). Against torch's
# path for longer chunks (SDPA over the gathered context; Zen 4 EPYC, 2 threads, one process,
# medians of 9) it ran 1.41-1.58x at a 1024-token prompt, 1.12-1.54x at 2048, 1.33-1.59x for
# 512 tokens after 1024 cached (9/3, 8/4, 14/2 heads of 64). Longer contexts were not measured:
# they stay in torch.
TILED_PREFILL_MAX_LEN = 2048


@dataclass
class PrefillWork:
    """How one prefill chunk runs this step (per window and dtype)."""

    first_block: int  # first block read from the cache (after a shared prefix or the window)
    mask: torch.Tensor | None  # additive 0/-inf [1, 1, q, L]; None: plain causal
    slots: slice | None  # rows of the step's shared-prefix results, None when not shared
    native: bool = False  # its tokens are rows of the step's C kernel call (NativeWork)


@dataclass
class NativeWork:
    """Every decode row of the step for the C kernel, where each continues a shared prefix,
    and the prefill chunks for the tiled prefill kernel (None: none, or they are decode rows)."""

    rows: DecodeRows
    block_tables: torch.Tensor  # int32, contiguous
    #: int64 [n]: per kernel row its row of the step's shared-prefix results, -1 for none
    #: (the kernel starts from that result, :class:`kernels.native.PrefixStart`); None: no
    #: row is in a group
    slots: torch.Tensor | None
    prefill: PrefillChunks | None = None


@dataclass
class DecodePlan:
    """A step's work for one (window, cache bytes per token, compute dtype)."""

    shared: list[SharedGroup]
    chunks: list[DecodeChunk]
    prefill: list[PrefillWork]
    native: NativeWork | None = None  # set instead of ``chunks`` when the C kernel runs
    #: the groups for the C kernel's cascade mode (None: torch's flash call reads them)
    shared_native: SharedChunks | None = None


@dataclass
class SharedChunks:
    """The step's shared-prefix groups as chunks of the tiled kernel's all-keys mode: the
    grouped query rows listed group after group (read by index, not copied), one chunk per
    group."""

    token_idx: torch.Tensor  # int64 [S]: rows of the flat batch, group after group
    chunks: PrefillChunks  # starts in the gathered rows, group sizes, prefix lengths, table rows
    block_tables: torch.Tensor  # int32, contiguous


@dataclass
class Prefill:
    """One sequence computing more than one token this step."""

    start: int
    query_len: int
    seq_len: int
    seq_index: int


@dataclass
class StepPlan:
    prefill: list[Prefill] = field(default_factory=list)
    decode_seqs: list[tuple[int, int]] = field(default_factory=list)  # (seq_index, token_row)
    # the step's work per (sliding_window, bytes of K+V per token, compute dtype)
    decode: dict[tuple[int | None, int, torch.dtype], DecodePlan] = field(default_factory=dict)
    table_host: list[list[int]] | None = None  # the block table, read once per step


def long_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def slots_index(slots: list[int], device: torch.device) -> torch.Tensor | slice:
    """Rows of the shared-prefix results: a slice when they are one range (the usual case)."""
    if slots == list(range(slots[0], slots[-1] + 1)):
        return slice(slots[0], slots[-1] + 1)
    return long_tensor(slots, device)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def build_step_plan(meta: AttentionMetadata) -> StepPlan:
    """Split the flat batch into decode tokens and prefill chunks (the part no layer changes)."""
    plan = StepPlan()
    start = 0
    for b, (q_len, seq_len) in enumerate(
        zip(meta.query_lens_host, meta.seq_lens_host, strict=True)
    ):
        if q_len == 1:
            plan.decode_seqs.append((b, start))
        elif q_len > 1:
            plan.prefill.append(Prefill(start, q_len, seq_len, b))
        start += q_len
    return plan


def decode_rows(
    plan: StepPlan, meta: AttentionMetadata, block_size: int, window: int | None
) -> list[DecodeRow]:
    rows = []
    for b, token_row in plan.decode_seqs:
        seq_len = meta.seq_lens_host[b]
        last_block = (seq_len - 1) // block_size
        first = 0 if window is None else max(0, seq_len - window) // block_size
        rows.append(DecodeRow(first, last_block - first + 1, b, token_row, seq_len))
    return rows


def prefill_rows(chunks: list[Prefill], device: torch.device) -> DecodeRows:
    """Prefill chunks' query tokens as decode rows, a chunk after another, each chunk's last
    token first: token ``i`` of a chunk sees positions up to its own (causal), its keys already
    in the cache. Built with ``arange`` (a 2048-token step is 2048 rows); ``chunks`` not empty."""
    token_rows, seq_lens, seq_index = [], [], []
    for pre in chunks:
        top = torch.arange(pre.query_len - 1, -1, -1, device=device)
        token_rows.append(top + pre.start)
        seq_lens.append(top + (pre.seq_len - pre.query_len + 1))
        seq_index.append(torch.full((pre.query_len,), pre.seq_index, device=device))
    tokens = torch.cat(token_rows)
    return DecodeRows(tokens, torch.cat(seq_index), torch.zeros_like(tokens), torch.cat(seq_lens))


def chunk_rows(rows: list[DecodeRow], block_bytes: int, chunk_bytes: int) -> list[list[int]]:
    """Greedy cut of rows (ascending block counts) into groups of about ``chunk_bytes``."""
    groups: list[list[int]] = []
    current: list[int] = []
    for i, row in enumerate(rows):
        padded = (len(current) + 1) * row.num_blocks * block_bytes
        if current and padded > chunk_bytes:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def _chunk_mask(
    sel: list[DecodeRow],
    block_size: int,
    window: int | None,
    cdt: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """Additive mask (0 where allowed, -inf elsewhere), built once per step; None if unneeded."""
    nb = sel[-1].num_blocks
    length = nb * block_size
    needs_mask = any(
        length != r.seq_len - r.first_block * block_size
        or (window is not None and r.seq_len - r.first_block * block_size > window)
        for r in sel
    )
    if not needs_mask:
        return None
    first = torch.tensor([r.first_block for r in sel], dtype=torch.long, device=device)
    last = torch.tensor([r.seq_len - 1 for r in sel], dtype=torch.long, device=device)
    pos = first[:, None] * block_size + torch.arange(length, device=device)[None, :]
    allowed = pos <= last[:, None]
    if window is not None:
        allowed &= pos > last[:, None] - window
    mask = torch.zeros(allowed.shape, dtype=cdt, device=device)
    mask.masked_fill_(~allowed, float("-inf"))
    return mask[:, None, None, :]


def make_chunk(
    sel: list[DecodeRow],
    table: torch.Tensor,
    block_size: int,
    window: int | None,
    cdt: torch.dtype,
) -> DecodeChunk:
    device = table.device
    nb = sel[-1].num_blocks
    seq_idx = torch.tensor([r.seq_index for r in sel], dtype=torch.long, device=device)
    first = torch.tensor([r.first_block for r in sel], dtype=torch.long, device=device)
    cols = (first[:, None] + torch.arange(nb, device=device)[None, :]).clamp_(
        max=table.shape[1] - 1
    )
    block_ids = table.index_select(0, seq_idx).gather(1, cols)
    local = [i for i, r in enumerate(sel) if r.shared_slot >= 0]
    merge = None
    if local:
        merge = Merge(
            local=None if len(local) == len(sel) else long_tensor(local, device),
            slots=slots_index([sel[i].shared_slot for i in local], device),
        )
    return DecodeChunk(
        token_idx=torch.tensor([r.token_row for r in sel], dtype=torch.long, device=device),
        block_ids=block_ids.reshape(-1).to(torch.long),
        num_blocks=nb,
        mask=_chunk_mask(sel, block_size, window, cdt, device),
        merge=merge,
    )


def prefill_work(
    pre: Prefill,
    shared: tuple[int, slice] | None,
    block_size: int,
    window: int | None,
    cdt: torch.dtype,
    device: torch.device,
) -> PrefillWork:
    """Read from block ``first`` on (after a shared prefix / before the window's first block);
    the mask is built here, once per step."""
    first, slots = shared if shared is not None else (0, None)
    if window is not None and shared is None:
        first = max(0, pre.seq_len - pre.query_len - window + 1) // block_size
    if pre.seq_len == pre.query_len and window is None:
        return PrefillWork(first_block=0, mask=None, slots=None)
    q_pos = torch.arange(pre.seq_len - pre.query_len, pre.seq_len, device=device)
    k_pos = torch.arange(first * block_size, pre.seq_len, device=device)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    mask = torch.zeros(allowed.shape, dtype=cdt, device=device)
    mask.masked_fill_(~allowed, float("-inf"))
    return PrefillWork(first, mask[None, None], slots)


def int32_tables(meta: AttentionMetadata) -> torch.Tensor:
    """The block table as the C kernels take it (int32, contiguous)."""
    tables = meta.block_tables
    if tables.dtype != torch.int32 or not tables.is_contiguous():
        tables = tables.to(torch.int32).contiguous()
    return tables


def make_native(
    rows: list[DecodeRow],
    meta: AttentionMetadata,
    prefill: list[Prefill] | None = None,
    tiled_prefill: bool = False,
) -> NativeWork:
    """Rows longest first (the kernel's threads take them in order), each continuing its
    shared prefix's result where it is in a group.
    The ``prefill`` chunks go to the tiled prefill kernel (``tiled_prefill``), else their
    tokens follow as decode rows (:func:`prefill_rows`), a prompt at a time: its keys stay in
    the core's L2 while its rows run."""
    rows = sorted(rows, key=lambda r: -r.num_blocks)
    device = meta.block_tables.device
    kernel_rows = DecodeRows(
        token_rows=long_tensor([r.token_row for r in rows], device),
        seq_index=long_tensor([r.seq_index for r in rows], device),
        first_block=long_tensor([r.first_block for r in rows], device),
        seq_lens=long_tensor([r.seq_len for r in rows], device),
    )
    chunks = None
    if prefill and tiled_prefill:
        chunks = PrefillChunks(
            starts=long_tensor([p.start for p in prefill], device),
            query_lens=long_tensor([p.query_len for p in prefill], device),
            seq_lens=long_tensor([p.seq_len for p in prefill], device),
            seq_index=long_tensor([p.seq_index for p in prefill], device),
        )
    elif prefill:
        kernel_rows = kernel_rows.then(prefill_rows(prefill, device))
    slots = None
    if any(r.shared_slot >= 0 for r in rows):
        padded = [r.shared_slot for r in rows] + [-1] * (kernel_rows.num_rows - len(rows))
        slots = long_tensor(padded, device)
    return NativeWork(kernel_rows, int32_tables(meta), slots, chunks)
