"""Length buckets: every sample exactly once, token budget respected, padding waste small."""

from __future__ import annotations

import numpy as np
import pytest

from dflash.producer.buckets import BucketConfig, Bucketer, Sample, batches


def _samples(lengths):
    return [Sample(i, np.full(n, i, dtype=np.int32), np.ones(n, dtype=bool)) for i, n in enumerate(lengths)]


@pytest.mark.parametrize(
    "cfg",
    [
        BucketConfig(),
        BucketConfig(batch_tokens=2048, pool_batches=1),
        BucketConfig(batch_tokens=1000, min_width=32),
    ],
)
def test_every_sample_once_within_budget(cfg):
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.0, 1.0, 3000).astype(int), 1, 4096)
    bk = Bucketer(cfg)
    seen = []
    for b in batches(_samples(lengths), cfg, bk):
        lens = [len(s) for s in b.samples]
        assert all(bk.bucket_of(n) == b.bucket for n in lens), "one bucket per batch"
        assert max(lens) <= b.pad_len <= b.bucket and b.pad_len % cfg.pad_multiple == 0
        assert len(b.samples) == 1 or len(b.samples) * b.bucket <= cfg.batch_tokens
        seen.extend(s.sample_index for s in b.samples)
    assert sorted(seen) == list(range(len(lengths)))
    assert bk.num_tokens == int(lengths.sum())


def test_bucket_bounds_are_geometric():
    bk = Bucketer(BucketConfig())
    assert [bk.bucket_of(n) for n in (1, 16, 17, 256, 257, 4000, 4096)] == [16, 16, 32, 256, 272, 4096, 4096]
    for n in range(1, 9000):
        b = bk.bucket_of(n)
        assert n <= b and (b - n) <= max(16, n // 16)


@pytest.mark.parametrize(
    "name,lengths",
    [
        ("lognormal mean ~1K", lambda r: np.clip(r.lognormal(6.6, 0.8, 20000).astype(int), 40, 4096)),
        ("uniform 64-4096", lambda r: r.integers(64, 4097, 20000)),
    ],
)
def test_padding_waste_under_two_percent(name, lengths):
    cfg = BucketConfig()
    bk = Bucketer(cfg)
    for _ in batches(_samples(lengths(np.random.default_rng(0))), cfg, bk):
        pass
    assert bk.padding_waste < 0.02, f"{name}: {bk.padding_waste:.2%}"


def test_config_validation():
    for kw in ({"batch_tokens": 0}, {"buckets_per_octave": 3}, {"min_width": 24}, {"pad_multiple": 32}):
        with pytest.raises(ValueError, match="BucketConfig"):
            BucketConfig(**kw)
