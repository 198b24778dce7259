"""The lm_head + cross-entropy, chunked and fused: both equal the unchunked loss; the chunked one never holds
full logits, the compiled fused one (CUDA) never an fp32 copy of them; accuracy and τ."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from draft_reference import one_thread  # noqa: F401  (autouse fixture)
from torch.utils._python_dispatch import TorchDispatchMode

from dflash.common.drafter.loss import (
    chunked_linear_cross_entropy,
    draft_loss,
    fused_linear_cross_entropy,
    linear_cross_entropy,
)


def inputs(seed, m=37, h=16, v=50, weight_grad=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(m, h, generator=g).requires_grad_()
    weight = torch.randn(v, h, generator=g).requires_grad_(weight_grad)
    labels = torch.randint(0, v, (m,), generator=g)
    weights = torch.rand(m, generator=g) * (torch.rand(m, generator=g) > 0.3)
    return hidden, weight, labels, weights


@pytest.mark.parametrize("chunk_tokens", [1, 5, 16, 37, 100])
@pytest.mark.parametrize("weight_grad", [False, True])
def test_chunked_equals_unchunked_values_and_grads(chunk_tokens, weight_grad):
    hidden, weight, labels, weights = inputs(0, weight_grad=weight_grad)
    loss, preds = chunked_linear_cross_entropy(hidden, weight, labels, weights, chunk_tokens=chunk_tokens)
    (loss * 1.7).backward()  # a non-unit upstream gradient must scale the stored gradient
    got = (loss.detach(), hidden.grad.clone(), weight.grad.clone() if weight_grad else None)

    hidden.grad = None
    weight.grad = None
    logits = hidden @ weight.t()
    ref = (F.cross_entropy(logits, labels, reduction="none") * weights).sum()
    (ref * 1.7).backward()
    torch.testing.assert_close(got[0], ref.detach(), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(got[1], hidden.grad, atol=1e-6, rtol=1e-5)
    if weight_grad:
        torch.testing.assert_close(got[2], weight.grad, atol=1e-5, rtol=1e-5)
    assert torch.equal(preds, logits.argmax(-1))


class MaxVocabRows(TorchDispatchMode):
    """Records the largest number of rows of any tensor an op produced with the vocabulary as last dim."""

    def __init__(self, vocab: int, ignore: torch.Tensor):
        super().__init__()
        self.vocab, self.max_rows = vocab, 0
        self.ignore = ignore.untyped_storage().data_ptr()  # views of the lm_head weight itself (weight.t())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if (
                isinstance(t, torch.Tensor)
                and t.dim() >= 1
                and t.shape[-1] == self.vocab
                and t.untyped_storage().data_ptr() != self.ignore
            ):
                self.max_rows = max(self.max_rows, t.numel() // self.vocab)
        return out


def test_full_logits_never_exist():
    hidden, weight, labels, weights = inputs(1, m=64, v=97)
    with MaxVocabRows(97, weight) as probe:
        loss, _ = chunked_linear_cross_entropy(hidden, weight, labels, weights, chunk_tokens=8)
        loss.backward()
    assert probe.max_rows == 8
    with MaxVocabRows(97, weight) as probe:
        (hidden @ weight.t()).sum()
    assert probe.max_rows == 64  # the probe does see full logits when they exist


def test_draft_loss_accuracy_and_tau_by_hand():
    # vocab 4, identity-like lm_head so that the argmax of hidden row i is chosen by which unit vector it is
    v = 4
    weight = torch.eye(v)
    labels = torch.tensor([[9, 1, 2, 3, 0], [9, 1, 2, 3, 0], [9, 1, 2, 3, 0], [0, 0, 0, 0, 0]])
    weights = torch.tensor(
        [[0, 1, 1, 1, 1], [0, 1, 1, 0, 1], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.float32
    )
    preds = torch.tensor([[0, 1, 2, 0, 0], [0, 1, 2, 3, 0], [0, 3, 2, 3, 0], [0, 1, 2, 3, 0]])
    labels = labels.clamp(max=v - 1)
    hidden = F.one_hot(preds, v).float() * 5
    valid = torch.tensor([True, True, True, False])
    out = draft_loss(
        hidden,
        SimpleNamespace(labels=labels, label_weights=weights, anchor_valid=valid),
        weight,
        chunk_tokens=3,
    )
    # block 0: correct at 1,2 then wrong at 3 -> tau 3; block 1: 1,2 correct, 3 invalid -> stops, tau 3
    # block 2: wrong at 1 -> tau 1 (position 3 still counts as correct for accuracy); block 3: padding -> not counted
    assert out.num_blocks.item() == 3
    assert out.tau_sum.item() == 3 + 3 + 1
    assert out.valid.tolist() == [0, 3, 3, 2, 3]
    assert out.correct.tolist() == [0, 2, 3, 1, 3]
    assert out.weight_sum.item() == weights.sum().item()
    ref = (
        F.cross_entropy(
            (hidden @ weight.t())[:, 1:].reshape(-1, v), labels[:, 1:].reshape(-1), reduction="none"
        )
        * weights[:, 1:].reshape(-1)
    ).sum()
    torch.testing.assert_close(out.loss_sum, ref)
    torch.testing.assert_close(out.loss(), ref / weights.sum())


def test_draft_loss_ignores_position_zero_and_zero_weights_in_grad():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 4, 8, generator=g).requires_grad_()
    weights = torch.ones(3, 4)
    weights[:, 0] = 0
    weights[2] = 0
    batch = SimpleNamespace(
        labels=torch.randint(0, 11, (3, 4), generator=g),
        label_weights=weights,
        anchor_valid=torch.tensor([1, 1, 0]).bool(),
    )
    out = draft_loss(hidden, batch, torch.randn(11, 8, generator=g))
    out.loss_sum.backward()
    assert (hidden.grad[:, 0] == 0).all() and (hidden.grad[2] == 0).all()
    assert (hidden.grad[:2, 1:].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_chunked_loss_grads_and_predictions(weight_dtype):
    """The fused function (what torch.compile fuses on CUDA; here eager) against the chunked Function:
    the weighted loss, the hidden states' gradient and every greedy prediction, in fp32 to 1e-5; with a
    bf16 lm_head (as on CUDA) the predictions are the argmax of the same bf16 logits, so they match exactly."""
    hidden, weight, labels, weights = inputs(3, m=45, h=24, v=301)
    weight = weight.detach().to(weight_dtype)
    got = {}
    for name, fn in (
        ("fused", fused_linear_cross_entropy),
        ("chunked", lambda *a: chunked_linear_cross_entropy(*a, chunk_tokens=8)),
    ):
        hidden.grad = None
        loss, preds = fn(hidden, weight, labels, weights)
        (loss * 0.3).backward()
        got[name] = (loss.detach(), preds, hidden.grad.clone())
    torch.testing.assert_close(got["fused"][0], got["chunked"][0], atol=1e-5, rtol=1e-5)
    # a bf16 gradient is rounded before (chunked: in forward) or after (fused) the upstream scale
    tol = {"atol": 1e-5, "rtol": 1e-5} if weight_dtype == torch.float32 else {"atol": 8e-3, "rtol": 1.6e-2}
    torch.testing.assert_close(got["fused"][2], got["chunked"][2], **tol)
    assert torch.equal(got["fused"][1], got["chunked"][1])


def test_draft_loss_metrics_are_the_same_with_either_implementation():
    g = torch.Generator().manual_seed(4)
    n, b, h, v = 6, 5, 16, 40
    hidden = torch.randn(n, b, h, generator=g)
    weight = torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (n, b), generator=g)
    labels[:, 1:3] = (hidden[:, 1:3] @ weight.t()).argmax(-1)  # some right guesses: τ > 1 somewhere
    batch = SimpleNamespace(
        labels=labels, label_weights=(torch.rand(n, b, generator=g) > 0.2).float(),
        anchor_valid=torch.tensor([1, 1, 1, 1, 0, 1]).bool(),
    )  # fmt: skip
    fused = draft_loss(hidden, batch, weight, lce=linear_cross_entropy("fused"))
    chunked = draft_loss(hidden, batch, weight, lce=linear_cross_entropy("chunked", chunk_tokens=7))
    assert fused.tau_sum.item() > fused.num_blocks.item()  # the test sees accepted drafts
    torch.testing.assert_close(fused.loss_sum, chunked.loss_sum, atol=1e-5, rtol=1e-5)
    for f in ("weight_sum", "correct", "valid", "tau_sum", "num_blocks"):
        assert torch.equal(getattr(fused, f), getattr(chunked, f)), f
    with pytest.raises(ValueError, match="loss impl must be one of"):
        linear_cross_entropy("dense")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_fused_loss_on_cuda_equals_chunked_and_keeps_no_fp32_logits():
    """The training path on CUDA: bf16 lm_head, compiled fused loss vs the chunked one (same bf16 logits:
    equal predictions; loss and gradient to bf16 tolerance), and its peak memory during forward + backward
    stays below one fp32 [tokens x vocab] buffer (the bf16 logits saved for backward are half of it)."""
    torch.manual_seed(0)
    m, h, v = 3840, 1024, 151936
    dev = torch.device("cuda")
    hidden = (torch.randn(m, h, device=dev) * 0.5).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device=dev) * 0.02).to(torch.bfloat16)
    labels = torch.randint(0, v, (m,), device=dev)
    weights = (torch.rand(m, device=dev) > 0.3).float()
    fused = linear_cross_entropy("fused", compile_backend="inductor")
    fused(hidden, weight, labels, weights)[0].backward()  # compile outside the measured call
    hidden.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss, preds = fused(hidden, weight, labels, weights)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    got = (loss.detach().float(), preds, hidden.grad.float())
    hidden.grad = None
    loss_c, preds_c = chunked_linear_cross_entropy(hidden, weight, labels, weights, chunk_tokens=2048)
    loss_c.backward()
    assert peak < m * v * 4, f"peak {peak / 2**30:.2f} GiB: an fp32 copy of the logits exists"
    assert torch.equal(got[1], preds_c)
    torch.testing.assert_close(got[0], loss_c.detach().float(), rtol=2e-3, atol=0)
    torch.testing.assert_close(got[2], hidden.grad.float(), rtol=2e-2, atol=2e-3)
