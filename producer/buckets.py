"""Length buckets: group samples of similar length into forward batches under a token budget.

Why: the target forward runs on padded [rows, length] batches. Grouping samples by length keeps padding
(wasted target FLOPs) small, and bounding rows x length by a token budget keeps activation memory flat
whatever the length. Buckets are geometric: `buckets_per_octave` per doubling of length (width 16 around
256 tokens, 128 around 2-4K with the defaults), so the spread inside a bucket is a fixed fraction of the
length. Within a bucket a pool of several batches' worth of samples is sorted by length before it is cut
into batches, and each batch is padded only to its longest sample rounded up to `pad_multiple`, so batch
shapes come from a small fixed set and padding is a few tokens per row (measured: ~0.6-0.9 % on
lognormal/uniform length mixes of 20K samples, docs/producer.md). Packing would waste nothing but needs document masking in the target's attention
(and position resets) for every architecture; buckets keep the capture exactly the target's own forward.

Right padding with a causal model needs no attention mask: real tokens only attend to earlier, real
tokens, so their hidden states equal the unpadded forward's (see capture.py).

``fixed_shapes`` (the compiled trunk's static-shape mode, producer/trunk.py) pads every batch to its
bucket's own shape instead: length = the bucket's upper bound, rows = `rows_per_batch(bucket)` (the extra
rows are all padding), so each bucket is exactly one tensor shape and a statically compiled graph per
bucket never recompiles. That costs padding (a whole bucket width per row, and padding rows in the last,
partial batches), so the static mode uses coarser buckets (`compile_plan.static_buckets`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from dflash.common.cli.flags import flag

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class BucketConfig:
    """How samples are grouped into target forward batches."""

    batch_tokens: int = 32768
    """padded tokens per target forward: rows x bucket length (one sample longer than this runs alone)"""
    buckets_per_octave: int = field(default=16, metadata=flag(cli=False))
    """Buckets per doubling of length (a power of two): width = 2**floor(log2(n-1)) / this."""
    min_width: int = field(default=16, metadata=flag(cli=False))
    """Smallest bucket width in tokens (a power of two, a multiple of pad_multiple)."""
    pad_multiple: int = field(default=8, metadata=flag(cli=False))
    """A batch is padded to its longest sample rounded up to this."""
    pool_batches: int = field(default=4, metadata=flag(cli=False))
    """Batches' worth of samples pooled per bucket and sorted by length before cutting batches."""
    fixed_shapes: bool = field(default=False, metadata=flag(cli=False))
    """Pad every batch to its bucket's shape: [rows_per_batch(bucket), bucket] (static compiled graphs)."""
    round_rows: bool = field(default=False, metadata=flag(cli=False))
    """Row counts are powers of two: a full batch has the largest that fits ``batch_tokens``, a partial
    one is padded with empty rows up to the next. fla's kernels compile and autotune per row count: a
    hybrid target then sees about ten, all warmed before producing (producer/trunk.py)."""

    def __post_init__(self) -> None:
        if self.batch_tokens < 1:
            raise ValueError(f"BucketConfig.batch_tokens={self.batch_tokens}: must be >= 1")
        for name in ("buckets_per_octave", "min_width"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"BucketConfig.{name}={v}: must be a power of two")
        if self.pad_multiple < 1 or self.min_width % self.pad_multiple:
            raise ValueError(
                f"BucketConfig.pad_multiple={self.pad_multiple}: must be >= 1 and divide min_width={self.min_width}"
            )
        if self.pool_batches < 1:
            raise ValueError(f"BucketConfig.pool_batches={self.pool_batches}: must be >= 1")


