"""The DFlash mask_mod against a hand-written loop reference (docs/architecture.md, the training recipe)."""

import pytest
import torch
from draft_reference import one_thread, random_stream, reference_mask  # noqa: F401  (one_thread: autouse fixture)

from dflash.common.drafter.batch import build_draft_batch, pack_samples
from dflash.common.drafter.dflash import build_draft_mask, dense_mask, make_mask_mod


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [2, 4])
def test_mask_mod_equals_loop_reference(seed, block_size):
    doc_ids, anchors, valid = random_stream(seed)
    got = dense_mask(
        make_mask_mod(doc_ids, anchors, valid, block_size),
        anchors.shape[0] * block_size,
        doc_ids.shape[0] + anchors.shape[0] * block_size,
        doc_ids.device,
    )
    want = reference_mask(doc_ids.tolist(), anchors.tolist(), valid.tolist(), block_size)
    assert valid.any() and (~valid).any()
    assert torch.equal(got, want)


def test_mask_on_batch_from_pipeline_and_padding_blocks_see_nothing():
    g = torch.Generator().manual_seed(3)
    docs = [
        (torch.randint(0, 50, (n,), generator=g), torch.rand(n, generator=g) > 0.3, torch.zeros(n, 8), i)
        for i, n in enumerate([9, 17, 5, 12])
    ]
    packed = pack_samples(docs, context_tokens=48)
    batch = build_draft_batch(
        packed, block_size=4, num_anchors=40, max_anchors_per_doc=6, mask_token_id=99, gamma=7.0, generator=g
    )
    assert (~batch.anchor_valid).any(), "test needs padding slots"
    n, b = batch.num_anchors, batch.block_size
    got = dense_mask(
        make_mask_mod(batch.doc_ids, batch.anchors, batch.anchor_valid, b), n * b, 48 + n * b, "cpu"
    )
    want = reference_mask(batch.doc_ids.tolist(), batch.anchors.tolist(), batch.anchor_valid.tolist(), b)
    assert torch.equal(got, want)
    rows = got.view(n, b, -1)
    assert not rows[~batch.anchor_valid].any()  # padding blocks see nothing
    assert rows[batch.anchor_valid].any(-1).all()  # a valid block's every token sees at least its own block
    assert (batch.label_weights[~batch.anchor_valid] == 0).all()  # ... and carry no loss
    # context visible to a valid block never includes the anchor itself or another document
    for blk in batch.anchor_valid.nonzero().squeeze(1).tolist():
        a = int(batch.anchors[blk])
        ctx = rows[blk, 0, :48].nonzero().squeeze(1)
        assert (ctx < a).all() and (batch.doc_ids[ctx] == batch.doc_ids[a]).all()
        assert ctx.shape[0] == int(batch.positions[a])  # exactly the document prefix before the anchor


def test_sdpa_mask_opens_padding_rows_and_marks_them_invalid():
    doc_ids, anchors, valid = random_stream(0)
    m = build_draft_mask(doc_ids, anchors, valid, block_size=4, backend="sdpa")
    assert m.backend == "sdpa" and m.block_mask is None
    assert torch.equal(m.row_valid, valid.repeat_interleave(4))
    assert m.dense[
        ~m.row_valid
    ].all()  # opened so SDPA never sees an all-masked row (NaN); output zeroed later
    ref = reference_mask(doc_ids.tolist(), anchors.tolist(), valid.tolist(), 4)
    assert torch.equal(m.dense[m.row_valid], ref[m.row_valid])


# ------------------------------------------------------------------------------ sliding-window layers


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("block_size", "window"), [(4, 1), (4, 3), (4, 6), (2, 9), (8, 5)])
def test_sliding_mask_equals_loop_reference_on_documents_longer_than_the_window(seed, block_size, window):
    """Documents up to 40 tokens against windows of 1-9: the window cuts the context of most blocks (and,
    for W < B, the block itself); the mask_mod equals the loop reference built from document positions."""
    doc_ids, anchors, valid = random_stream(seed, s=120, n=14, max_doc_len=40)
    q_len, kv_len = anchors.shape[0] * block_size, doc_ids.shape[0] + anchors.shape[0] * block_size
    got = dense_mask(make_mask_mod(doc_ids, anchors, valid, block_size, window), q_len, kv_len, "cpu")
    want = reference_mask(doc_ids.tolist(), anchors.tolist(), valid.tolist(), block_size, window)
    assert torch.equal(got, want)
    full = reference_mask(doc_ids.tolist(), anchors.tolist(), valid.tolist(), block_size)
    assert (got <= full).all() and (got != full).any()  # a strict subset: the window bites
    # every valid query still sees its own token (the window counts it), so no softmax row is empty
    rows = valid.repeat_interleave(block_size)
    own = torch.arange(q_len) + doc_ids.shape[0]
    assert got[rows, own[rows]].all()


def test_sliding_mask_by_hand():
    """One document of 10 tokens, anchor at position 6, B = 3, W = 4: query i (position 6+i) sees context
    positions 3+i..5 and block offsets max(0, i-3)..i."""
    doc_ids = torch.zeros(10, dtype=torch.int32)
    anchors, valid = torch.tensor([6]), torch.tensor([True])
    got = dense_mask(make_mask_mod(doc_ids, anchors, valid, 3, 4), 3, 13, "cpu")
    want = torch.zeros(3, 13, dtype=torch.bool)
    want[0, [3, 4, 5, 10]] = True
    want[1, [4, 5, 10, 11]] = True
    want[2, [5, 10, 11, 12]] = True
    assert torch.equal(got, want)
    full = dense_mask(make_mask_mod(doc_ids, anchors, valid, 3), 3, 13, "cpu")
    assert full[:, :6].all() and full[:, 10:].all() and not full[:, 6:10].any()


def test_sliding_sdpa_mask_matches_the_reference_on_valid_rows():
    doc_ids, anchors, valid = random_stream(2, s=100, n=12, max_doc_len=40)
    m = build_draft_mask(doc_ids, anchors, valid, block_size=4, backend="sdpa", sliding_window=5)
    ref = reference_mask(doc_ids.tolist(), anchors.tolist(), valid.tolist(), 4, 5)
    assert torch.equal(m.dense[m.row_valid], ref[m.row_valid]) and m.dense[~m.row_valid].all()
