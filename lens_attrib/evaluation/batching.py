"""Batch plans sorted by length, shards of whole batches, and batch sizes found by halving.

:func:`plan_chunks` sorts the dataset by token length (ties by index), cuts it into chunks of
``batch_size`` items and gives chunk ``j`` to shard ``j mod n``. Every item is therefore computed
in the same batch whatever the number of shards or ranks, so a sharded or distributed run gives
exactly the records of one process, and padding is minimal (neighbours have similar lengths).

:class:`BatchSizer` runs a chunk in sub-batches. With a fixed size the sub-batch is the chunk.
With ``auto`` it tries the largest size first and halves it on out-of-memory (``MemoryError``
— what the method registry turns an allocation failure into — or ``torch.OutOfMemoryError``,
which CUDA raises), remembering the size that worked per method and length bucket (the next
power of two of the chunk's longest item), the approach of Accelerate's
``find_executable_batch_size``.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

LOG = logging.getLogger("lens_attrib.evaluation")
OOM_ERRORS = (MemoryError, torch.OutOfMemoryError)
T = TypeVar("T")


@dataclass(frozen=True)
class Chunk:
    """One planned batch: its position in the plan, dataset indices and length bucket."""

    index: int
    items: tuple[int, ...]
    bucket: int


def bucket_of(length: int) -> int:
    """The length bucket: the next power of two ≥ ``length``."""
    return 1 << max(0, int(length) - 1).bit_length()


def plan_chunks(
    lengths: Sequence[int], batch_size: int, shard: tuple[int, int] | None = None
) -> list[Chunk]:
    """Chunks of ``batch_size`` items in (length, index) order; ``shard=(i, n)``: every n-th."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if shard is not None and not 0 <= shard[0] < shard[1]:
        raise ValueError(f"shard must be (i, n) with 0 <= i < n, got {shard}")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    chunks = []
    for j, start in enumerate(range(0, len(order), batch_size)):
        items = tuple(order[start : start + batch_size])
        chunks.append(Chunk(j, items, bucket_of(max(lengths[i] for i in items))))
    if shard is None:
        return chunks
    return [c for c in chunks if c.index % shard[1] == shard[0]]


@dataclass
class BatchSizer:
    """Sub-batches of at most ``ceiling`` items; ``auto``: halved on out-of-memory."""

    ceiling: int
    auto: bool = False
    found: dict[tuple[str, int], int] = field(default_factory=dict)

    def size_for(self, method: str, bucket: int) -> int:
        return self.found.get((method, bucket), self.ceiling) if self.auto else self.ceiling

    def run(
        self, method: str, bucket: int, items: Sequence[int], fn: Callable[[list[int]], T]
    ) -> Iterator[tuple[list[int], T, int]]:
        """Yield ``(sub_items, fn(sub_items), size)`` for consecutive sub-batches of ``items``."""
        size = self.size_for(method, bucket)
        start = 0
        while start < len(items):
            sub = list(items[start : start + size])
            try:
                out = fn(sub)
            except OOM_ERRORS as err:
                if not self.auto or size == 1:
                    raise
                size = max(1, min(size, len(sub)) // 2)
                LOG.info(
                    "%s, ≤%d tokens: out of memory at batch %d (%s); trying %d",
                    method,
                    bucket,
                    len(sub),
                    type(err).__name__,
                    size,
                )
                del err
                _free_memory()
                continue
            if self.auto and (method, bucket) not in self.found:
                LOG.info("%s, ≤%d tokens: batch %d", method, bucket, size)
            if self.auto:
                self.found[(method, bucket)] = size
            yield sub, out, size
            start += len(sub)

    def report(self) -> dict[str, dict[str, int]]:
        """The batch sizes used: ``{method: {bucket: size}}`` (JSON-ready)."""
        out: dict[str, dict[str, int]] = {}
        for (method, bucket), size in sorted(self.found.items()):
            out.setdefault(method, {})[str(bucket)] = size
        return out


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


__all__ = ["OOM_ERRORS", "BatchSizer", "Chunk", "bucket_of", "plan_chunks"]
