"""Shared prefixes (cascade attention) for the CPU backend: grouping per step, reading per layer.

Per step, sequences whose block tables start with the same block ids are grouped and their common
run of full blocks is found once from the host-side tables (``split_shared``). Per layer, each
group's prefix is read once and all the group's queries run against it in one flash call that
returns the log-sum-exp (``shared_prefixes``); ``merge_into`` then combines that exactly with the
attention over the rest of each sequence's context.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from kernels.metadata import AttentionMetadata
from kernels.native import NativeDecode, PrefillChunks
from kernels.torch_ops import Workspace, flash
from kernels.torch_plan import (
    DecodeRow,
    Merge,
    SharedChunks,
    SharedGroup,
    StepPlan,
    long_tensor,
)


def _common_prefix(tables: list[list[int]], limit: int) -> int:
    """Length of the leading run of block ids shared by every table (at most ``limit``)."""
    first = tables[0]
    n = 0
    while n < limit and all(t[n] == first[n] for t in tables):
        n += 1
    return n


def _find_shared_groups(
    limits: list[int],
    tables: list[list[int]],
    queries: list[int],
    min_blocks: int = 1,
    min_work: int = 0,
) -> list[tuple[list[int], int]]:
    """``(member indices, shared full blocks)`` for sequences whose tables start alike (groups
    sharing fewer than ``min_blocks`` blocks, or whose query tokens (``queries``, per
    sequence) times shared blocks come to less than ``min_work``, are left out).

    Candidates are grouped by their first block id; a group's prefix is the common leading run
    of identical block ids, at most each member's ``limit`` (the full blocks that every one of
    its queries sees whole: for a decode, those before its last block; for a prefill, its cached
    full blocks).
    """
    by_first: dict[int, list[int]] = {}
    for i, limit in enumerate(limits):
        if limit >= 1:
            by_first.setdefault(tables[i][0], []).append(i)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        limit = min(limits[i] for i in members)
        shared = _common_prefix([tables[i] for i in members], limit)
        work = shared * sum(queries[i] for i in members)
        if shared >= max(1, min_blocks) and work >= min_work:
            groups.append((members, shared))
    return groups


def _make_shared_group(
    token_rows: list[int], prefix: list[int], device: torch.device, seq_index: int
) -> SharedGroup:
    first_id = prefix[0]
    return SharedGroup(
        token_idx=long_tensor(token_rows, device),
        block_ids=long_tensor(prefix, device),
        first_id=first_id,
        contiguous=prefix == list(range(first_id, first_id + len(prefix))),
        num_blocks=len(prefix),
        seq_index=seq_index,
    )


def _may_share(
    plan: StepPlan, meta: AttentionMetadata, rows: list[DecodeRow], limits: list[int]
) -> bool:
    """Whether two of the step's candidates (a full block before their query) start at the same
    block: groups form only among those (:func:`_find_shared_groups`). Why: reading the whole
    block table into Python lists every step was most of this function's cost, and most steps
    of unrelated prompts have no group (the first column alone answers that)."""
    firsts = meta.block_tables[:, 0].tolist()
    seqs = [r.seq_index for r in rows] + [pre.seq_index for pre in plan.prefill]
    seen: set[int] = set()
    for seq, limit in zip(seqs, limits, strict=True):
        if limit >= 1:
            first = firsts[seq]
            if first in seen:
                return True
            seen.add(first)
    return False


def split_shared(
    plan: StepPlan,
    meta: AttentionMetadata,
    rows: list[DecodeRow],
    block_size: int,
    grouped_prefill: list[bool] | None = None,
    min_blocks: int = 1,
    min_work: int = 0,
) -> tuple[list[SharedGroup], list[tuple[int, slice] | None]]:
    """Find the shared-prefix groups of at least ``min_blocks`` blocks and ``min_work``
    query tokens x shared tokens among decodes and prefills (only the prefills whose
    ``grouped_prefill`` entry is true, when given).

    Decode rows then read only their blocks after the prefix (``rows`` are updated). Returns the
    groups and, per prefill, ``(shared blocks, its rows of the shared results)`` or None. Group
    members follow the decode rows' final order, so a chunk's slots are usually one range.
    """
    limits = [(r.seq_len - 1) // block_size for r in rows]
    limits += [
        (pre.seq_len - pre.query_len) // block_size
        if grouped_prefill is None or grouped_prefill[k]
        else 0  # never in a group
        for k, pre in enumerate(plan.prefill)
    ]
    if not _may_share(plan, meta, rows, limits):
        return [], [None] * len(plan.prefill)
    if plan.table_host is None:
        plan.table_host = meta.block_tables.tolist()
    tables = [plan.table_host[r.seq_index] for r in rows]
    tables += [plan.table_host[pre.seq_index] for pre in plan.prefill]
    queries = [1] * len(rows) + [pre.query_len for pre in plan.prefill]
    work_blocks = -(-min_work // block_size)
    groups = _find_shared_groups(limits, tables, queries, min_blocks, work_blocks)
    n = len(rows)
    for members, num_shared in groups:
        for i in members:
            if i < n:
                rows[i].first_block = num_shared
                rows[i].num_blocks -= num_shared
    rank = {i: k for k, i in enumerate(sorted(range(n), key=lambda i: rows[i].num_blocks))}
    shared = []
    prefill: list[tuple[int, slice] | None] = [None] * len(plan.prefill)
    slot = 0
    for members, num_shared in groups:
        token_rows: list[int] = []
        for i in sorted(members, key=lambda i: rank.get(i, n + i)):
            if i < n:
                rows[i].shared_slot = slot
                token_rows.append(rows[i].token_row)
                slot += 1
            else:
                pre = plan.prefill[i - n]
                prefill[i - n] = (num_shared, slice(slot, slot + pre.query_len))
                token_rows.extend(range(pre.start, pre.start + pre.query_len))
                slot += pre.query_len
        first = members[0]
        seq_index = rows[first].seq_index if first < n else plan.prefill[first - n].seq_index
        prefix = tables[first][:num_shared]
        shared.append(_make_shared_group(token_rows, prefix, meta.block_tables.device, seq_index))
    return shared, prefill


def shared_chunks(
    groups: list[SharedGroup], block_size: int, block_tables: torch.Tensor
) -> SharedChunks | None:
    """The groups as chunks of the C kernel's all-keys mode (:func:`native_shared_prefixes`),
    built once per step; None without groups. ``block_tables``: the step's int32 contiguous
    table (the one the C decode call takes)."""
    if not groups:
        return None
    sizes = [int(g.token_idx.shape[0]) for g in groups]
    device = block_tables.device
    chunks = PrefillChunks(
        starts=long_tensor([0, *accumulate(sizes[:-1])], device),
        query_lens=long_tensor(sizes, device),
        seq_lens=long_tensor([g.num_blocks * block_size for g in groups], device),
        seq_index=long_tensor([g.seq_index for g in groups], device),
    )
    return SharedChunks(torch.cat([g.token_idx for g in groups]), chunks, block_tables)


def native_shared_prefixes(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    work: SharedChunks,
    scale: float,
    kernel: NativeDecode,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`shared_prefixes` in the tiled C kernel (float32): every group's query rows
    against its prefix's blocks read in place (no gather, no flash call)."""
    rows = work.token_idx
    out = torch.empty(rows.shape[0], query.shape[1], query.shape[2], dtype=torch.float32)
    lse = torch.empty(rows.shape[0], query.shape[1], dtype=torch.float32)
    kernel.prefill(query, k_cache, v_cache, work.block_tables, work.chunks, scale, out, lse, rows)
    return out, lse