@dataclass
class Sample:
    sample_index: int
    input_ids: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # bool [n]

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class Batch:
    """Samples of one bucket that run through the target together (right-padded to pad_len)."""

    bucket: int
    pad_len: int
    samples: list[Sample] = field(default_factory=list)
    rows: int | None = (
        None  # forward rows when padded beyond the samples (fixed shapes); None: one per sample
    )
    epoch: int | None = None
    """The campaign epoch of every sample (the producer flushes its buckets at each epoch's end, so a
    batch, and the shard made of it, never mixes epochs); None outside a campaign (held-out shards)."""

    @property
    def num_rows(self) -> int:
        return len(self.samples) if self.rows is None else self.rows

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.samples)

    @property
    def num_padded_tokens(self) -> int:
        return self.pad_len * self.num_rows


class Bucketer:
    """Streaming bucketer: `add` samples, get full batches back; `flush` at the end for the rest.

    Every added sample is in exactly one emitted batch. Tracks real vs padded tokens (padding waste).
    """

    def __init__(self, cfg: BucketConfig):
        self.cfg = cfg
        self._pools: dict[int, list[Sample]] = {}
        self.num_tokens = 0
        self.num_padded_tokens = 0

    def bucket_of(self, length: int) -> int:
        """Upper length bound of the bucket holding `length` (a multiple of its width)."""
        w = self.cfg.min_width
        if length > w:
            w = max(w, (1 << ((length - 1).bit_length() - 1)) // self.cfg.buckets_per_octave)
        return max(1, -(-length // w)) * w

    def rows_per_batch(self, bucket: int) -> int:
        rows = max(1, self.cfg.batch_tokens // bucket)
        return 1 << (rows.bit_length() - 1) if self.cfg.round_rows else rows

    def shape_of(self, bucket: int) -> tuple[int, int]:
        """[rows, length] of every batch of `bucket` under ``fixed_shapes``."""
        return self.rows_per_batch(bucket), bucket

    def add(self, sample: Sample) -> list[Batch]:
        if len(sample) == 0:
            raise ValueError(f"sample {sample.sample_index}: empty")
        b = self.bucket_of(len(sample))
        pool = self._pools.setdefault(b, [])
        pool.append(sample)
        if len(pool) < self.rows_per_batch(b) * self.cfg.pool_batches:
            return []
        del self._pools[b]
        return self._cut(b, pool)

    def flush(self) -> list[Batch]:
        """The partial pools at the end of the data, in a shuffled (seeded) order: emitted sorted, they
        would reach the consumers as a shortest-first curriculum at the end of every producer's slice."""
        out: list[Batch] = []
        for b in sorted(self._pools):
            out.extend(self._cut(b, self._pools[b]))
        self._pools.clear()
        order = np.random.default_rng(len(out)).permutation(len(out))
        return [out[i] for i in order]

    def _cut(self, bucket: int, pool: list[Sample]) -> list[Batch]:
        pool.sort(key=lambda s: (len(s), s.sample_index))
        rows, m = self.rows_per_batch(bucket), self.cfg.pad_multiple
        batches = []
        for i in range(0, len(pool), rows):
            chunk = pool[i : i + rows]
            if self.cfg.fixed_shapes:
                batch = Batch(bucket=bucket, pad_len=bucket, samples=chunk, rows=rows)
            else:
                padded = min(rows, 1 << (len(chunk) - 1).bit_length()) if self.cfg.round_rows else None
                batch = Batch(bucket=bucket, pad_len=-(-len(chunk[-1]) // m) * m, samples=chunk, rows=padded)
            self.num_tokens += batch.num_tokens
            self.num_padded_tokens += batch.num_padded_tokens
            batches.append(batch)
        return batches

    @property
    def padding_waste(self) -> float:
        """Fraction of forward tokens that were padding, over all emitted batches."""
        return 1.0 - self.num_tokens / self.num_padded_tokens if self.num_padded_tokens else 0.0


def batches(
    samples: Iterable[Sample], cfg: BucketConfig, bucketer: Bucketer | None = None
) -> Iterator[Batch]:
    """All batches of `samples` (full pools as they fill, then the rest)."""
    bk = bucketer or Bucketer(cfg)
    for s in samples:
        yield from bk.add(s)
    yield from bk.flush()
