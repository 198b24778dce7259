"""Label alignment. A synthetic task the drafter can only solve with the RIGHT alignment.

Task: documents of i.i.d. random tokens. The "target hidden state" at position p encodes the tokens at
p+2 .. p+B (one random code per offset), the way a real target's state at p carries information about what
follows. A block anchored at a sees context strictly before a, so its richest context is hidden[a-1], which
encodes exactly tokens a+1 .. a+B-1 = the correct labels of block positions 1..B-1 (same position, no shift).

- Correct labels: learnable to ~100 %.
- Labels shifted by one (position k trained on token a+k+1): position B-1 would need token a+B, which only
  hidden[a] encodes, and hidden[a] is invisible, so it stays at chance; and judged by what inference needs
  (position k = token a+k) the shifted drafter is at chance everywhere: τ ≈ 1.
- The same shifted training WITH a leaky mask (kv <= anchor) does learn position B-1: the leak hands training
  information inference never has. That is why the mask must be strict.
"""

import dataclasses

import torch
from draft_reference import one_thread  # noqa: F401  (autouse fixture)

from dflash.common.drafter import dflash as drafter_module
from dflash.common.drafter.batch import DraftBatch, build_draft_batch, pack_samples, position_decay
from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.loss import draft_loss
from dflash.common.drafter.model import DFlashDrafter, TargetHead

V, H, K, B, S, N = 16, 64, 2, 4, 256, 48
MASK = V - 1  # tokens are 0..V-2
CHANCE = 1 / (V - 1)


def codes() -> torch.Tensor:
    return torch.randn(B, V, K * H, generator=torch.Generator().manual_seed(123)) / (B - 1) ** 0.5


def make_doc(n: int, g: torch.Generator, code: torch.Tensor):
    ids = torch.randint(0, V - 1, (n,), generator=g)
    hidden = torch.zeros(n, K * H)
    for j in range(1, B):  # hidden[p] += code_j[token at p+1+j]
        src = torch.arange(n) + 1 + j
        ok = src < n
        hidden[ok] += code[j][ids[src[ok]]]
    loss_mask = torch.ones(n, dtype=torch.bool)
    loss_mask[:2] = False  # a 2-token "prompt": no anchor at position 0, where no context exists at all
    return ids, loss_mask, hidden


def make_batch(g: torch.Generator, code: torch.Tensor) -> DraftBatch:
    docs, total = [], 0
    while True:
        n = int(torch.randint(20, 60, (1,), generator=g))
        if total + n > S:
            break
        docs.append((*make_doc(n, g, code), len(docs)))
        total += n
    packed = pack_samples(docs, context_tokens=S)
    return build_draft_batch(
        packed, block_size=B, num_anchors=N, max_anchors_per_doc=8, mask_token_id=MASK, gamma=7.0, generator=g
    )


def shift_labels(batch: DraftBatch) -> DraftBatch:
    """The classic bug: block position k trained on the token at anchor+k+1."""
    idx = batch.anchors[:, None] + torch.arange(B) + 1
    safe = idx.clamp(max=S - 1)
    ok = (
        (idx < S)
        & (batch.doc_ids[safe] == batch.doc_ids[batch.anchors][:, None])
        & batch.anchor_valid[:, None]
    )
    ok[:, 0] = False
    ok &= batch.loss_mask[safe]
    return dataclasses.replace(
        batch,
        labels=torch.where(ok, batch.input_ids[safe], 0),
        label_weights=ok.float() * position_decay(B, 7.0),
    )


def train(*, shifted: bool, steps: int) -> tuple[DFlashDrafter, TargetHead]:
    torch.manual_seed(0)
    cfg = DrafterConfig(
        hidden_size=H,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=V,
        num_layers=2,
        block_size=B,
        target_layer_ids=[1, 2],
        num_target_layers=4,
        mask_token_id=MASK,
        max_position_embeddings=512,
    )
    head = TargetHead(torch.randn(V, H), torch.randn(V, H) * 3 / H**0.5)
    drafter = DFlashDrafter(cfg, head, attention_backend="sdpa")
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2, weight_decay=0.0)
    g, code = torch.Generator().manual_seed(1), codes()
    for _ in range(steps):
        batch = make_batch(g, code)
        if shifted:
            batch = shift_labels(batch)
        out = draft_loss(drafter(batch), batch, head.lm_head_weight)
        opt.zero_grad()
        out.loss().backward()
        opt.step()
    return drafter, head


@torch.no_grad()
def evaluate(drafter, head, *, shifted: bool, seeds=range(100, 104)) -> tuple[list[float], float]:
    """Per-position accuracy (positions 1..B-1) and τ over fresh batches, against correct or shifted labels."""
    correct = valid = tau = blocks = 0
    for seed in seeds:
        batch = make_batch(torch.Generator().manual_seed(seed), codes())
        if shifted:
            batch = shift_labels(batch)
        out = draft_loss(drafter(batch), batch, head.lm_head_weight)
        correct, valid = correct + out.correct, valid + out.valid
        tau, blocks = tau + out.tau_sum, blocks + out.num_blocks
    return (correct[1:].float() / valid[1:]).tolist(), float(tau / blocks)


def test_same_position_labels_are_learned():
    drafter, head = train(shifted=False, steps=150)
    acc, tau = evaluate(drafter, head, shifted=False)
    assert min(acc) > 0.9, acc
    assert tau > 3.5, tau  # max is B = 4 (a bit less: blocks cut by the document end)


def test_shifted_labels_fail():
    drafter, head = train(shifted=True, steps=100)
    own_acc, _ = evaluate(drafter, head, shifted=True)
    assert min(own_acc[:-1]) > 0.8, own_acc  # what is visible is learned ...
    assert own_acc[-1] < 3 * CHANCE, own_acc  # ... the token it would need at position B-1 is not
    acc, tau = evaluate(drafter, head, shifted=False)  # judged the way inference uses the draft
    assert max(acc[:-1]) < 3 * CHANCE, acc
    assert tau < 1.2, tau


def test_leaky_mask_would_learn_the_invisible_token(monkeypatch):
    """Control for the test above: with kv <= anchor, hidden[a] leaks token a+B, and shifted training learns it.
    (So the strict mask, not model capacity, is what makes position B-1 unlearnable above.)"""
    strict = drafter_module.make_mask_mod

    def leaky(doc_ids, anchors, anchor_valid, block_size, sliding_window=None, block_causal=True):
        # every valid anchor's next token is in its document (sampling rule), so shifting the anchor by one
        # gives exactly "same document, kv <= anchor"
        return strict(doc_ids, anchors + 1, anchor_valid, block_size, sliding_window, block_causal)

    monkeypatch.setattr(drafter_module, "make_mask_mod", leaky)
    drafter, head = train(shifted=True, steps=150)
    own_acc, _ = evaluate(drafter, head, shifted=True)
    assert own_acc[-1] > 0.8, own_acc
