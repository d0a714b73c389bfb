"""Finished responses kept for GET /v1/responses/{id} and previous_response_id, each with the whole
conversation that produced it (chat messages, its output included) so that a follow-up continues it and
shares the earlier prompt's prefix. One API process: a bounded LRU in memory (entries and bytes). Several
(`--api-server-count N`, one port): a follow-up may reach any of them, so they share one on-disk store
(diskcache: process-safe, least-recently-used eviction by bytes) in the directory tallow serve makes
(TALLOW_RESPONSES_DIR)."""
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
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES, directory: Optional[str] = None):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self.nbytes = 0
        self._disk = None
        if directory:
            import diskcache

            self._disk = diskcache.Cache(directory, size_limit=max_bytes, eviction_policy="least-recently-used")

    @classmethod
    def for_this_process(cls) -> "ResponseStore":
        """The shared on-disk store when tallow serve runs several API processes, else one in memory."""
        from tallow import envs

        return cls(directory=envs.TALLOW_RESPONSES_DIR)

    def __len__(self) -> int:
        return len(self._disk) if self._disk is not None else len(self._items)

    def put(self, rid: str, response: dict, conversation: list[dict]) -> bool:
        """Keep a response, evicting the least recently used; False when it alone exceeds the byte cap."""
        size = len(msgspec.json.encode(response)) + len(msgspec.json.encode(conversation))
        if size > self.max_bytes:
            return False
        if self._disk is not None:
            self._disk.set(rid, msgspec.msgpack.encode((response, conversation)))
            return True
        self.delete(rid)
        self._items[rid] = StoredResponse(response, conversation, size)
        self.nbytes += size
        while len(self._items) > self.max_entries or self.nbytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.nbytes -= old.nbytes
        return True

    def get(self, rid: str) -> Optional[StoredResponse]:
        if self._disk is not None:
            raw = self._disk.get(rid)
            if raw is None:
                return None
            response, conversation = msgspec.msgpack.decode(raw)
            return StoredResponse(response, conversation, len(raw))
        entry = self._items.get(rid)
        if entry is not None:
            self._items.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        if self._disk is not None:
            return bool(self._disk.delete(rid))
        entry = self._items.pop(rid, None)
        if entry is None:
            return False
        self.nbytes -= entry.nbytes
        return True
