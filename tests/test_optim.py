"""The optimizer step (consumer/optim.py): the clip folded into fused AdamW is clip_grad_norm_ + AdamW; the
mixed precision's master-weight AdamW is torch's AdamW on fp32 weights, writes their bf16 back, skips
non-finite steps, and its checkpoints load into torch's AdamW and back."""

from __future__ import annotations

import pytest
import torch
from draft_reference import one_thread  # noqa: F401  (autouse fixture)

from dflash.consumer.optim import MasterAdamW, clipped_step, grad_norm

SHAPES = [(7, 5), (5,), (3, 4, 2)]


def _params(dtype=torch.float32, seed=0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _grads(step: int, scale: float) -> list[torch.Tensor]:
    """bf16-representable gradients (so a bf16 model and an fp32 reference see the very same numbers)."""
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=g) * scale).to(torch.bfloat16).float() for s in SHAPES]


SCALES = [3.0, 0.05, 2.0, 0.3]  # global norms above and below max_norm = 1


def _reference(params, steps: int, *, wd: float) -> list[torch.Tensor]:
    """clip_grad_norm_ + torch's unfused AdamW, the plain way."""
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=wd, foreach=False)
    norms = []
    for k in range(steps):
        for p, gr in zip(params, _grads(k, SCALES[k % 4]), strict=True):
            p.grad = gr.clone().to(p.dtype)
        norms.append(torch.nn.utils.clip_grad_norm_(params, 1.0))
        opt.step()
    return norms


def test_clip_folded_into_fused_adamw_equals_clip_grad_norm_then_step():
    ref = _params()
    want_norms = _reference(ref, 4, wd=0.1)
    params = _params()
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    for k in range(4):
        for p, gr in zip(params, _grads(k, SCALES[k % 4]), strict=True):
            p.grad = gr.clone()
        norm = clipped_step(opt, params, 1.0)
        torch.testing.assert_close(norm, want_norms[k], rtol=1e-6, atol=0)
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")  # set for one step only
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)


def test_a_non_finite_gradient_skips_the_step_instead_of_poisoning_the_weights():
    for dtype, make in (
        (torch.float32, lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)),
        (torch.bfloat16, lambda ps: MasterAdamW(ps, lr=1e-2)),
    ):
        params = _params(dtype)
        opt = make(params)
        for p, gr in zip(params, _grads(0, 1.0), strict=True):
            p.grad = gr.to(p.dtype)
        clipped_step(opt, params, 1.0)
        before = [p.detach().clone() for p in params]
        for p, gr in zip(params, _grads(1, 1.0), strict=True):
            p.grad = gr.to(p.dtype)
        params[1].grad[2] = float("nan")
        norm = clipped_step(opt, params, 1.0)
        assert not torch.isfinite(norm)
        assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True)), type(opt).__name__
        assert all(float(opt.state[p]["step"]) == 1 for p in params), type(opt).__name__


def test_master_adamw_is_adamw_on_the_fp32_master_and_writes_its_bf16_back():
    ref = _params()
    want_norms = _reference(ref, 4, wd=0.1)
    params = _params(torch.bfloat16)
    opt = MasterAdamW(params, lr=1e-2, weight_decay=0.1)
    for p, start in zip(params, _params(), strict=True):  # the reference's fp32 start, as a resume sets it
        opt.set_master(p, start)
    for k in range(4):
        for p, gr in zip(params, _grads(k, SCALES[k % 4]), strict=True):
            p.grad = gr.to(torch.bfloat16)
        norm = clipped_step(opt, params, 1.0)
        torch.testing.assert_close(norm, want_norms[k], rtol=1e-5, atol=0)
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(opt.master_of(p), r.detach(), rtol=1e-6, atol=1e-6)
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), opt.master_of(p).to(torch.bfloat16))


def test_checkpoints_move_between_master_adamw_and_torch_adamw():
    """A mixed run's optimizer state is torch AdamW's (no master: the checkpoint's fp32 weights are it) and
    loads into torch's AdamW; amp's loads into MasterAdamW with the moments kept fp32."""
    params = _params(torch.bfloat16)
    opt = MasterAdamW(params, lr=1e-2)
    for k in range(2):
        for p, gr in zip(params, _grads(k, 1.0), strict=True):
            p.grad = gr.to(torch.bfloat16)
        clipped_step(opt, params, 1.0)
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert sd["state"][0]["exp_avg"].dtype == torch.float32

    fp32 = _params()
    torch_opt = torch.optim.AdamW(fp32, lr=1e-2, fused=True)
    torch_opt.load_state_dict(sd)
    assert torch.equal(torch_opt.state[fp32[0]]["exp_avg"], opt.state[params[0]]["exp_avg"])

    back = MasterAdamW(_params(torch.bfloat16), lr=1e-2)
    back.load_state_dict(torch_opt.state_dict())
    p0 = back.param_groups[0]["params"][0]
    assert back.state[p0]["exp_avg"].dtype == torch.float32  # torch's loader would have made it bf16
    torch.testing.assert_close(
        back.state[p0]["exp_avg_sq"], opt.state[params[0]]["exp_avg_sq"], rtol=0, atol=0
    )
    with pytest.raises(ValueError, match="optimizer state of 3 parameters, this drafter has 1"):
        MasterAdamW([torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))], lr=1e-2).load_state_dict(sd)


def test_grad_norm_accumulates_bf16_gradients_in_fp32():
    p = torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))
    p.grad = torch.full((4096,), 0.01, dtype=torch.bfloat16)
    want = torch.linalg.vector_norm(p.grad.double())
    torch.testing.assert_close(grad_norm([p]).double(), want, rtol=1e-6, atol=0)
    assert grad_norm([p]).dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_master_adamw_on_cuda_equals_eager_and_never_recompiles():
    """What the CUDA default runs: MasterAdamW's update compiled with inductor equals the eager update (the
    fp32 masters to fp32 rounding), and a new learning rate every step compiles nothing new."""
    import torch._dynamo

    torch._dynamo.reset()
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    dev = torch.device("cuda")
    compiled = [torch.nn.Parameter(p.detach().to(dev, torch.bfloat16)) for p in _params()]
    eager = [torch.nn.Parameter(p.detach().clone()) for p in compiled]
    opt_c = MasterAdamW(compiled, lr=1e-2, weight_decay=0.01, compile_backend="inductor")
    opt_e = MasterAdamW(eager, lr=1e-2, weight_decay=0.01)
    for step, scale in enumerate(SCALES):
        for group in (compiled, eager):
            for p, g in zip(group, _grads(step, scale), strict=True):
                p.grad = g.to(dev, torch.bfloat16)
        for opt in (opt_c, opt_e):
            opt.param_groups[0]["lr"] = 1e-2 * (step + 1)
        clipped_step(opt_c, compiled, 1.0)
        clipped_step(opt_e, eager, 1.0)
    for pc, pe in zip(compiled, eager, strict=True):
        torch.testing.assert_close(opt_c.master_of(pc), opt_e.master_of(pe), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pc, pe, rtol=0, atol=1e-2)  # the same bf16 up to one rounding
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before == 1
