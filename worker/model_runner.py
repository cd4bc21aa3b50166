"""SchedulerOutput -> tensors -> one forward pass -> logits of the sequences that sample.

The runner owns the KV cache (one ``[num_blocks, block_size, kv_heads, head_dim]`` pair per layer)
and a persistent block-table tensor: each sequence keeps a row for as long as the runner knows it,
and each step only the new block ids the scheduler sends are written into it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import AttentionMetadata, get_backend
from kernels import gemm as native_gemm
from scheduler.output import SchedulerOutput
from worker.cpu_memory import configure_cpu_process, prepack_enabled, warn_without_huge_pages
from worker.loader import load_model
from worker.models import layers
from worker.models.decoder import CausalLM
from worker.outputs import EngineConfig

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

#: Default KV-cache budget on a CPU when neither num_kv_blocks nor kv_cache_memory is given.
DEFAULT_CPU_KV_BYTES = 2 << 30


@dataclass(slots=True)
class CacheLayout:
    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        dtype = _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(_DTYPES)}") from None
    if device.type == "cpu" and dtype is torch.float16:
        raise ValueError("float16 is not supported on CPU; use float32 or bfloat16")
    return dtype


#: ``--weight-dtype`` values other than ``auto``: the projection weights' format on a CPU.
WEIGHT_FORMATS = ("bfloat16", "int8")


def resolve_weight_dtype(name: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """The projection weights' format (``--weight-dtype``): None (``auto``) keeps the model's
    dtype; ``bfloat16`` or ``int8`` (a scale per 32 inputs of each row,
    :func:`kernels.gemm.quantize_int8`)
    only for a float32 model on a CPU, where the activations around them stay float32."""
    if name == "auto":
        return None
    if name not in WEIGHT_FORMATS:
        raise ValueError(f"unsupported weight dtype {name!r}; use auto, bfloat16 or int8")
    if device.type != "cpu" or dtype is not torch.float32:
        raise ValueError(
            f"--weight-dtype {name} is a CPU mode for float32 models ({name} weights, "
            "float32 activations); on a GPU use --dtype bfloat16"
        )
    if name == "int8":
        if native_gemm.for_packing() is None:
            raise ValueError(
                "--weight-dtype int8 needs the C GEMM (a C compiler; PAGEDSERVE_NATIVE_GEMM and "
                "PAGEDSERVE_NATIVE_KERNELS not 0)"
            )
        return name
    if not layers.bf16_products_available():
        raise ValueError(
            "--weight-dtype bfloat16 needs bfloat16 products, which this CPU lacks: the C "
            "GEMM's bfloat16 path (AVX512-BF16) or torch's oneDNN bfloat16 linear (AVX512BW/VL/"
            "DQ or AVX-NE-CONVERT); use float32 weights or --weight-dtype int8"
        )
    return name


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype (``--kv-cache-dtype``): ``auto`` is the model's; ``bfloat16`` under
    a float32 model halves the cache (twice the tokens in the same memory, half the bytes each
    decode step reads) at the price of keys and values rounded to 8 significant bits."""
    if name == "auto":
        return dtype
    kv = _DTYPES.get(name)
    if kv not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported KV-cache dtype {name!r}; use auto, float32 or bfloat16")
    if device.type == "cpu" and kv is torch.float16:
        raise ValueError("a float16 KV cache is not supported on CPU; use bfloat16")
    if device.type == "cuda" and kv != dtype:
        raise ValueError(
            "on a GPU the KV cache has the model's dtype (--kv-cache-dtype auto); "
            "use --dtype to change both"
        )
    if kv.itemsize > dtype.itemsize:
        raise ValueError(f"a {name} KV cache is wider than the model's {dtype}; use auto")
    return kv


