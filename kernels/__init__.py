"""Paged-attention kernels: the contract every backend keeps.

Cache layout (one pair per layer)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

A token's *slot* is ``block_id * block_size + offset_in_block``; ``slot_mapping[i]`` says where
token ``i`` of the flat batch stores its key and value.

A step's batch is *flat*: the query tokens of every scheduled sequence are concatenated
(``query_start_loc`` marks where each sequence's tokens begin). Sequence ``b`` computes
``query_lens[b]`` new tokens whose positions are ``seq_lens[b] - query_lens[b] .. seq_lens[b]-1``;
everything before them is already in the cache (earlier chunks, earlier decode steps, or prefix
cache hits). Attention is causal: query token at position ``p`` sees cache positions ``<= p``
(and ``> p - sliding_window`` when a window is set).

Backends (``kernels.torch_backend`` for CPUs, ``kernels.triton_backend`` for GPUs) expose the same
two functions; :func:`get_backend` picks one once per device. On a CPU, float32 decode tokens go
through a small C kernel (``kernels/csrc/paged_decode.c``, built at first use by
``kernels.native``) that reads each cached key and value once; everything else, and every decode
when no C compiler is present (or ``PAGEDSERVE_NATIVE_KERNELS=0``), runs in plain torch.
"""

from __future__ import annotations

from kernels.metadata import AttentionMetadata
from kernels.registry import AttentionBackend, get_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]
