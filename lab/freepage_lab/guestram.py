"""Guest RAM as the host sees it: two dumps compared page by page."""

from __future__ import annotations

import mmap
from pathlib import Path


def differing_pages(a: Path, b: Path, limit: int = 5) -> tuple[int, list[int]]:
    """4 KiB pages in which two guest memory dumps differ (count, first GPAs)."""
    count, first = 0, list[int]()
    with open(a, "rb") as fa, open(b, "rb") as fb:
        ma = mmap.mmap(fa.fileno(), 0, access=mmap.ACCESS_READ)
        mb = mmap.mmap(fb.fileno(), 0, access=mmap.ACCESS_READ)
        assert len(ma) == len(mb), (len(ma), len(mb))
        chunk = 1 << 24
        for off in range(0, len(ma), chunk):
            if ma[off:off + chunk] == mb[off:off + chunk]:
                continue
            for page in range(off, min(off + chunk, len(ma)), 4096):
                if ma[page:page + 4096] != mb[page:page + 4096]:
                    count += 1
                    if len(first) < limit:
                        first.append(page)
        ma.close()
        mb.close()
    return count, first
