"""Paged attention for CPUs: plain torch, plus a C decode kernel where one builds.

Reading the KV cache dominates decode on a CPU, and the blocks of a sequence are scattered
through the pool, so every plan here is about touching each cached byte as few times as possible
while it is still in the CPU's caches:

* shared prefixes (cascade): prefix caching maps the common head of many prompts to the same
  physical blocks. Per step, sequences whose block tables start with the same block id are
  grouped and their common leading run of block ids (full blocks every member's queries see
  whole) is found once from the host-side tables. Each layer then reads a group's prefix once (a
  slice of the cache when its ids are consecutive, else one small gather) and runs all the
  group's query tokens (decodes and prefill chunks) against it in one flash call that also
  returns the log-sum-exp; each sequence attends to the rest of its context as below, and the two
  partial results are merged exactly: ``o = lerp(o_rest, o_prefix, sigmoid(lse_prefix -
  lse_rest))``. With a sliding window nothing is shared (every sequence reads its own window).
  With the C kernels, a group is formed only where :class:`CascadePolicy` says it beats the
  kernels reading the prefix in place (32K query x shared tokens), never for a prefill chunk
  the tiled kernel takes; with 16-float vectors the groups run in the tiled C kernel's
  all-keys mode instead of a flash call, and decode rows in the C kernel continue their
  group's result (its output and log-sum-exp start the row's online softmax: no merge).
* decode tokens with float32 or bfloat16 caches (float32 queries) go to the C kernel of
  :mod:`kernels.native` (one build per cache dtype) when it is built:
  one call per layer for every decode row, reading its blocks in place through the block table
  (no gather) and writing the output rows; a row in a shared-prefix group starts from its
  group's output and log-sum-exp (from either kind of group), so it needs no merge. On
  2 EPYC cores it runs decode attention 2-3x faster than the torch path below, which remains the
  fallback (no compiler, other dtypes or shapes) and is tested against the same reference.
* decode tokens in torch (``query_len == 1``) are sorted by the number of blocks they read and
  cut into *chunks* of a few MiB of K/V each. A chunk gathers its blocks with one
  ``index_select`` per cache into a reused workspace (so no page faults from fresh
  allocations), and runs one batched CPU flash attention (native GQA, additive length mask) on
  strided views of it while the gathered bytes are still in L2/L3. Measured on 2 EPYC cores,
  chunking alone halves the time compared with gathering the whole batch first.
* prefill chunks (``query_len > 1``) not in a shared-prefix group and without a window run in C
  over the cache (their keys are written before attention): up to ``TILED_PREFILL_MAX_LEN``
  tokens of context in the tiled prefill kernel (query tiles against key tiles, like a small
  GEMM), or, where its vector width does not divide the head size or
  ``PAGEDSERVE_TILED_PREFILL=0``, up to ``NATIVE_PREFILL_MAX_LEN`` as decode rows of the decode
  kernel's call, a prompt at a time.
  The rest run one by one in torch: straight on the step's fresh keys/values with a causal SDPA
  when nothing is cached before the chunk, else on the context gathered from the cache (from the
  end of a shared prefix, or the window's first block).

The plan (groups, sorting, chunking, gather indices, additive masks) depends only on the step's
metadata, so it is built once per forward pass and reused by every layer: no mask is built or
filled per layer. A backend instance is meant for one engine thread (it owns its workspace).

Modules: :mod:`kernels.torch_plan` builds the per-step plan, :mod:`kernels.torch_cascade` groups
and reads shared prefixes, :mod:`kernels.torch_ops` runs decode and prefill chunks; this module
holds the backend that caches the plan and runs each layer.

Masking convention (Hugging Face's): the query at position ``p`` sees ``k <= p`` and, with a
sliding window ``W``, ``k > p - W``; with a window, decode reads only the blocks the window
touches. Arithmetic is fp32 (fp64 stays fp64); the output has the query's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import native as native_kernel
from kernels.metadata import AttentionMetadata
from kernels.native import NativeDecode, PrefixStart
from kernels.torch_cascade import (
    merge_into,
    native_shared_prefixes,
    shared_chunks,
    shared_prefixes,
    split_shared,
)
from kernels.torch_ops import Workspace, decode_chunk, prefill_chunk
from kernels.torch_plan import (
    CHUNK_BYTES,
    NATIVE_PREFILL_MAX_LEN,
    TILED_PREFILL_MAX_LEN,
    DecodePlan,
    Merge,
    NativeWork,
    Prefill,
    SharedGroup,
    StepPlan,
    build_step_plan,
    chunk_rows,
    compute_dtype,
    decode_rows,
    make_chunk,
    make_native,
    prefill_work,
)


@dataclass(frozen=True)
class CascadePolicy:
    """When a shared prefix gets a cascade group while the C kernels run (the torch path groups
    every shared prefix): at least ``min_bytes`` of K+V per layer, and at least ``min_work``
    query tokens x shared tokens in the group. Below that, each decode row reads the prefix's
    blocks in place in the C kernel."""

    min_bytes: int = 0
    min_work: int = 0
    #: the groups run in the tiled C kernel's all-keys mode (reading the prefix's blocks in
    #: place) instead of torch's gather and flash call; needs the tiled prefill kernel
    in_kernel: bool = False


#: 16-float (AVX-512) builds of the C kernels: the groups run in the tiled kernel's all-keys
#: mode (12 x 16 register tiles over the prefix read in place), and each decode row continues
#: its group's result in the decode kernel. Measured on 2 Zen 4 cores (decode only, per layer,
#: K/V from DRAM, 8-96 rows x 512-4096 shared tokens, 8/4 and 9/3 heads of 64), against per-row
#: reads of the prefix in the decode kernel: 0.75-0.82x at 8K query x shared tokens, 0.92-0.98x
#: at 16K, 1.01-1.15x at 32K, 1.19-1.50x at 48-128K; torch's flash call for the same groups
#: 0.64-0.83x the kernel's rate. In the engine (``shared-prefix``, one process, 6 rotated rounds)
#: 1.026x (bench model, 96K) and 1.032x (SmolLM2, 48K) the per-row reads (issue #17's
#: eighteenth session; before it, torch's flash call for groups of 8 MiB and more).
WIDE_CASCADE = CascadePolicy(min_work=32 * 1024, in_kernel=True)
#: 8-float (AVX2-only) builds: there the decode kernel is bound by its own arithmetic on hot
#: blocks (bench/README.md, the twelfth session), and the group's flash call (GEMMs) wins once
#: the group has work enough to pay for its gather and merges. Measured on 2 Zen 3 cores (16-96
#: rows x 256-2048 shared tokens, 8/4 and 9/3 heads of 64): the cascade 0.60-0.92x the per-row
#: reads at 8-16K query x shared tokens, 0.90-1.20x at 24K, 1.03-1.52x from 32K; in the engine
#: (``shared-prefix``: 96K) the 8 MiB rule of the wide builds ran 0.85x (bench model) and 0.92x
#: (SmolLM2) the rate of grouping every prefix (issue #17's seventeenth session).
NARROW_CASCADE = CascadePolicy(min_work=32 * 1024)


def cascade_policy(kernel: NativeDecode) -> CascadePolicy:
    """The policy measured for the vector width ``kernel`` was built with."""
    return WIDE_CASCADE if kernel.prefill_lanes >= 16 else NARROW_CASCADE


def _make_decode_plan(
    plan: StepPlan,
    meta: AttentionMetadata,
    block_size: int,
    window: int | None,
    token_bytes: int,
    chunk_bytes: int,
    cdt: torch.dtype,
    shared_prefix: bool = True,
    native: bool = False,
    tiled_prefill: bool = False,
    cascade: CascadePolicy | None = None,
) -> DecodePlan:
    rows = decode_rows(plan, meta, block_size, window)
    shared: list[SharedGroup] = []
    prefill_shared: list[tuple[int, slice] | None] = [None] * len(plan.prefill)
    if shared_prefix and window is None and len(rows) + len(plan.prefill) >= 2:
        # With the C kernels, a group is formed only where the policy measured it faster than
        # the kernels reading the prefix's blocks in place (CascadePolicy), and never for a
        # prefill chunk the tiled kernel takes (bench/README.md, issue #17's sixteenth and
        # seventeenth sessions).
        grouped = [
            not (native and tiled_prefill and pre.seq_len <= TILED_PREFILL_MAX_LEN)
            for pre in plan.prefill
        ]
        policy = cascade if native and cascade is not None else CascadePolicy()
        min_blocks = -(-policy.min_bytes // (block_size * token_bytes))
        shared, prefill_shared = split_shared(
            plan, meta, rows, block_size, grouped, min_blocks, policy.min_work
        )
    device = meta.block_tables.device
    prefill = [
        prefill_work(pre, sh, block_size, window, cdt, device)
        for pre, sh in zip(plan.prefill, prefill_shared, strict=True)
    ]
    if native:
        in_kernel: list[Prefill] = []
        limit = TILED_PREFILL_MAX_LEN if tiled_prefill else NATIVE_PREFILL_MAX_LEN
        for pre, work, sh in zip(plan.prefill, prefill, prefill_shared, strict=True):
            if sh is None and window is None and pre.seq_len <= limit:
                work.native = True
                in_kernel.append(pre)
        if rows or in_kernel:
            native_work = make_native(rows, meta, in_kernel, tiled_prefill)
            shared_native = None
            if tiled_prefill and cascade is not None and cascade.in_kernel:
                shared_native = shared_chunks(shared, block_size, native_work.block_tables)
            return DecodePlan(shared, [], prefill, native_work, shared_native)
    rows.sort(key=lambda r: r.num_blocks)
    table = meta.block_tables.to(torch.long)
    chunks = [
        make_chunk([rows[i] for i in group], table, block_size, window, cdt)
        for group in chunk_rows(rows, block_size * token_bytes, chunk_bytes)
    ]
    return DecodePlan(shared=shared, chunks=chunks, prefill=prefill)


class TorchBackend:
    """CPU implementation of :class:`kernels.registry.AttentionBackend`."""

    name = "torch"

    def __init__(
        self,
        chunk_bytes: int = CHUNK_BYTES,
        shared_prefix: bool = True,
        native: bool | None = None,
        kernel: NativeDecode | None = None,
        tiled_prefill: bool | None = None,
        cascade: CascadePolicy | None = None,
    ) -> None:
        """``native``: decode rows through the C kernel (:mod:`kernels.native`) where it
        covers the dtype and shapes; None uses it when it builds, True requires it (the float32
        cache's build), False keeps every step in torch. ``kernel``: that loaded build instead
        of this machine's default, for caches of its dtype (the tests run another build
        through it; caches of other dtypes then stay in torch). ``tiled_prefill``: the
        prefill chunks that join the C kernel go to its tiled prefill kernel (where the head
        size allows) rather than one decode row per token; None reads
        ``PAGEDSERVE_TILED_PREFILL`` (default on). ``cascade``: with the C kernel, which
        shared prefixes get a cascade group (None: the policy measured for its vector width,
        :func:`cascade_policy`)."""
        self._chunk_bytes = chunk_bytes
        self._shared_prefix = shared_prefix  # False: every decode gathers its whole context
        #: the C kernel per cache dtype (None: that dtype stays in torch); others load lazily
        self._kernels: dict[torch.dtype, NativeDecode | None] = {}
        self._load_kernels = kernel is None and native is not False
        if kernel is not None:
            self._kernels[kernel.kv_dtype] = kernel
        elif self._load_kernels and self._kernel(torch.float32) is None and native:
            raise RuntimeError("the native CPU decode kernel could not be built or loaded")
        loaded = next((k for k in self._kernels.values() if k is not None), None)
        if cascade is None and loaded is not None:
            cascade = cascade_policy(loaded)  # both cache dtypes' builds have one width
        self._cascade = cascade
        if tiled_prefill is None:
            tiled_prefill = not native_kernel.switched_off(native_kernel.TILED_PREFILL_ENV)
        self._tiled_prefill = tiled_prefill
        self._plan_meta: AttentionMetadata | None = None
        self._plan_block_size = 0
        self._plan = StepPlan()
        self._workspace = Workspace()

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store each new token's key and value at its slot (one ``index_copy_`` each)."""
        if key.shape[0] == 0:
            return
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        slots = slot_mapping.to(torch.long)
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))

    def _get_plan(self, meta: AttentionMetadata, block_size: int) -> StepPlan:
        """Plan once per forward pass: the same ``meta`` object comes back for every layer."""
        if meta is self._plan_meta and block_size == self._plan_block_size:
            return self._plan
        plan = build_step_plan(meta)
        self._plan, self._plan_meta, self._plan_block_size = plan, meta, block_size
        return plan

    def _kernel(self, kv_dtype: torch.dtype) -> NativeDecode | None:
        """The C kernel for caches of ``kv_dtype`` (loaded on first use), or None."""
        if kv_dtype not in self._kernels:
            self._kernels[kv_dtype] = native_kernel.load(kv_dtype) if self._load_kernels else None
        return self._kernels[kv_dtype]

    @property
    def uses_native(self) -> bool:
        """Whether float32 CPU decodes over float32 caches go through the C kernel."""
        return self.native_for(torch.float32)

    def native_for(self, kv_dtype: torch.dtype) -> bool:
        """Whether float32 CPU decodes over caches of ``kv_dtype`` go through the C kernel."""
        return self._kernel(kv_dtype) is not None

    def _get_decode_chunks(
        self,
        query: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        window: int | None,
        cdt: torch.dtype,
    ) -> DecodePlan:
        """The step's shared-prefix groups, decode work and prefill work (planned once)."""
        plan = self._get_plan(meta, k_cache.shape[1])
        token_bytes = 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
        key = (window, token_bytes, cdt)
        decode = plan.decode.get(key)
        if decode is None:
            kernel = self._kernel(k_cache.dtype)
            native = kernel is not None and kernel.supports(query, k_cache)
            tiled = (  # `kernel is not None` again only for the type checker
                native
                and self._tiled_prefill
                and kernel is not None
                and kernel.supports_prefill(query, k_cache)
            )
            decode = _make_decode_plan(
                plan,
                meta,
                k_cache.shape[1],
                window,
                token_bytes,
                self._chunk_bytes,
                cdt,
                self._shared_prefix,
                native,
                tiled,
                self._cascade,
            )
            plan.decode[key] = decode
        return decode

    def paged_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Causal attention of each query token over its sequence's cached context."""
        out = torch.empty_like(query)
        if query.shape[0] == 0:
            return out
        cdt = compute_dtype(query.dtype)
        work = self._get_decode_chunks(query, meta, k_cache, sliding_window, cdt)
        kernel = self._kernels.get(k_cache.dtype)  # loaded by the plan when it uses it
        if work.shared_native is not None and kernel is not None:
            shared: tuple[torch.Tensor, torch.Tensor] | None = native_shared_prefixes(
                query, k_cache, v_cache, work.shared_native, scale, kernel
            )
        else:
            shared = shared_prefixes(
                query, k_cache, v_cache, work.shared, scale, cdt, self._workspace
            )
        if work.native is not None:
            assert kernel is not None  # the plan sent rows to it: loaded when planned
            self._native_decode(
                kernel, query, k_cache, v_cache, work.native, scale, sliding_window, out, shared
            )
        for chunk in work.chunks:
            o, lse = decode_chunk(query, k_cache, v_cache, chunk, scale, cdt, self._workspace)
            if chunk.merge is not None and shared is not None:
                o = merge_into(o, lse, chunk.merge, *shared)
            out.index_copy_(0, chunk.token_idx, o.to(query.dtype))
        for pre, pre_work in zip(self._plan.prefill, work.prefill, strict=True):
            if pre_work.native:  # its rows were in the kernel's call above
                continue
            o = prefill_chunk(
                query, key, value, k_cache, v_cache, meta, pre, pre_work, scale, cdt,
                self._workspace,
            )  # fmt: skip
            if pre_work.slots is not None and shared is not None:
                o = merge_into(o[0], o[1], Merge(local=None, slots=pre_work.slots), *shared)
            else:
                o = o[0]
            out[pre.start : pre.start + pre.query_len] = o.to(query.dtype)
        return out

    @staticmethod
    def _native_decode(
        kernel: NativeDecode,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        work: NativeWork,
        scale: float,
        window: int | None,
        out: torch.Tensor,
        shared: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """Every decode row in one C call writing ``out`` (and the prefill chunks in one
        more); a row in a shared-prefix group continues its prefix's result in the kernel."""
        if work.prefill is not None:
            kernel.prefill(query, k_cache, v_cache, work.block_tables, work.prefill, scale, out)
        if work.rows.num_rows == 0:
            return
        lse = torch.empty(work.rows.num_rows, query.shape[1], dtype=torch.float32)
        start = None
        if work.slots is not None and shared is not None:
            # torch's flash call returns transposed views; the C kernel reads by pointer
            start = PrefixStart(shared[0].contiguous(), shared[1].contiguous(), work.slots)
        kernel.decode(
            query, k_cache, v_cache, work.block_tables, work.rows, scale, window, out, lse, start
        )
