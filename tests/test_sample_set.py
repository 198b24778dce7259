"""dflash.common.contract.sample_set: bitmap semantics, merging, serialization and its validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.common.contract.sample_set import SampleSet, SampleSetFormatError


def test_add_contains_len_indices():
    s = SampleSet(epoch=2)
    assert len(s) == 0 and s.indices().tolist() == [] and 0 not in s
    s.add([5, 3, 5, 0])
    s.add(torch.tensor([1000, 3], dtype=torch.int64))
    s.add(np.array([7], dtype=np.int32))
    s.add(range(10, 13))
    s.add([])
    assert len(s) == 8
    assert s.indices().tolist() == [0, 3, 5, 7, 10, 11, 12, 1000]
    assert s.indices().dtype == torch.int64
    assert 1000 in s and torch.tensor(5) in s and np.int64(7) in s
    assert 4 not in s and 999 not in s and 10**9 not in s and -1 not in s and "3" not in s
    assert s.contains_mask(torch.tensor([0, 1, 1000, 5000])).tolist() == [True, False, True, False]
    assert s.epoch == 2


def test_rejects_bad_indices_and_args():
    s = SampleSet()
    with pytest.raises(ValueError, match=">= 0"):
        s.add([3, -1])
    with pytest.raises(ValueError, match="integers"):
        s.add(torch.tensor([1.5]))
    with pytest.raises(ValueError, match="epoch"):
        SampleSet(epoch=-1)
    assert len(s) == 0


def test_size_hint_preallocates_and_growth_keeps_bits():
    s = SampleSet(size_hint=100)
    assert s._bits.size == 13
    s.add([99])
    s.add([12345])
    assert s.indices().tolist() == [99, 12345]


def test_union_and_update_merge_ranks():
    a, b, c = SampleSet(epoch=1), SampleSet(epoch=1), SampleSet(epoch=1)
    a.add([1, 2, 3])
    b.add([3, 4, 100_000])
    merged = a.union(b, c)
    assert merged.indices().tolist() == [1, 2, 3, 4, 100_000] and merged.epoch == 1
    assert a.indices().tolist() == [1, 2, 3]  # union does not modify its inputs
    assert (a | b) == merged
    c.update(b)
    assert c == b and c is not b
    with pytest.raises(ValueError, match="epochs 1 and 2"):
        a.update(SampleSet(epoch=2))


def test_equality_ignores_capacity():
    a = SampleSet(size_hint=10_000)
    b = SampleSet()
    a.add([1])
    b.add([1])
    assert a == b
    assert a != SampleSet.from_indices([1], epoch=1)


@pytest.mark.parametrize("compress", [True, False])
def test_bytes_roundtrip(compress):
    s = SampleSet.from_indices([0, 7, 8, 65_000, 3], epoch=5)
    back = SampleSet.from_bytes(s.to_bytes(compress=compress))
    assert back == s and back.epoch == 5 and len(back) == 5
    empty = SampleSet.from_bytes(SampleSet(epoch=3).to_bytes())
    assert len(empty) == 0 and empty.epoch == 3


def test_serialized_form_is_compact():
    contiguous = SampleSet.from_indices(torch.arange(1_000_000))
    assert len(contiguous.to_bytes()) < 200
    rng = np.random.default_rng(0)
    scattered = SampleSet.from_indices(rng.choice(1_000_000, size=100_000, replace=False))
    assert len(scattered.to_bytes()) < 1_000_000 // 8 + 100  # never worse than one bit per index
    assert SampleSet.from_bytes(scattered.to_bytes()) == scattered


def test_from_bytes_rejects_corruption():
    data = bytearray(SampleSet.from_indices(range(0, 5000, 3), epoch=1).to_bytes(compress=False))
    with pytest.raises(SampleSetFormatError, match="shorter than its header"):
        SampleSet.from_bytes(bytes(data[:10]))
    with pytest.raises(SampleSetFormatError, match="magic"):
        SampleSet.from_bytes(b"XXXX" + bytes(data[4:]))
    bad_version = bytearray(data)
    bad_version[4] = 9
    with pytest.raises(SampleSetFormatError, match="version 9"):
        SampleSet.from_bytes(bytes(bad_version))
    flipped = bytearray(data)
    flipped[-1] ^= 0x10
    with pytest.raises(SampleSetFormatError, match="crc32"):
        SampleSet.from_bytes(bytes(flipped))
    with pytest.raises(SampleSetFormatError, match="crc32"):
        SampleSet.from_bytes(bytes(data[:-3]))
    compressed = bytearray(SampleSet.from_indices(range(0, 5000, 3)).to_bytes())
    compressed[-2] ^= 0xFF
    with pytest.raises(SampleSetFormatError):
        SampleSet.from_bytes(bytes(compressed))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(min_value=0, max_value=50_000), max_size=40), max_size=5),
    st.integers(min_value=0, max_value=1000),
)
def test_behaves_like_a_python_set(batches, epoch):
    s, ref = SampleSet(epoch=epoch), set()
    for batch in batches:
        s.add(batch)
        ref.update(batch)
    assert len(s) == len(ref)
    assert s.indices().tolist() == sorted(ref)
    assert all(i in s for i in ref)
    back = SampleSet.from_bytes(s.to_bytes())
    assert back == s and back.indices().tolist() == sorted(ref) and back.epoch == epoch
