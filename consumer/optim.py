"""The optimizer step: AdamW with gradient clipping folded in, and the mixed precision's fp32 master.

Why (RESULTS.md's kernel table, 32B-class drafter, amp, 2.57 B parameters): of a 170 ms step, fused AdamW
took 20.9 ms, ``clip_grad_norm_`` 8.6 ms (a norm pass 2.9 + a multiply of every gradient 5.7) and
autocast's fp32 -> bf16 weight casts 8.5 ms. All three are memory passes over the parameters; the matmuls
they surround run at the chip's limit. Two ways to fewer passes:

- ``clipped_step`` (every precision but mixed): the clip's multiply goes into the fused AdamW kernel
  (``optimizer.grad_scale``, the hook torch's GradScaler uses: the kernel divides each gradient by it as it
  reads it), so clipping costs the norm pass only; ``found_inf`` skips a step whose gradients are not
  finite instead of writing NaN into every weight.
- ``MasterAdamW`` (precision "mixed"): the model holds bf16 weights, used by forward and backward as they
  are (no casts, bf16 gradients); the optimizer holds the fp32 master weights and fp32 moments and
  updates them in ONE pass per tensor that reads the bf16 gradient, scales it by the clip coefficient,
  updates master and moments and writes the bf16 weight back: on CUDA one torch.compile'd function over
  all parameters (inductor fuses each tensor's update into one kernel). The numbers are amp's: amp's
  forward also runs bf16 roundings of fp32 master weights, and its gradients come out of bf16 GEMMs; only
  where a weight's gradient is summed (DDP's all-reduce, a weight used twice) is the sum bf16 here.

- ``StochasticAdamW`` (precision "bf16sr"): bf16 weights and, by default, bf16 moments, no master: the
  update is computed in fp32 registers and written back with stochastic rounding (add 16 random bits below
  the bf16 mantissa, truncate), so an update smaller than half a bf16 ulp moves the weight by one ulp with
  the matching probability instead of never (what makes pure bf16 learn worse: docs/training.md). The
  moments are rounded the same way (round-to-nearest, ``v * 0.999`` rounds back to ``v``: it would never
  decay). Bytes per parameter per step: read weight, gradient, two moments (2+2+2+2), write weight and
  moments (2+2+2) = 14, plus the norm's read of the gradient (2): 16, against 28 (+4 norm) for amp's fused
  AdamW and 28 (+2) for ``MasterAdamW``. ``moment_dtype=float32`` keeps fp32 moments (22 + 2).

Checkpoints are the same for every precision: the weights in fp32 (the master, for mixed) and AdamW's
state (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter), so a run can resume in another precision.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from dflash.consumer.config import OptimConfig
from dflash.consumer.schedule import LrSchedule


def grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of the gradients, accumulated in fp32 (bf16 gradients too), as a device tensor:
    no host sync."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))


def clipped_step(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], max_norm: float
) -> torch.Tensor:
    """One optimizer step with the gradients clipped to ``max_norm`` (0: no clipping) as
    ``clip_grad_norm_`` would; returns the norm before clipping. A non-finite norm skips the step."""
    if isinstance(optimizer, MasterAdamW | StochasticAdamW):
        optimizer.max_grad_norm = max_norm
        return optimizer.step()
    norm = grad_norm(params)
    fused = any(g.get("fused") for g in optimizer.param_groups)
    if not fused:  # (an optimizer without the fused kernel's hooks: the plain way)
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        optimizer.step()
        return norm
    if max_norm > 0:  # == clip_grad_norm_'s coefficient min(1, max_norm / (norm + 1e-6)), as a divisor
        optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)
    optimizer.found_inf = (~torch.isfinite(norm)).float()
    try:
        optimizer.step()
    finally:
        optimizer.__dict__.pop("grad_scale", None)
        optimizer.__dict__.pop("found_inf", None)
    return norm


def _master_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    masters: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    lr: torch.Tensor,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    max_norm: float,
) -> torch.Tensor:
    """AdamW (decoupled weight decay, torch's formula) on the fp32 masters from (clipped) bf16 gradients,
    then the bf16 weights; every tensor is left as it was when the norm is not finite. Returns the norm."""
    norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
    )
    finite = torch.isfinite(norm)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0) if max_norm > 0 else torch.ones_like(norm)
    for p, g, w, m, v, s in zip(params, grads, masters, exp_avgs, exp_avg_sqs, steps, strict=True):
        step = s + 1
        g32 = g.float() * coef
        m_new = m + (g32 - m) * (1 - beta1)
        v_new = v * beta2 + g32 * g32 * (1 - beta2)
        denom = v_new.sqrt() / torch.sqrt(1 - beta2**step) + eps
        w_new = w * (1 - lr * weight_decay) - (lr / (1 - beta1**step)) * m_new / denom
        w.copy_(torch.where(finite, w_new, w))
        m.copy_(torch.where(finite, m_new, m))
        v.copy_(torch.where(finite, v_new, v))
        s.copy_(torch.where(finite, step, s))
        p.copy_(w)
    return norm


def lr_tensor(held: torch.Tensor | None, lr: float, device: torch.device) -> torch.Tensor:
    """The learning rate as a 0-d fp32 tensor on ``device`` (``held`` reused when it is there): the compiled
    updates take it as a tensor, so a new learning rate every step does not recompile them."""
    if held is None or held.device != device:
        held = torch.zeros((), dtype=torch.float32, device=device)
    return held.fill_(lr)


class MasterAdamW(torch.optim.Optimizer):
    """AdamW over bf16 compute weights with fp32 master weights and fp32 moments (module docstring).

    ``state[p]`` holds torch AdamW's entries (``step``, ``exp_avg``, ``exp_avg_sq``, all fp32 on the
    parameter's device) plus ``master``, which ``state_dict`` leaves out: a checkpoint stores the master
    as the model's weights (``master_of``), and a resume hands them back with ``set_master``."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        compile_backend: str = "eager",
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        if len(self.param_groups) != 1:
            raise ValueError("MasterAdamW takes one parameter group")
        self._update = (
            _master_update
            if compile_backend == "eager"
            else torch.compile(_master_update, backend=compile_backend, fullgraph=True, dynamic=False)
        )
        self._lr: torch.Tensor | None = None
        self.max_grad_norm = 0.0
        """The clip of the next ``step()`` (0: none); ``clipped_step`` sets it."""

    def _state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if "exp_avg" not in st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        if "master" not in st:
            st["master"] = p.detach().float().clone()
        return st

    def master_of(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 master of ``p`` (``p`` in fp32 before the first step)."""
        st = self.state.get(p, {})
        return st["master"] if "master" in st else p.detach().float()

    def set_master(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """Resume: the fp32 weights a checkpoint stored become ``p``'s master (``p`` holds their bf16)."""
        self.state[p]["master"] = value.detach().to(device=p.device, dtype=torch.float32).clone()

    @torch.no_grad()
    def step(self, closure=None) -> torch.Tensor:
        """One step with the gradients clipped to ``max_grad_norm`` (0: none); returns the gradients' norm
        before clipping. (Called as ``step()``, as torch's LR schedulers expect to see it called.)"""
        if closure is not None:
            raise ValueError("MasterAdamW.step takes no closure")
        max_norm = self.max_grad_norm
        group = self.param_groups[0]
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return torch.zeros(())
        states = [self._state(p) for p in params]
        self._lr = lr_tensor(self._lr, group["lr"], params[0].device)
        beta1, beta2 = group["betas"]
        return self._update(
            params,
            [p.grad for p in params],
            [s["master"] for s in states],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states],
            self._lr,
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            max_norm=float(max_norm),
        )

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["state"] = {i: {k: v for k, v in st.items() if k != "master"} for i, st in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """torch AdamW's state (this one's, or amp's or fp32's): moments kept in fp32 (torch's own loader
        casts them to the parameter's dtype, bf16 here), on the parameter's device."""
        (saved,) = state_dict["param_groups"]
        group = self.param_groups[0]
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"optimizer state of {len(saved['params'])} parameters, this drafter has {len(group['params'])}"
            )
        group.update({k: v for k, v in saved.items() if k != "params"})
        for idx, p in zip(saved["params"], group["params"], strict=True):
            st = state_dict["state"].get(idx)
            if st:
                self.state[p] = {
                    k: v.to(device=p.device, dtype=torch.float32) for k, v in st.items() if k != "master"
                }


def stochastic_round_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 rounded stochastically: up with probability (distance to the lower bf16 neighbour) /
    ulp, so the expected value is ``x`` (unbiased). Adds a uniform 16-bit integer below bf16's mantissa and
    truncates: on the bit pattern, so it works on the magnitude for both signs. Non-finite values stay as
    they are."""
    bits = x.float().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device)
    rounded = ((bits + noise) & -65536).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x).to(torch.bfloat16)


def _sr_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    lr: torch.Tensor,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    max_norm: float,
) -> torch.Tensor:
    """AdamW (torch's formula) from (clipped) gradients on bf16 weights, in fp32 registers, written back
    stochastically rounded (bf16 moments too; fp32 moments as they are); every tensor is left as it was
    when the norm is not finite. Returns the norm."""
    norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
    )
    finite = torch.isfinite(norm)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0) if max_norm > 0 else torch.ones_like(norm)
    for p, g, m, v, s in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
        step = s + 1
        g32 = g.float() * coef
        m32, v32 = m.float(), v.float()
        m_new = m32 + (g32 - m32) * (1 - beta1)
        v_new = v32 * beta2 + g32 * g32 * (1 - beta2)
        denom = v_new.sqrt() / torch.sqrt(1 - beta2**step) + eps
        w32 = p.float()
        w_new = w32 * (1 - lr * weight_decay) - (lr / (1 - beta1**step)) * m_new / denom
        p.copy_(torch.where(finite, stochastic_round_bf16(w_new), p))
        for state, new in ((m, m_new), (v, v_new)):
            rounded = stochastic_round_bf16(new) if state.dtype == torch.bfloat16 else new
            state.copy_(torch.where(finite, rounded, state))
        s.copy_(torch.where(finite, step, s))
    return norm


class StochasticAdamW(torch.optim.Optimizer):
    """AdamW over bf16 weights with stochastic rounding, no fp32 master (module docstring).

    ``state[p]`` holds torch AdamW's entries (``step`` fp32, ``exp_avg``, ``exp_avg_sq`` in
    ``moment_dtype``). ``state_dict`` hands the moments out as fp32 (what every precision's checkpoint
    holds, so a run resumes in another precision); ``load_state_dict`` takes any precision's state."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        moment_dtype: torch.dtype = torch.bfloat16,
        compile_backend: str = "eager",
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        if len(self.param_groups) != 1:
            raise ValueError("StochasticAdamW takes one parameter group")
        for p in self.param_groups[0]["params"]:
            if p.dtype != torch.bfloat16:
                raise ValueError(f"StochasticAdamW updates bf16 weights, got a {p.dtype} parameter")
        self.moment_dtype = moment_dtype
        self._update = (
            _sr_update
            if compile_backend == "eager"
            else torch.compile(_sr_update, backend=compile_backend, fullgraph=True, dynamic=False)
        )
        self._lr: torch.Tensor | None = None
        self.max_grad_norm = 0.0
        """The clip of the next ``step()`` (0: none); ``clipped_step`` sets it."""

    def _state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if "exp_avg" not in st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            st["exp_avg"] = torch.zeros_like(p, dtype=self.moment_dtype)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moment_dtype)
        return st

    @torch.no_grad()
    def step(self, closure=None) -> torch.Tensor:
        """One step with the gradients clipped to ``max_grad_norm`` (0: none); returns the gradients' norm
        before clipping."""
        if closure is not None:
            raise ValueError("StochasticAdamW.step takes no closure")
        group = self.param_groups[0]
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return torch.zeros(())
        states = [self._state(p) for p in params]
        self._lr = lr_tensor(self._lr, group["lr"], params[0].device)
        beta1, beta2 = group["betas"]
        return self._update(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states],
            self._lr,
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            max_norm=float(self.max_grad_norm),
        )

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["state"] = {i: {k: v.float() for k, v in st.items()} for i, st in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Any precision's AdamW state: the moments cast to ``moment_dtype``, ``step`` kept fp32."""
        (saved,) = state_dict["param_groups"]
        group = self.param_groups[0]
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"optimizer state of {len(saved['params'])} parameters, this drafter has {len(group['params'])}"
            )
        group.update({k: v for k, v in saved.items() if k != "params"})
        for idx, p in zip(saved["params"], group["params"], strict=True):
            st = state_dict["state"].get(idx)
            if st:
                self.state[p] = {
                    k: v.to(device=p.device, dtype=torch.float32 if k == "step" else self.moment_dtype)
                    for k, v in st.items()
                    if k != "master"
                }


