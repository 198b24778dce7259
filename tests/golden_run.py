"""The seeded CPU training run whose numbers are locked in tests/data/golden_cpu_run.json.

The consumer's own pieces, in the trainer's order, on the shipped tiny target (its config, tokenizer,
embedding and lm_head): ``build_drafter``, ``build_optimizer`` and ``make_loss`` from a ``TrainConfig``
whose defaults are dflash-consume's (learning rate, warm-up, gamma, clip, precision), then per step a packed
stream of seeded documents (the same stream every step, so the loss falls as the drafter learns it; the
anchors are drawn afresh), ``build_draft_batch`` (anchors, blocks, labels, weights), ``forward_backward``,
``clipped_step`` and the schedule, as ``Trainer.train_step`` runs them. fp32, one thread, no compile: the
same numbers on every run on one machine. What is recorded: every step's loss and the final trainable
weights' sha256 (``Trainer.weights_digest``'s), with per-tensor norms to tell a legitimately different CPU
build (norms within a tight tolerance) from a changed loss path.

Regenerate after a change that is meant to alter the numbers (say why in the commit):

    .venv/bin/python tests/golden_run.py --write
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
from pathlib import Path

import torch

from dflash.common.drafter.batch import build_draft_batch, pack_samples
from dflash.consumer.config import TrainConfig
from dflash.consumer.distributed import DistInfo
from dflash.consumer.drafter_setup import build_drafter, set_up_device
from dflash.consumer.optim import build_optimizer, clipped_step
from dflash.consumer.step import forward_backward, make_loss
from dflash.tools.demo.assets import tiny_target_dir

GOLDEN = Path(__file__).resolve().parent / "data" / "golden_cpu_run.json"
STEPS = 12
SHAPES = dict(num_layers=2, block_size=8, context_tokens=256, num_anchors=24, max_anchors_per_doc=8)
"""Small enough for a second on one core; every default that shapes the loss is dflash-consume's."""


def _stream(gen: torch.Generator, *, context: int, vocab: int, width: int):
    """A packed stream of seeded documents: token ids, a loss mask (a prompt, then the answer), hidden
    states rounded to bf16 as shards hold them."""
    samples, used, index = [], 0, 0
    while True:
        n = int(torch.randint(24, 96, (1,), generator=gen))
        if used + n > context:
            break
        ids = torch.randint(4, vocab, (n,), generator=gen)
        mask = torch.arange(n) >= int(torch.randint(4, n // 2, (1,), generator=gen))
        hidden = torch.randn(n, width, generator=gen).to(torch.bfloat16)
        samples.append((ids, mask, hidden, index))
        used, index = used + n, index + 1
    return pack_samples(samples, context_tokens=context)


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over the trainable weights, as ``Trainer.weights_digest`` computes it."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if p.requires_grad:
            h.update(name.encode())
            h.update(p.detach().contiguous().view(torch.uint8).cpu().numpy())
    return h.hexdigest()


def run(steps: int = STEPS) -> dict:
    """The seeded run (module docstring): its losses, final weights' digest and norms, and where it ran.
    The caller's torch threads and random state are left as they were."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return _run(steps)
    finally:
        torch.set_num_threads(threads)


def _run(steps: int) -> dict:
    cfg = TrainConfig.from_flat(
        spool=".", target=str(tiny_target_dir()), total_steps=steps, compile=False, **SHAPES
    )
    cpu, _ = set_up_device("cpu", cfg.host)  # the trainer's CPU settings (denormals flushed)
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=cpu)
    drafter_config, model, _ = build_drafter(
        cfg.target,
        cfg.drafter,
        seed=cfg.seed,
        optim=cfg.optim,
        compile_options=cfg.compile_options,
        device=cpu,
        compute_dtype=torch.float32,
        dist=dist,
    )
    optimizer, schedule = build_optimizer(model, cfg.optim, device=cpu, schedule_steps=cfg.schedule_steps)
    loss_fn = make_loss(cfg.step, cpu)
    trainable = [p for p in model.parameters() if p.requires_grad]
    data, anchors = torch.Generator().manual_seed(1), torch.Generator().manual_seed(cfg.seed * 1000)
    width = drafter_config.hidden_size * len(drafter_config.target_layer_ids)
    packed = _stream(data, context=cfg.step.context_tokens, vocab=drafter_config.vocab_size, width=width)
    losses = []
    for _ in range(steps):
        batch = build_draft_batch(
            packed,
            generator=anchors,
            block_size=cfg.drafter.block_size,
            num_anchors=cfg.step.num_anchors,
            max_anchors_per_doc=cfg.step.max_anchors_per_doc,
            mask_token_id=drafter_config.mask_token_id,
            gamma=cfg.step.gamma,
        ).to(cpu, hidden_dtype=torch.float32)
        weight = batch.label_weights.sum(dtype=torch.float64)
        result = forward_backward(model, model, batch, loss_scale=1.0 / weight.clamp(min=1e-6), lce=loss_fn)
        clipped_step(optimizer, trainable, cfg.optim.grad_clip)
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(result.loss_sum.detach()) / float(weight))
    return {
        "steps": steps,
        "losses": losses,
        "weights_sha256": weights_digest(model),
        "weight_norms": {
            n: float(p.detach().norm()) for n, p in sorted(model.named_parameters()) if p.requires_grad
        },
        "where": {
            "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine(),
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The locked numbers of the seeded CPU run (tests/golden_run.py).")
    p.add_argument("--write", action="store_true", help=f"record this run's numbers in {GOLDEN}")
    args = p.parse_args(argv)
    got = run()
    if args.write:
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
        print(f"wrote {GOLDEN}: losses {got['losses'][0]:.6f} .. {got['losses'][-1]:.6f}")
    else:
        print(json.dumps(got, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
