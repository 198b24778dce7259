"""The lm_head + cross-entropy in chunks, with either row pass (torch ops, liger-kernel's Triton kernel):
both equal the unchunked loss with its per-position weights; no full logits ever exist; accuracy and τ."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from draft_reference import one_thread  # noqa: F401  (autouse fixture)
from torch.utils._python_dispatch import TorchDispatchMode

from dflash.common.drafter import loss as loss_module
from dflash.common.drafter.loss import (
    chunked_linear_cross_entropy,
    draft_loss,
    linear_cross_entropy,
    torch_rows,
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


def kernel_like_rows(logits: torch.Tensor, labels: torch.Tensor, need_grad: bool):
    """liger_rows' contract on the CPU (liger's kernel is Triton, CUDA only): each row's unreduced loss and
    argmax, and the gradient written over the logits in their own dtype (the kernel works in place)."""
    row_loss, preds, grad = torch_rows(logits, labels, need_grad)
    if grad is not None:
        logits.copy_(grad)
    return row_loss, preds, logits if need_grad else None


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_an_in_place_row_pass_equals_the_torch_one_with_per_position_weights(weight_dtype):
    """The chunked Function around a row pass that overwrites the logits with their gradient (as liger's
    kernel does) gives the torch row pass's weighted loss, hidden-state gradient and every prediction: the
    per-position weights are applied after the projection, never inside the kernel."""
    hidden, weight, labels, weights = inputs(3, m=45, h=24, v=301)
    weight = weight.detach().to(weight_dtype)
    got = {}
    for name, rows in (("in_place", kernel_like_rows), ("torch", torch_rows)):
        hidden.grad = None
        loss, preds = chunked_linear_cross_entropy(
            hidden, weight, labels, weights, chunk_tokens=8, row_pass=rows
        )
        (loss * 0.3).backward()
        got[name] = (loss.detach(), preds, hidden.grad.clone())
    torch.testing.assert_close(got["in_place"][0], got["torch"][0], atol=1e-5, rtol=1e-5)
    # bf16 logits: the in-place gradient is rounded to bf16 once more before the projection
    tol = {"atol": 1e-5, "rtol": 1e-5} if weight_dtype == torch.float32 else {"atol": 8e-3, "rtol": 1.6e-2}
    torch.testing.assert_close(got["in_place"][2], got["torch"][2], **tol)
    assert torch.equal(got["in_place"][1], got["torch"][1])


def test_draft_loss_metrics_are_the_same_with_either_row_pass(monkeypatch):
    monkeypatch.setitem(loss_module.ROW_PASSES, "liger", kernel_like_rows)  # the CPU stand-in
    g = torch.Generator().manual_seed(4)
    n, b, h, v = 6, 5, 16, 40
    hidden = torch.randn(n, b, h, generator=g)
    weight = torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (n, b), generator=g)
    labels[:, 1:3] = (hidden[:, 1:3] @ weight.t()).argmax(-1)  # some right guesses: τ > 1 somewhere
    batch = SimpleNamespace(
        labels=labels,
        label_weights=(torch.rand(n, b, generator=g) > 0.2).float(),
        anchor_valid=torch.tensor([1, 1, 1, 1, 0, 1]).bool(),
    )
    liger = draft_loss(hidden, batch, weight, lce=linear_cross_entropy("liger", chunk_tokens=7))
    chunked = draft_loss(hidden, batch, weight, lce=linear_cross_entropy("chunked", chunk_tokens=7))
    assert liger.tau_sum.item() > liger.num_blocks.item()  # the test sees accepted drafts
    torch.testing.assert_close(liger.loss_sum, chunked.loss_sum, atol=1e-5, rtol=1e-5)
    for f in ("weight_sum", "correct", "valid", "tau_sum", "num_blocks"):
        assert torch.equal(getattr(liger, f), getattr(chunked, f)), f
    with pytest.raises(ValueError, match="loss impl must be one of"):
        linear_cross_entropy("fused")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_liger_kernel_on_cuda_equals_the_torch_row_pass_at_32b_shapes():
    """The training path on CUDA at the 32B-class loss shapes (3,840 query rows x 151,936, bf16 lm_head):
    liger-kernel's row pass against the torch one: every prediction equal (the argmax of the same bf16
    logits), the weighted loss and the hidden states' gradient to bf16 tolerance."""
    pytest.importorskip("liger_kernel")
    torch.manual_seed(0)
    m, h, v = 3840, 1024, 151936
    dev = torch.device("cuda")
    hidden = (torch.randn(m, h, device=dev) * 0.5).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device=dev) * 0.02).to(torch.bfloat16)
    labels = torch.randint(0, v, (m,), device=dev)
    weights = torch.exp(-torch.arange(m, device=dev).remainder(15) / 7.0) * (torch.rand(m, device=dev) > 0.3)
    got = {}
    for impl in ("liger", "chunked"):
        hidden.grad = None
        loss, preds = linear_cross_entropy(impl, chunk_tokens=2048)(hidden, weight, labels, weights)
        (loss * 0.5).backward()
        got[impl] = (loss.detach().float(), preds, hidden.grad.float())
    assert torch.equal(got["liger"][1], got["chunked"][1])
    torch.testing.assert_close(got["liger"][0], got["chunked"][0], rtol=1e-4, atol=0)
    torch.testing.assert_close(got["liger"][2], got["chunked"][2], rtol=2e-2, atol=2e-3)


def test_auto_loss_is_liger_on_cuda_when_installed_else_chunked_and_says_so(monkeypatch, caplog, tmp_path):
    """The measured-faster row pass is the CUDA default; without liger-kernel the chunked one runs, said in
    one line; the CPU always takes chunked (liger's kernel is Triton)."""
    import importlib.util
    import logging

    from dflash.consumer.config import StepConfig
    from dflash.consumer.step import make_loss

    cfg = StepConfig()
    real = importlib.util.find_spec
    for installed in (True, False):
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a, ok=installed: (
                (object() if ok else None) if name == "liger_kernel" else real(name, *a)
            ),
        )
        assert cfg.resolved_loss_impl("cpu") == "chunked"
        assert cfg.resolved_loss_impl("cuda") == ("liger" if installed else "chunked")
    with caplog.at_level(logging.WARNING):
        make_loss(cfg, torch.device("cuda"))
    lines = [r.getMessage() for r in caplog.records if "liger-kernel is not installed" in r.getMessage()]
    assert len(lines) == 1 and "chunked" in lines[0]