class ModelRunner:
    def __init__(
        self, model_dir: str | Path, config: EngineConfig, max_model_len: int | None = None
    ):
        if torch.device(config.device).type == "cpu":
            tuning = configure_cpu_process()
            log.info("CPU malloc settings: %s", tuning.reason)
            warn_without_huge_pages()
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        weight_fmt = resolve_weight_dtype(config.weight_dtype, self.dtype, self.device)
        self.model: CausalLM = load_model(model_dir, self.dtype, self.device)
        if weight_fmt is not None:
            n = self.model.pack_weights(weight_fmt)
            log.info("packed %d projection weights in %s", n, weight_fmt)
        elif self.device.type == "cpu" and prepack_enabled():
            log.info("packed %d projection weights (C GEMM or oneDNN)", self.model.pack_weights())
            if config.greedy_screen and (kind := self.model.enable_greedy_screen()):
                log.info("greedy rows: the output head screened in %s (exact tokens)", kind)
        mc = self.model.config
        self.max_model_len = min(
            max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        self.block_size = config.block_size
        self.layout = self._plan_cache()
        shape = (self.layout.num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        #: Every layer's key and value cache in one tensor ``[layers, 2, blocks, ...]``, so that a
        #: step's block copies (copy-on-write, the pool's prefix moves) are one gather and one
        #: scatter over all of them, not two of each per layer; the layers get views of it.
        self._cache = torch.zeros(
            (mc.num_layers, 2, *shape), dtype=self.kv_dtype, device=self.device
        )
        self.kv_caches = [(self._cache[i, 0], self._cache[i, 1]) for i in range(mc.num_layers)]
        self.max_blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
        rows = config.max_num_seqs * 2 + 8  # forks can briefly exceed max_num_seqs
        self._tables = torch.zeros((rows, self.max_blocks_per_seq), dtype=torch.int32)
        #: The same memory as a numpy array: a row's new entries are stored from the scheduler's
        #: list directly (a tensor built per changed row cost ~1% of a fast step).
        self._tables_np = self._tables.numpy()
        self._free_rows = list(range(rows - 1, -1, -1))
        self._row_of: dict[int, int] = {}
        log.info(
            "KV cache (%s): %d bytes per token, %d blocks of %d tokens, capacity %d tokens "
            "(%.1f MiB)",
            self.kv_dtype_name,
            self.layout.bytes_per_token,
            self.layout.num_blocks,
            self.block_size,
            self.layout.capacity_tokens,
            self.layout.num_blocks * self.layout.bytes_per_block / 2**20,
        )
        backend = get_backend(self.device)  # built now (a CPU kernel compiles once), not mid-step
        native_for = getattr(backend, "native_for", None)
        native = native_for is not None and native_for(self.kv_dtype)
        log.info("attention: %s backend%s", backend.name, ", C decode kernel" if native else "")

    @property
    def kv_dtype_name(self) -> str:
        """The cache's dtype as ``--kv-cache-dtype`` names it (``float32``, ``bfloat16``)."""
        return str(self.kv_dtype).removeprefix("torch.")

    # ------------------------------------------------------------------ sizing
    def bytes_per_token(self) -> int:
        return self.model.config.kv_cache_bytes_per_token(self.kv_dtype)

    def _plan_cache(self) -> CacheLayout:
        per_token = self.bytes_per_token()
        per_block = per_token * self.block_size
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            blocks = cfg.num_kv_blocks
        elif cfg.kv_cache_memory is not None:
            blocks = cfg.kv_cache_memory // per_block
        elif self.device.type == "cuda":
            blocks = self._profile_cuda_blocks(per_block)
        else:
            # Never reserve more than every sequence at full length could ever use.
            most = cfg.max_num_seqs * math.ceil(self.max_model_len / self.block_size)
            blocks = min(DEFAULT_CPU_KV_BYTES // per_block, most)
        if blocks < 1:
            raise ValueError(
                f"the KV-cache budget holds no block: one block of {self.block_size} tokens "
                f"needs {per_block} bytes"
            )
        return CacheLayout(int(blocks), self.block_size, per_token)

    def _profile_cuda_blocks(self, per_block: int) -> int:
        """Run a worst-case forward pass, then give a fraction of the memory left to the cache."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        mc = self.model.config
        shape = (1, self.block_size, mc.num_kv_heads, mc.head_dim)
        scratch = [
            (torch.zeros(shape, dtype=self.kv_dtype, device=self.device),) * 2
            for _ in range(mc.num_layers)
        ]
        # Profile with a batch of single-token sequences writing into one scratch block.
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=self.device),
            seq_lens=torch.ones(n, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros((n, 1), dtype=torch.int32, device=self.device),
            slot_mapping=torch.zeros(n, dtype=torch.long, device=self.device),
            query_lens_host=[1] * n,
            seq_lens_host=[1] * n,
            max_query_len=1,
            max_seq_len=1,
        )
        hidden = self.model(ids, ids, scratch, meta)
        self.model.compute_logits(hidden[-min(n, self.config.max_num_seqs) :])
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        budget = free - (1 - self.config.gpu_memory_utilization) * total
        del scratch, hidden
        return int(max(0, budget) // per_block)

    # ---------------------------------------------------------------- execution
    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            row = self._row_of.pop(seq_id, None)
            if row is not None:
                self._free_rows.append(row)

    def _update_tables(self, out: SchedulerOutput) -> list[int]:
        rows: list[int] = []
        tables = self._tables_np
        for s in out.scheduled:
            row = self._row_of.get(s.seq_id)
            if row is None:
                row = self._free_rows.pop()
                self._row_of[s.seq_id] = row
            if new := s.new_block_ids:
                tables[row, s.block_offset : s.block_offset + len(new)] = new
            rows.append(row)
        return rows

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """The step's block copies (copy-on-write, moved prefixes), every source read as it was
        before the step. On a CPU one strided copy per block (all layers' keys and values):
        17-78 GB/s on a Zen 4 against 1.2-3 for the gather and scatter, whose middle-dimension
        index ran single-block copies at 1.2 ms for SmolLM2's 737 KB and 600 blocks in 0.3-0.36 s
        (a round of ``mixed`` after the pool turned over copies hundreds). A copy list whose
        destinations include a source (never made by the scheduler) keeps the gather first."""
        cache = self._cache
        srcs = [c[0] for c in copies]
        dsts = [c[1] for c in copies]
        if self.device.type == "cpu" and set(srcs).isdisjoint(dsts):
            for src, dst in copies:
                cache[:, :, dst].copy_(cache[:, :, src])
            return
        src_t = torch.tensor(srcs, dtype=torch.long, device=self.device)
        dst_t = torch.tensor(dsts, dtype=torch.long, device=self.device)
        cache.index_copy_(2, dst_t, cache.index_select(2, src_t))

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, greedy: bool = False
    ) -> torch.Tensor | list[int] | None:
        """Run the step; float32 logits ``[sampling sequences, vocab]``, or None if none samples.
        ``greedy``: every sampling row takes its argmax alone; then, where the model screens its
        head (:meth:`CausalLM.greedy_tokens`), the tokens themselves."""
        self.release(out.released_seq_ids)
        self.release(out.preempted_seq_ids)
        if out.block_copies:
            self._copy_blocks(out.block_copies)
        if not out.scheduled:
            return None
        rows = self._update_tables(out)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        seqlens: list[int] = []
        sample_idx: list[int] = []
        t = 0
        for s in out.scheduled:
            n = len(s.token_ids)
            input_ids += s.token_ids
            if n == 1:
                positions.append(s.start_pos)
            else:
                positions += range(s.start_pos, s.start_pos + n)
            slots += s.slot_mapping
            qlens.append(n)
            seqlens.append(s.start_pos + n)
            t += n
            if s.sample:
                sample_idx.append(t - 1)
        dev = self.device
        max_seq = max(seqlens)
        nblocks = -(-max_seq // self.block_size)
        row_idx = torch.tensor(rows, dtype=torch.long)
        block_tables = self._tables[:, :nblocks].index_select(0, row_idx)
        qsl = [0] * (len(qlens) + 1)
        for i, q in enumerate(qlens):
            qsl[i + 1] = qsl[i] + q
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seqlens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev, non_blocking=True),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_lens_host=qlens,
            seq_lens_host=seqlens,
            max_query_len=max(qlens),
            max_seq_len=max_seq,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
        )
        if not sample_idx:
            return None
        if len(sample_idx) == t:
            picked = hidden
        else:
            picked = hidden.index_select(0, torch.tensor(sample_idx, dtype=torch.long, device=dev))
        if greedy and (tokens := self.model.greedy_tokens(picked)) is not None:
            return tokens
        return self.model.compute_logits(picked)
