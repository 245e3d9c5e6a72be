"""The coordinator's book of every stage's KV pages: which are free, which sequences use which,
and which full pages hold a known prefix that a later request may reuse.

Every stage has a pool of the same number of pages (kvcache.KVCache); the coordinator decides
which page holds what and sends each row's page table with every step, so the stages never
disagree. A full page is known by a hash of its tokens chained with the hash of the page
before it, so equal hashes mean equal prefixes. A page another sequence may read is never
written again: a sequence reuses only full pages before the one holding its last prompt token.

Pages no sequence uses but that hold a known prefix stay cached until their page is needed;
then the least recently used goes first.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict

from ..enums import PAGE


def prefix_hashes(tokens: list[int], n_pages: int, known: list[bytes] | None = None) -> list[bytes]:
    """The chained hashes of the first `n_pages` full pages of `tokens`, extending `known`."""
    out = list(known or [])
    for i in range(len(out), n_pages):
        h = hashlib.blake2b(out[-1] if out else b"", digest_size=16)
        h.update(b"".join(t.to_bytes(4, "little") for t in tokens[i * PAGE : (i + 1) * PAGE]))
        out.append(h.digest())
    return out


class PagePool:
    def __init__(self, n_pages: int):
        self.n_pages = n_pages
        self._free = list(range(n_pages))  # a heap: the lowest first, so the stages' pools stay small
        self._refs = [0] * n_pages
        self._hash_of: dict[int, bytes] = {}  # page -> the prefix it holds
        self._page_of: dict[bytes, int] = {}  # prefix -> its page, once the stages computed it
        self._pending: dict[bytes, int] = {}  # prefix -> its page, while the step computing it is out
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached pages nobody uses, oldest first
        self.hits = self.misses = 0  # prompt tokens found cached, and not

    @property
    def available(self) -> int:
        return len(self._free) + len(self._idle)

    @property
    def cached(self) -> int:
        return len(self._page_of)

    def in_use(self) -> int:
        return self.n_pages - self.available

    def match(self, hashes: list[bytes]) -> tuple[list[int], bool]:
        """The pages of the longest cached run of these prefix hashes, and whether the next one
        is being computed right now (a request that waits for it reuses it instead of computing
        it twice). The pages are not taken."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                return pages, h in self._pending
            pages.append(page)
        return pages, False

    def take(self, pages: list[int]) -> None:
        for page in pages:
            self._refs[page] += 1
            self._idle.pop(page, None)

    def allocate(self, n: int) -> list[int] | None:
        """`n` pages for one sequence's new positions (free ones first, then the least recently
        used cached ones), or None, taking nothing, when the pool has fewer."""
        if n > self.available:
            return None
        out = []
        for _ in range(n):
            if self._free:
                page = heapq.heappop(self._free)
            else:
                page, _ = self._idle.popitem(last=False)
                self._forget(page)
            self._refs[page] = 1
            out.append(page)
        return out

    def release(self, pages: list[int]) -> None:
        for page in pages:
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            if self._page_of.get(self._hash_of.get(page)) == page:
                self._idle[page] = None
            else:
                self._forget(page)
                heapq.heappush(self._free, page)

    def computing(self, hashes: list[bytes], pages: list[int]) -> None:
        """Full pages a step now in flight fills (hash i for page i)."""
        for h, page in zip(hashes, pages):
            if h not in self._page_of and h not in self._pending and page not in self._hash_of:
                self._pending[h] = page
                self._hash_of[page] = h

    def computed(self, hashes: list[bytes], ok: bool) -> None:
        """The step filling these pages came back: they hold their prefixes now (ok), or may hold
        anything (a failed step)."""
        for h in hashes:
            page = self._pending.pop(h, None)
            if page is None:
                continue
            if ok:
                self._page_of[h] = page
            else:
                del self._hash_of[page]

    def _forget(self, page: int) -> None:
        h = self._hash_of.pop(page, None)
        if h is not None and self._page_of.get(h) == page:
            del self._page_of[h]
        if h is not None and self._pending.get(h) == page:
            del self._pending[h]

    def reset(self) -> None:
        """The stages' pools were rebuilt empty (a recovery): every page is free and holds nothing."""
        hits, misses = self.hits, self.misses
        self.__init__(self.n_pages)
        self.hits, self.misses = hits, misses

    def stats(self) -> dict:
        return {
            "pages": self.n_pages,
            "page_tokens": PAGE,
            "in_use": self.in_use(),
            "free": len(self._free),
            "idle": len(self._idle),  # hold a cached prefix nobody uses; taken last
            "cached": self.cached,
            "hit_tokens": self.hits,
            "miss_tokens": self.misses,
        }
