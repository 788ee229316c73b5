"""Prefix cache: KV of full prompt blocks, kept in a pool of fixed-size pages and reused.

A prompt is cut into blocks of ``block_size`` tokens. Block j is named by a hash chain,
``h_j = SHA-256(h_{j-1} || mode || token ids of block j)`` (vLLM's block hashing), so a name
covers the whole prefix up to the end of the block. After a request's prompt has been
prefilled its full blocks are copied from its cache slot into pages of the pool; a later
prompt that starts with the same blocks copies them back into its slot and prefills only
the rest (at least its last token, whose logits start generation).

Why a hit changes no bit in batch-invariant mode: the k/v at position p depend only on the
tokens 0..p (causal attention, row-wise kernels), and the invariant kernels make them a
function of those tokens alone; so the cached bytes are exactly what a cold prefill would
write. The mode is part of the block name, so pages written by the fast path (whose k/v
do depend on the batch) never serve an invariant request.

The pool is per layer ``[pages, Hkv, block_size, D]`` for k and for v, allocated on first
use; pages are evicted least recently used. The live KV of running sequences stays in the
engine's per-slot cache (``model.KVCache``), so decode attention and its CUDA graphs read
one contiguous slot per row; a hit costs one copy of the prefix per layer.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from workers.engine.model import KVCache

__all__ = ["PrefixCache", "PrefixCacheStats", "block_hashes"]


def block_hashes(tokens: Sequence[int], block_size: int, mode: str) -> list[bytes]:
    """Hash-chain names of the full blocks of ``tokens``."""
    names, previous = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start:start + block_size]
        h = hashlib.sha256(previous)
        h.update(mode.encode())
        h.update(b"".join(int(t).to_bytes(4, "little") for t in block))
        previous = h.digest()
        names.append(previous)
    return names


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hit_tokens: int = 0            # prompt tokens served from the cache
    looked_up_tokens: int = 0      # prompt tokens of every lookup
    stored_blocks: int = 0
    evicted_blocks: int = 0


class PrefixCache:
    """``pages`` pages of ``block_size`` tokens of k/v for every layer."""

    def __init__(self, pages: int, block_size: int = 16) -> None:
        assert pages >= 1 and block_size >= 1, "pages and block_size must be >= 1"
        self.pages, self.block_size = pages, block_size
        self.stats = PrefixCacheStats()
        self._kv: Tensor | None = None     # [2, layers, pages, Hkv, block_size, D] (k, v)
        self._index: OrderedDict[bytes, int] = OrderedDict()    # name -> page, LRU first
        self._free: list[int] = list(range(pages - 1, -1, -1))

    def clear(self) -> None:
        self._index.clear()
        self._free = list(range(self.pages - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._index)

    def _pool(self, cache: KVCache) -> Tensor:
        two, layers, _, hkv, _, d = cache.kv.shape
        shape = (two, layers, self.pages, hkv, self.block_size, d)
        kv = self._kv
        if kv is None or kv.shape != shape or kv.dtype != cache.kv.dtype \
                or kv.device != cache.kv.device:
            kv = self._kv = torch.zeros(shape, dtype=cache.kv.dtype, device=cache.kv.device)
            self.clear()
        return kv

    def lookup(self, tokens: Sequence[int], mode: str) -> list[int]:
        """Pages holding the longest cached prefix of ``tokens`` (full blocks only, and at
        least one token left to prefill)."""
        usable = (len(tokens) - 1) // self.block_size
        names = block_hashes(tokens[:usable * self.block_size], self.block_size, mode)
        pages = []
        for name in names:
            page = self._index.get(name)
            if page is None:
                break
            self._index.move_to_end(name)
            pages.append(page)
        self.stats.lookups += 1
        self.stats.looked_up_tokens += len(tokens)
        self.stats.hit_tokens += len(pages) * self.block_size
        return pages

    def load(self, cache: KVCache, slot: int, pages: list[int]) -> None:
        """Copy ``pages`` into ``slot`` at positions 0..len(pages)*block_size-1."""
        if not pages:
            return
        pool = self._pool(cache)
        n = len(pages) * self.block_size
        # (not torch.tensor(..., device=): its copy waits for the device; this one does not)
        index = torch.tensor(pages).to(cache.kv.device, non_blocking=True)
        blocks = pool[:, :, index]                             # [2, L, P, Hkv, bs, D]
        two, layers, _, hkv, _, d = blocks.shape
        cache.kv[:, :, slot, :, :n] = blocks.permute(0, 1, 3, 2, 4, 5).reshape(
            two, layers, hkv, n, d)                            # [2, L, Hkv, n, D]

    def store(self, cache: KVCache, slot: int, tokens: Sequence[int], mode: str) -> None:
        """Keep the full blocks of a prefilled prompt (in ``slot``) that are not cached."""
        pool = self._pool(cache)
        bs = self.block_size
        new_blocks, new_pages = [], []
        # At most ``pages`` blocks: then eviction can never take a page this call assigned.
        for j, name in enumerate(block_hashes(tokens, bs, mode)[:self.pages]):
            if name in self._index:
                self._index.move_to_end(name)
                continue
            if self._free:
                page = self._free.pop()
            else:
                _, page = self._index.popitem(last=False)
                self.stats.evicted_blocks += 1
            self._index[name] = page
            new_blocks.append(j)
            new_pages.append(page)
            self.stats.stored_blocks += 1
        if not new_blocks:
            return
        both = torch.tensor(new_blocks + new_pages).to(cache.kv.device, non_blocking=True)
        blocks, pages = both[:len(new_blocks)], both[len(new_blocks):]
        n = (new_blocks[-1] + 1) * bs
        two, layers, _, hkv, _, d = cache.kv.shape
        prefix = cache.kv[:, :, slot, :, :n].reshape(two, layers, hkv, n // bs, bs, d)
        pool[:, :, pages] = prefix.permute(0, 1, 3, 2, 4, 5)[:, :, blocks]  # [2, L, P, Hkv, bs, D]
