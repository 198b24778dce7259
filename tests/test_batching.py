"""Packing, anchor sampling and draft-block construction (labels at the SAME position, weights, padding)."""

import math

import pytest
import torch
from draft_reference import one_thread  # noqa: F401  (autouse fixture)

from dflash.common.drafter.batch import (
    DraftBatch,
    PackedSamples,
    build_draft_batch,
    pack_samples,
    position_decay,
    sample_anchors,
)


def doc(n, seed, width=6, loss_from=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, dtype=torch.bool)
    mask[:loss_from] = False
    return torch.randint(0, 1000, (n,), generator=g), mask, torch.randn(n, width, generator=g), 100 + seed


def test_pack_samples_layout():
    samples = [doc(5, 0), doc(3, 1), doc(4, 2)]
    p = pack_samples(samples, context_tokens=16)
    assert p.context_tokens == 16 and p.num_docs == 3 and p.sample_index == [100, 101, 102]
    assert p.doc_ids.tolist() == [0] * 5 + [1] * 3 + [2] * 4 + [-1] * 4
    assert p.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 0, 0, 0, 0]
    assert torch.equal(p.input_ids[5:8], samples[1][0]) and torch.equal(p.hidden[8:12], samples[2][2])
    assert not p.loss_mask[12:].any() and (p.hidden[12:] == 0).all() and (p.input_ids[12:] == 0).all()
    assert p.input_ids.dtype == torch.int64 and p.doc_ids.dtype == torch.int32


def test_pack_samples_errors():
    with pytest.raises(ValueError, match="more than context_tokens"):
        pack_samples([doc(10, 0), doc(7, 1)], context_tokens=16)
    ids, mask, hid, idx = doc(5, 0)
    with pytest.raises(ValueError, match="do not match"):
        pack_samples([(ids, mask[:4], hid, idx)], context_tokens=16)
    with pytest.raises(ValueError, match="at least one"):
        pack_samples([], context_tokens=16)
    with pytest.raises(ValueError, match="shape"):
        PackedSamples(
            input_ids=ids, loss_mask=mask[:3], hidden=hid, doc_ids=ids.int(), positions=ids, sample_index=[0]
        )


def candidates(p: PackedSamples) -> set[int]:
    """Loop reference: p is a candidate iff p+1 is in the same real document and on the loss mask."""
    d, m = p.doc_ids.tolist(), p.loss_mask.tolist()
    return {i for i in range(len(d) - 1) if d[i] >= 0 and d[i + 1] == d[i] and m[i + 1]}


def test_sample_anchors_only_candidates_caps_and_padding():
    p = pack_samples(
        [doc(12, 0, loss_from=5), doc(3, 1), doc(20, 2, loss_from=2), doc(1, 3)], context_tokens=40
    )
    cand = candidates(p)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        anchors, valid = sample_anchors(
            p.doc_ids, p.loss_mask, num_anchors=12, max_anchors_per_doc=4, generator=g
        )
        chosen = anchors[valid].tolist()
        assert set(chosen) <= cand and len(set(chosen)) == len(chosen)
        assert chosen == sorted(chosen) and (anchors[~valid] == 0).all()
        per_doc = torch.bincount(p.doc_ids[anchors[valid]].long(), minlength=4)
        # doc 0 has 7 candidates, doc 1 has 2, doc 2 has 18 -> capped at 4; doc 3 (one token) has none
        assert per_doc.tolist() == [4, 2, 4, 0]
        assert valid.sum() == 10 and valid[:10].all()