def build_optimizer(
    model: torch.nn.Module,
    cfg: OptimConfig,
    *,
    device: torch.device,
    schedule_steps: int,
    compile_backend: str = "eager",
) -> tuple[torch.optim.Optimizer, LrSchedule]:
    """The precision's AdamW + linear warm-up / cosine schedule over ``schedule_steps`` (resized to the
    campaign's length at the first step when no length was given: consumer/schedule.py). Mixed: the
    master-weight AdamW (compiled with ``compile_backend``, the draft layers'); bf16sr: the stochastic-rounding
    AdamW (compiled the same way); otherwise torch's fused
    AdamW, whose kernel also applies the clip (``optim.clipped_step``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    precision = cfg.resolved_precision(device.type)
    if precision == "mixed":
        optimizer = MasterAdamW(
            params, lr=cfg.lr, weight_decay=cfg.weight_decay, compile_backend=compile_backend
        )
    elif precision == "bf16sr":
        optimizer = StochasticAdamW(
            params,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            moment_dtype=getattr(torch, cfg.resolved_moment_dtype()),
            compile_backend=compile_backend,
        )
    else:
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    warmup = max(1, int(cfg.warmup_ratio * schedule_steps))
    return optimizer, LrSchedule(optimizer, warmup, schedule_steps)
