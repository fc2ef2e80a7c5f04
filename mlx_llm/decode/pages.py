"""The engine's page book-keeping on the host: which pages are free, who holds each one, which hold a known prefix.

The pool's pages (``cache.Pages``: ``count`` pages of ``size`` positions, page 0 the padding page) are handed out
one at a time. A page has a reference count: every sequence whose page table lists it holds one reference, so
the replies of one request, and requests with a common prefix, share their prompt's pages.

Prefix caching. A *full* page of a sequence — ``size`` computed positions — is named by a hash chain over the
tokens: page i's key is a digest of page i − 1's key and page i's tokens, so a key names the whole prefix up to
and including that page (two prompts that share a page's tokens but not what comes before get different keys).
``register`` records a full page under its key; ``lookup`` returns the longest run of registered pages that
starts a new token sequence, and the engine shares them instead of recomputing them. A page whose last
reference is released keeps its contents and its key until it is needed: such pages form a least-recently-used
list, and ``allocate`` takes a never-registered free page first and otherwise evicts the least recently used.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from mlx_llm.decode.cache import PADDING_PAGE, Pages

ROOT = b""  # the key before the first page


def page_keys(tokens, size: int, parent: bytes = ROOT) -> list[bytes]:
    """The hash-chain keys of the full pages of ``tokens`` (len // size of them), the first after ``parent``."""
    keys = []
    for i in range(len(tokens) // size):
        chunk = np.asarray(tokens[i * size:(i + 1) * size], np.int64).tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        keys.append(parent)
    return keys


class PageTable:
    """The pool's pages on the host: free, held (with a reference count) or cached (free, contents kept)."""

    def __init__(self, pages: Pages, *, caching: bool):
        self.pages, self.caching = pages, caching
        self.refs = np.zeros(pages.count, np.int64)
        self.free = collections.deque(p for p in range(pages.count) if p != PADDING_PAGE)
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unreferenced pages
        self.by_key: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.hits = self.lookups = 0  # pages found / pages looked up (the prefix-cache hit rate)

    @property
    def available(self) -> int:
        """Pages ``allocate`` can hand out now (free, or cached and unreferenced)."""
        return len(self.free) + len(self.lru)

    def allocate(self) -> int:
        """A page for one holder (reference count 1): a free page, else the least recently used cached one."""
        if self.free:
            page = self.free.popleft()
        elif self.lru:
            page, _ = self.lru.popitem(last=False)
            del self.by_key[self.key_of.pop(page)]
        else:
            raise RuntimeError("the page pool is exhausted (the scheduler checks available first)")
        self.refs[page] = 1
        return page

    def share(self, page: int) -> None:
        """One more holder of ``page`` (a reply of the same request, a prefix-cache hit)."""
        if self.refs[page] == 0:
            self.lru.pop(page)
        self.refs[page] += 1

    def release(self, page: int) -> None:
        """One holder fewer; an unreferenced page is free again (cached pages keep their contents for a hit)."""
        self.refs[page] -= 1
        assert self.refs[page] >= 0, page
        if self.refs[page] == 0:
            if page in self.key_of:
                self.lru[page] = None
            else:
                self.free.append(page)

    def register(self, page: int, key: bytes) -> None:
        """Record the full page ``page`` as the one holding the prefix named ``key`` (the first holder stays)."""
        if self.caching and key not in self.by_key and page not in self.key_of:
            self.by_key[key] = page
            self.key_of[page] = key

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The registered pages of the longest prefix of ``keys`` (not yet shared: the caller shares them)."""
        found = []
        if self.caching:
            for key in keys:
                page = self.by_key.get(key)
                if page is None:
                    break
                found.append(page)
            self.lookups += len(keys)
            self.hits += len(found)
        return found
