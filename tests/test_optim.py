"""The optimizer step (consumer/optim.py): the clip folded into fused AdamW is clip_grad_norm_ + AdamW; the
mixed precision's master-weight AdamW is torch's AdamW on fp32 weights, writes their bf16 back, skips
non-finite steps, and its checkpoints load into torch's AdamW and back."""

from __future__ import annotations

import pytest
import torch
from draft_reference import one_thread  # noqa: F401  (autouse fixture)

from dflash.consumer.optim import (
    MasterAdamW,
    StochasticAdamW,
    clipped_step,
    grad_norm,
    stochastic_round_bf16,
)

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
        (torch.bfloat16, lambda ps: StochasticAdamW(ps, lr=1e-2)),
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


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (8 significant bits)."""
    exp = torch.floor(torch.log2(x.abs().clamp(min=2.0**-126)))
    return 2.0 ** (exp - 7)


def test_stochastic_rounding_is_unbiased_and_lands_on_a_bf16_neighbour():
    """x = 1 + 2^-10 sits 1/8 of an ulp above 1: rounded to 1 + 2^-7 one time in eight, to 1 otherwise, so
    the mean is x (round-to-nearest gives 1 always). Negative values mirror it."""
    torch.manual_seed(0)
    x = torch.full((200_000,), 1.0 + 2.0**-10)
    for sign in (1.0, -1.0):
        r = stochastic_round_bf16(sign * x).float()
        assert set(r.unique().tolist()) == {sign * 1.0, sign * (1.0 + 2.0**-7)}
        # the mean's standard error is ulp * sqrt(p(1-p) / n) = 5.8e-6: 6 of them
        assert abs(float(r.mean()) - sign * (1.0 + 2.0**-10)) < 3.5e-5, float(r.mean())
    exact = torch.tensor([1.5, -2.0, 0.0, float("inf"), float("-inf")])
    assert torch.equal(stochastic_round_bf16(exact).float(), exact)  # representable values stay


def test_stochastic_adamw_with_fp32_moments_is_adamw_within_one_bf16_ulp_per_step():
    """Each step, from the same bf16 weights: torch's AdamW (clip_grad_norm_ first, fp32) lands within one
    bf16 ulp of StochasticAdamW's weight; the fp32 moments are torch's to fp32 rounding."""
    params = _params(torch.bfloat16)
    opt = StochasticAdamW(params, lr=1e-2, weight_decay=0.1, moment_dtype=torch.float32)
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    torch.manual_seed(0)
    for k in range(4):
        grads = _grads(k, SCALES[k % 4])
        for p, r, gr in zip(params, ref, grads, strict=True):
            p.grad = gr.to(torch.bfloat16)
            r.data.copy_(p.detach().float())
            r.grad = gr.clone()
        want = torch.nn.utils.clip_grad_norm_(ref, 1.0)
        ref_opt.step()
        norm = clipped_step(opt, params, 1.0)
        torch.testing.assert_close(norm, want, rtol=1e-5, atol=0)
        for p, r in zip(params, ref, strict=True):
            assert p.dtype == torch.bfloat16
            assert bool(((p.float() - r.detach()).abs() <= _ulp_bf16(r.detach())).all()), k
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt.state[p][key], ref_opt.state[r][key], rtol=1e-5, atol=1e-12)


def test_stochastic_adamw_with_bf16_moments_takes_adamw_first_step_within_one_ulp():
    params = _params(torch.bfloat16)
    opt = StochasticAdamW(params, lr=1e-2)
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    torch.manual_seed(0)
    for p, r, gr in zip(params, ref, _grads(0, 3.0), strict=True):
        p.grad, r.grad = gr.to(torch.bfloat16), gr.clone()
    torch.nn.utils.clip_grad_norm_(ref, 1.0)
    ref_opt.step()
    clipped_step(opt, params, 1.0)
    for p, r in zip(params, ref, strict=True):
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
        for got, want in (
            (p, r.detach()),
            *((opt.state[p][k], ref_opt.state[r][k]) for k in ("exp_avg", "exp_avg_sq")),
        ):
            assert bool(((got.float() - want).abs() <= _ulp_bf16(want)).all())


def test_stochastic_adamw_moves_weights_by_updates_below_half_an_ulp_as_fp32_does():
    """What pure bf16 gets wrong (docs/training.md): at lr 1e-4 each Adam update (~1e-4) is 1/78 of the
    bf16 ulp at 1.0, so round-to-nearest bf16 (torch's AdamW on bf16 weights) never moves the weight;
    stochastic rounding moves it by the fp32 amount on average (200 steps: -0.02)."""
    n, steps, lr = 8192, 200, 1e-4
    torch.manual_seed(0)
    sr = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    rn = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    ref = torch.nn.Parameter(torch.ones(n))
    opts = (
        StochasticAdamW([sr], lr=lr, weight_decay=0.0),
        torch.optim.AdamW([rn], lr=lr, weight_decay=0.0, foreach=False),
        torch.optim.AdamW([ref], lr=lr, weight_decay=0.0, foreach=False),
    )
    for _ in range(steps):
        for p, opt in zip((sr, rn, ref), opts, strict=True):
            p.grad = torch.ones_like(p)
            clipped_step(opt, [p], 0.0)
    moved = 1.0 - float(ref.detach().mean())
    assert 0.019 < moved < 0.021, moved
    assert torch.equal(rn.detach(), torch.ones_like(rn))  # round-to-nearest: stuck
    assert abs((1.0 - float(sr.detach().float().mean())) - moved) < 0.05 * moved


def test_stochastic_adamw_checkpoints_hold_fp32_moments_and_load_any_precisions():
    params = _params(torch.bfloat16)
    opt = StochasticAdamW(params, lr=1e-2)
    for k in range(2):
        for p, gr in zip(params, _grads(k, 1.0), strict=True):
            p.grad = gr.to(torch.bfloat16)
        clipped_step(opt, params, 1.0)
    sd = opt.state_dict()
    assert sd["state"][0]["exp_avg"].dtype == torch.float32
    assert torch.equal(sd["state"][0]["exp_avg"], opt.state[params[0]]["exp_avg"].float())
    master = MasterAdamW(_params(torch.bfloat16), lr=1e-2)
    master.load_state_dict(sd)
    back = StochasticAdamW(_params(torch.bfloat16), lr=1e-2)
    back.load_state_dict(master.state_dict())
    p0 = back.param_groups[0]["params"][0]
    assert back.state[p0]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(back.state[p0]["exp_avg_sq"], opt.state[params[0]]["exp_avg_sq"])
    with pytest.raises(ValueError, match="bf16 weights"):
        StochasticAdamW(_params(), lr=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_stochastic_adamw_on_cuda_is_adamw_within_one_ulp_and_never_recompiles():
    """The compiled update (inductor's in-kernel random bits) keeps the eager one's contract: each step
    within one bf16 ulp of torch's fp32 AdamW from the same weights, fp32 moments equal to fp32 rounding,
    and a new learning rate every step compiles nothing new."""
    import torch._dynamo

    torch._dynamo.reset()
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    dev = torch.device("cuda")
    params = [torch.nn.Parameter(p.detach().to(dev, torch.bfloat16)) for p in _params()]
    opt = StochasticAdamW(params, lr=1e-2, moment_dtype=torch.float32, compile_backend="inductor")
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=1e-2, foreach=False)
    for k, scale in enumerate(SCALES):
        for p, r, gr in zip(params, ref, _grads(k, scale), strict=True):
            p.grad = gr.to(dev, torch.bfloat16)
            r.data.copy_(p.detach().float())
            r.grad = gr.to(dev)
        for o in (opt, ref_opt):
            o.param_groups[0]["lr"] = 1e-2 * (k + 1)
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        ref_opt.step()
        clipped_step(opt, params, 1.0)
        for p, r in zip(params, ref, strict=True):
            assert bool(((p.float() - r.detach()).abs() <= _ulp_bf16(r.detach())).all()), k
            torch.testing.assert_close(
                opt.state[p]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"], rtol=1e-5, atol=1e-12
            )
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before == 1


def test_bf16sr_is_a_precision_flag_with_its_moment_dtype_and_builds_stochastic_adamw():
    """--precision bf16sr: bf16 parameters, StochasticAdamW with --moment-dtype (bf16 by default); the
    moment dtype is refused with any other precision (they fix their own)."""
    from dflash.consumer.config import OptimConfig
    from dflash.consumer.optim import build_optimizer

    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    for moments, want in (("auto", torch.bfloat16), ("float32", torch.float32)):
        cfg = OptimConfig(precision="bf16sr", moment_dtype=moments)
        assert cfg.param_dtype("cuda") == torch.bfloat16
        opt, _ = build_optimizer(model, cfg, device=torch.device("cpu"), schedule_steps=10)
        assert isinstance(opt, StochasticAdamW) and opt.moment_dtype == want
    with pytest.raises(ValueError, match="moment-dtype float32 needs --precision bf16sr"):
        OptimConfig(precision="mixed", moment_dtype="float32")
