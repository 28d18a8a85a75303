"""The server's prefix cache: the keys and values of finished requests' prompts, kept so that a later request that
opens with the same tokens (the same system prompt and instruction, a re-asked question, the next turn of a chat)
restores them instead of prefilling them again.

It keeps the positions a prefill wrote, never those that decoding wrote: a runtime may compute prompts and rounds
with different kernels, and a restored position must hold the bits that a prefill of the new prompt would write.
For the same reason both prompts must be long enough to run as prompts (the pool's ``prompt_positions``), the rest
of the new one runs as its whole prefill would (its row's ``restored``), and the cache is made only over a pool
whose rows are computed as they are alone (``pass_invariant``): there a restored prefix changes no token
(tests/test_prefix_cache.py).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from exactspec.backends.base import KeepsPrefixes, Pool, Slot, common_prefix_length, declares
from exactspec.cores import beyond_memory, usable_memory
from exactspec.logs import detail, notice

MIN_REUSED = 16  # fewer shared tokens than this are prefilled: a copy is not worth its bookkeeping


class PrefixCache:
    """Prompts' cached positions, up to ``capacity_bytes`` of keys and values, the least recently used forgotten
    first. Used from the scheduler's thread only."""

    def __init__(self, pool: KeepsPrefixes, capacity_bytes: int) -> None:
        self.pool = pool
        self.capacity_bytes = capacity_bytes
        self.bytes = 0
        self._kept: OrderedDict[int, tuple[list[int], torch.Tensor]] = OrderedDict()  # id -> (tokens, cache)
        self._ids = 0

    def keep(self, slot: Slot, prompt: list[int]) -> None:
        """Keep the prompt's cached positions (all but its last token, which a step scored) from the slot of a
        request that ends; a prompt that a kept one already opens supersedes it."""
        length = len(prompt) - 1
        if length < max(MIN_REUSED, self.pool.prompt_positions) or slot.length < length:
            return
        tokens = prompt[:length]
        for key, (kept, _) in list(self._kept.items()):
            shared = common_prefix_length(kept, tokens)
            if shared == length:  # already held
                self._kept.move_to_end(key)
                return
            if shared == len(kept):  # holds all that one held, and more
                self._forget(key)
        cache = self.pool.copy_out(slot, length)
        size = cache.numel() * cache.element_size()
        if size > self.capacity_bytes:
            return
        while self.bytes + size > self.capacity_bytes:
            self._forget(next(iter(self._kept)))
        self._ids += 1
        self._kept[self._ids] = (tokens, cache)
        self.bytes += size

    def restore(self, slot: Slot, context: list[int]) -> int:
        """Restore into the (empty) slot the longest kept prefix of ``context`` less its last token (which a step
        scores): how many positions it now holds (0 where none is worth restoring)."""
        most = len(context) - 1
        if most < max(MIN_REUSED, self.pool.prompt_positions) or not self._kept:
            return 0
        tokens = context[:most]
        best, shared = max(((key, common_prefix_length(kept, tokens)) for key, (kept, _) in self._kept.items()),
                           key=lambda pair: pair[1])
        if shared < MIN_REUSED:
            return 0
        self._kept.move_to_end(best)
        self.pool.copy_in(slot, self._kept[best][1], shared)
        return shared

    def _forget(self, key: int) -> None:
        _, cache = self._kept.pop(key)
        self.bytes -= cache.numel() * cache.element_size()


def prefix_cache(pool: Pool, capacity_mib: int, capacity_tokens: int | None = None, context: int = 0
                 ) -> PrefixCache | None:
    """A prefix cache over the pool of ``capacity_tokens`` prompt tokens where given, else ``capacity_mib`` MiB, or
    None where it is off (a capacity of 0), the pool cannot copy its slots, or its rows depend on the pass (a
    restored prefix could then change a token). One line says how many tokens it holds, and warns where that is
    less than one prompt of the ``context``'s length (a cache that holds no prompt never restores one); a size
    beyond the machine's memory is refused (:func:`check_fits`)."""
    if (capacity_tokens if capacity_tokens is not None else capacity_mib) <= 0 or not declares(pool, KeepsPrefixes) \
            or not pool.pass_invariant:
        return None
    per_token = pool.position_bytes
    capacity = capacity_tokens * per_token if capacity_tokens is not None else capacity_mib << 20
    tokens = capacity // per_token
    check_fits(capacity, per_token, capacity_tokens is not None)
    said = f"the prefix cache holds {tokens} tokens of prompts ({capacity / 2**20:.0f} MiB, {per_token} bytes a token)"
    if tokens < context:
        notice(f"{said}: under one prompt of the context's {context} tokens, which needs "
               f"{-(-context * per_token // 2**20)} MiB (--prefix-cache-mib) or --prefix-cache-tokens {context}")
    else:
        detail(said)
    return PrefixCache(pool, capacity)


def check_fits(capacity: int, per_token: int, in_tokens: bool) -> None:
    """Refuse, in one line naming the largest size that fits, a cache larger than this machine's memory (its cgroup's
    limit, where lower): it could never be held, whatever else the machine held (``--prefix-cache-tokens
    1000000000000`` started, and said it held 43,945,312,500 MiB). ``in_tokens``: the size was given in tokens."""
    memory = usable_memory()
    if capacity <= memory:
        return
    flag, largest = ("--prefix-cache-tokens", memory // per_token) if in_tokens else \
        ("--prefix-cache-mib", memory >> 20)
    raise beyond_memory(f"a prefix cache of {capacity // per_token:,} tokens ({per_token} bytes a token)", capacity,
                        f"lower {flag} to {largest} or less (this machine's memory, {memory / 2**30:.1f} GiB, in all)")
