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