def shared_prefixes(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    groups: list[SharedGroup],
    scale: float,
    cdt: torch.dtype,
    workspace: Workspace,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``([S, H, D], [S, H])``: output and log-sum-exp of every grouped query over its prefix.

    Each group reads its prefix once (a slice of the cache when the blocks are consecutive,
    else one small gather) and runs all its queries against it in one flash-attention call,
    the group's query tokens (decodes and prefill chunks) making up the query length.
    """
    if not groups:
        return None
    outs, lses = [], []
    for group in groups:
        o, lse = _shared_group(query, k_cache, v_cache, group, scale, cdt, workspace)
        outs.append(o)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs), torch.cat(lses)


def _shared_group(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: SharedGroup,
    scale: float,
    cdt: torch.dtype,
    workspace: Workspace,
) -> tuple[torch.Tensor, torch.Tensor]:
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if group.contiguous:
        k_blocks = k_cache[group.first_id : group.first_id + group.num_blocks]
        v_blocks = v_cache[group.first_id : group.first_id + group.num_blocks]
    else:
        k_blocks, v_blocks = workspace.get(
            (group.num_blocks, block_size, num_kv_heads, head_dim),
            k_cache.dtype,
            k_cache.device,
        )
        torch.index_select(k_cache, 0, group.block_ids, out=k_blocks)
        torch.index_select(v_cache, 0, group.block_ids, out=v_blocks)
    length = group.num_blocks * block_size
    # [L, Hkv, D] -> strided [1, Hkv, L, D]
    k = k_blocks.reshape(length, num_kv_heads, head_dim).to(cdt).transpose(0, 1).unsqueeze(0)
    v = v_blocks.reshape(length, num_kv_heads, head_dim).to(cdt).transpose(0, 1).unsqueeze(0)
    # [G, H, D] -> [1, H, G, D]: the group's tokens become the query length
    q = query.index_select(0, group.token_idx).to(cdt).transpose(0, 1).unsqueeze(0)
    o, lse = flash(q, k, v, None, scale)
    o = o[0].transpose(0, 1)  # [G, H, D]
    lse = lse[0].transpose(0, 1)  # [G, H]
    return o, lse.to(cdt)


def merge_into(
    o: torch.Tensor,
    lse: torch.Tensor,
    merge: Merge,
    shared_o: torch.Tensor,
    shared_lse: torch.Tensor,
) -> torch.Tensor:
    """Combine the chunk's partial results with the shared-prefix ones, exactly, by LSE weights.

    With ``w = exp(l1) / (exp(l1) + exp(l2)) = sigmoid(l1 - l2)`` the merged output is
    ``lerp(o2, o1, w)``: three ops, no overflow.
    """
    whole = merge.local is None
    o1 = o if whole else o.index_select(0, merge.local)
    l1 = lse if whole else lse.index_select(0, merge.local)
    if isinstance(merge.slots, slice):
        o2, l2 = shared_o[merge.slots], shared_lse[merge.slots]
    else:
        o2, l2 = shared_o.index_select(0, merge.slots), shared_lse.index_select(0, merge.slots)
    weight = torch.sigmoid(l1 - l2).unsqueeze(-1)
    merged = torch.lerp(o2, o1, weight)
    return merged if whole else o.index_copy(0, merge.local, merged)