def test_sample_anchors_total_cap_is_a_uniform_subset():
    p = pack_samples([doc(30, 0), doc(30, 1), doc(30, 2)], context_tokens=96)
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(96)
    draws = 600
    for _ in range(draws):
        anchors, valid = sample_anchors(
            p.doc_ids, p.loss_mask, num_anchors=6, max_anchors_per_doc=10, generator=g
        )
        assert valid.all()
        counts[anchors] += 1
    # each of the 87 candidates is picked with probability 6/87 per draw; no document is favoured
    cand = sorted(candidates(p))
    assert counts[cand].sum() == draws * 6
    expected = draws * 6 / len(cand)
    assert (counts[cand] - expected).abs().max() < 5 * math.sqrt(expected)
    per_doc = [counts[i * 30 : i * 30 + 30].sum().item() for i in range(3)]
    assert sum(per_doc) == draws * 6
    assert max(per_doc) - min(per_doc) < 0.15 * draws * 6 / 3


def test_sample_anchors_resamples_and_is_reproducible():
    p = pack_samples([doc(50, 0)], context_tokens=64)
    a1, _ = sample_anchors(
        p.doc_ids,
        p.loss_mask,
        num_anchors=8,
        max_anchors_per_doc=8,
        generator=torch.Generator().manual_seed(5),
    )
    a2, _ = sample_anchors(
        p.doc_ids,
        p.loss_mask,
        num_anchors=8,
        max_anchors_per_doc=8,
        generator=torch.Generator().manual_seed(5),
    )
    assert torch.equal(a1, a2)
    g = torch.Generator().manual_seed(5)
    draws = {
        tuple(
            sample_anchors(p.doc_ids, p.loss_mask, num_anchors=8, max_anchors_per_doc=8, generator=g)[
                0
            ].tolist()
        )
        for _ in range(5)
    }
    assert len(draws) == 5


def test_sample_anchors_with_no_candidate():
    p = pack_samples([doc(5, 0, loss_from=5)], context_tokens=8)
    anchors, valid = sample_anchors(
        p.doc_ids, p.loss_mask, num_anchors=4, max_anchors_per_doc=2, generator=torch.Generator()
    )
    assert not valid.any() and (anchors == 0).all()


def test_position_decay():
    w = position_decay(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    torch.testing.assert_close(w[15], torch.tensor(math.exp(-14 / 7)))
    with pytest.raises(ValueError, match="gamma"):
        position_decay(16, 0.0)


def test_build_draft_batch_against_loop_reference():
    block, mask_id, gamma = 5, 999, 7.0
    p = pack_samples([doc(9, 0, loss_from=3), doc(4, 1), doc(13, 2, loss_from=1)], context_tokens=30)
    p.loss_mask[20] = False  # a hole inside an assistant turn
    batch = build_draft_batch(
        p,
        block_size=block,
        num_anchors=12,
        max_anchors_per_doc=3,
        mask_token_id=mask_id,
        gamma=gamma,
        generator=torch.Generator().manual_seed(2),
    )
    assert isinstance(batch, DraftBatch) and batch.num_anchors == 12 and batch.block_size == block
    assert torch.equal(batch.input_ids, p.input_ids) and batch.sample_index == p.sample_index
    assert (~batch.anchor_valid).any()
    ids, d, m, pos = p.input_ids.tolist(), p.doc_ids.tolist(), p.loss_mask.tolist(), p.positions.tolist()
    for b in range(12):
        a = int(batch.anchors[b])
        if not batch.anchor_valid[b]:
            assert (batch.label_weights[b] == 0).all() and (batch.block_input_ids[b] == mask_id).all()
            continue
        assert batch.block_input_ids[b].tolist() == [ids[a]] + [mask_id] * (block - 1)
        assert batch.block_positions[b].tolist() == [pos[a] + k for k in range(block)]
        for k in range(block):
            inside = a + k < 30 and d[a + k] == d[a]
            assert batch.labels[b, k].item() == (ids[a + k] if inside else 0)  # SAME position, no shift
            want = math.exp(-(k - 1) / gamma) if k >= 1 and inside and m[a + k] else 0.0
            assert batch.label_weights[b, k].item() == pytest.approx(want, abs=1e-6)
        assert batch.label_weights[b, 1] > 0  # the anchor rule guarantees a trained first label
