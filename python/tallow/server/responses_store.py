"""Finished responses kept for GET /v1/responses/{id} and previous_response_id: a bounded LRU in the API
process (entries and bytes), each response with the whole conversation that produced it (chat messages,
its output included) so that a follow-up continues it and shares the earlier prompt's prefix."""
from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import msgspec

# the one place these bounds are read: a server holds at most this many responses and this many bytes of them
MAX_ENTRIES = 1000
MAX_BYTES = 64 * 2**20


@dataclasses.dataclass
class StoredResponse:
    response: dict  # the Response object as answered
    conversation: list[dict]  # chat messages, instructions excluded (a follow-up brings its own)
    nbytes: int = 0


class ResponseStore:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, response: dict, conversation: list[dict]) -> bool:
        """Keep a response, evicting the least recently used; False when it alone exceeds the byte cap."""
        size = len(msgspec.json.encode(response)) + len(msgspec.json.encode(conversation))
        if size > self.max_bytes:
            return False
        self.delete(rid)
        self._items[rid] = StoredResponse(response, conversation, size)
        self.nbytes += size
        while len(self._items) > self.max_entries or self.nbytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.nbytes -= old.nbytes
        return True

    def get(self, rid: str) -> Optional[StoredResponse]:
        entry = self._items.get(rid)
        if entry is not None:
            self._items.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        entry = self._items.pop(rid, None)
        if entry is None:
            return False
        self.nbytes -= entry.nbytes
        return True
