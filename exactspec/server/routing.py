"""Which replica a request goes to under ``exactspec serve --replicas N`` (``--replica-routing prefix``): the one
that most likely holds its prompt's opening, so that its prefix cache restores it and its suffix index has learnt
the conversation so far; else the least loaded.

A request's prompt is read as a chain of blocks: a chat's messages one by one (the system prompt, then each earlier
turn), a text prompt's characters 64 at a time, a token prompt's ids 16 at a time. Each block's key is a hash of
the prompt up to its end (:func:`prefix_keys`), so two prompts share a key exactly where they share all before it.
The replica a request was routed to is remembered for each of its keys (:class:`PrefixAffinity`); the next turn of a
conversation, whose prompt opens with the last one's, finds the last turn's keys among its own and goes where it
went, unless that replica is busier than the least loaded one by more than ``max_imbalance`` requests in flight.

Nothing here knows Ray: ``prefix_router.py`` hands Ray's request router these choices, ``forwarding.py`` reads the
body that they are made from.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence

BLOCK_CHARACTERS = 64  # a text prompt's block: about 16 tokens, the least the prefix cache restores (MIN_REUSED)
BLOCK_TOKENS = 16  # a token prompt's block
MAX_BLOCKS = 256  # blocks read of one prompt: prompts that share the first 256 are routed alike
MAX_IMBALANCE = 4  # requests in flight the holder of a prefix may have over the least loaded replica
AFFINITY_CAPACITY = 1 << 16  # keys remembered, those routed least recently forgotten first

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


def prefix_keys(path: str, body: bytes) -> tuple[str, ...]:
    """The keys of a request's prompt blocks, the prompt's opening first; none where the body holds no prompt that
    can be read (the replica then answers what is wrong with it)."""
    try:
        request = json.loads(body)
    except ValueError:  # not JSON, or not UTF-8
        return ()
    if not isinstance(request, dict):
        return ()
    if path == CHAT_PATH:
        return chained_keys(message_blocks(request.get("messages")))
    if path == COMPLETIONS_PATH:
        return chained_keys(prompt_blocks(request.get("prompt")))
    return ()


def message_blocks(messages: object) -> list[bytes]:
    """A chat's messages, one block each, as canonical JSON."""
    if not isinstance(messages, list):
        return []
    return [json.dumps(message, sort_keys=True, ensure_ascii=False).encode() for message in messages[:MAX_BLOCKS]]


def prompt_blocks(prompt: object) -> list[bytes]:
    """A text prompt's whole blocks of characters, or a token prompt's whole blocks of ids (a last part block is
    left out: a longer prompt that opens with this one holds it in a block with more)."""
    if isinstance(prompt, str):
        pieces, size = prompt, BLOCK_CHARACTERS
    elif isinstance(prompt, list) and all(isinstance(token, int) for token in prompt):
        pieces, size = prompt, BLOCK_TOKENS
    else:
        return []
    count = min(len(pieces) // size, MAX_BLOCKS)
    return [str(pieces[i * size:(i + 1) * size]).encode() for i in range(count)]


def chained_keys(blocks: Sequence[bytes]) -> tuple[str, ...]:
    """Each block's key: a hash of every block up to it and its own, each taken with its length."""
    running = hashlib.blake2b(digest_size=8)
    keys = []
    for block in blocks:
        running.update(len(block).to_bytes(8, "little"))
        running.update(block)
        keys.append(running.copy().hexdigest())
    return tuple(keys)


class PrefixAffinity:
    """The replica each prefix key was last routed to, and the order in which to offer a request to the replicas.
    Replicas are any hashable names; a replica gone is passed over (it is not among the ``loads`` given)."""

    def __init__(self, capacity: int = AFFINITY_CAPACITY, max_imbalance: int = MAX_IMBALANCE) -> None:
        self.capacity = capacity
        self.max_imbalance = max_imbalance
        self._holders: OrderedDict[str, Hashable] = OrderedDict()  # key -> the replica it was last routed to
        self._last_routed: dict[Hashable, int] = {}  # replica -> the count of requests routed when it last had one
        self._routed = 0

    def holder(self, keys: Sequence[str], replicas: Mapping[Hashable, object]) -> Hashable | None:
        """The replica among ``replicas`` that the longest prefix of these keys was routed to, or None."""
        for key in reversed(keys):
            replica = self._holders.get(key)
            if replica is not None and replica in replicas:
                return replica
        return None

    def preference(self, keys: Sequence[str], loads: Mapping[Hashable, int]) -> list[Hashable]:
        """The replicas of ``loads`` (each with its requests in flight), best first: the holder of the longest
        prefix where it has at most ``max_imbalance`` requests more than the least loaded; then the others from the
        least loaded, of equal loads the one that was routed a request longest ago first (so that new
        conversations spread)."""
        order = sorted(loads, key=lambda replica: (loads[replica], self._last_routed.get(replica, -1)))
        holder = self.holder(keys, loads)
        if holder is not None and loads[holder] - loads[order[0]] <= self.max_imbalance:
            order.remove(holder)
            order.insert(0, holder)
        return order

    def routed(self, keys: Sequence[str], replica: Hashable) -> None:
        """A request with these keys went to ``replica``: the next that opens with them follows it there."""
        self._routed += 1
        self._last_routed[replica] = self._routed
        for key in keys:
            self._holders[key] = replica
            self._holders.move_to_end(key)
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)
