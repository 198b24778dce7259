"""The seeded CPU training run whose numbers are locked in tests/data/golden_cpu_run.json.

What runs is dflash-consume's own ``Trainer`` (consumer/trainer.py), in this process, on the CPU: the
shard feed (claim, decode, best-fit packing with a split document), the input pipeline (anchors, labels,
weights), ``Trainer.train_step`` (forward, backward, the clipped optimizer step, ack and ledger) and the
learning-rate schedule sized from the data (the spool's campaign record: no ``--max-steps`` and no
``--total-steps``, so the curve runs on the tokens trained). The spool is written here from a fixed seed:
``SHARDS`` shards of the tiny target's width, one producer, done before the trainer starts, with the
campaign record producers write before their first shard. Every default that shapes the loss is
dflash-consume's; the flags given set the size (``SHAPES``), and three choices keep the numbers
independent of the machine and its speed:

- ``cpu_threads=1``: torch splits a large reduction over its threads (by default one per core), so the
  summation order, and the last bits of a sum, could follow the machine's core count. At these sizes two
  threads measured the same bits as one; one thread keeps it so on any machine and at any size.
- ``bucket="oldest"``: shards are claimed in name order (the default "random" shuffles with Python's
  global random state).
- the documents' lengths (``DOCS``): the feed packs whatever it has decoded when it is asked for a
  stream, so which shards are in its pool depends on the decode thread's speed. With these lengths every
  arrival order gives the same streams (``tests/test_golden_numbers.py`` checks it over all of them
  with the feed's own ``best_fit``): each shard is exactly two streams, the first best-fit (135, then
  85 over 68), then 68 split (36 | 32), the second the split's tail and the rest, and no sample of a later
  shard ever fits ahead of the current shard's.

What is recorded: every step's loss, rate and gradient norm (the trainer's per-step log records), the
samples each step trained (the run's ledger), and the norm of each trainable tensor's change over the run
(how far training moved it: a changed update moves it differently). fp32 on the CPU rounds differently
under each of ATen's vector kernels (AVX-512, AVX2, none), so the test compares within tolerances
measured across them (tests/test_golden_numbers.py says how).

Regenerate after a change that is meant to alter the numbers (say why in the commit):

    .venv/bin/python tests/golden_run.py --write
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

from dflash.common.contract.names import shard_name
from dflash.common.contract.shard import Shard, ShardMeta
from dflash.common.contract.shard_writer import write_shard
from dflash.common.contract.spool import Spool
from dflash.common.drafter.layers import default_target_layer_ids
from dflash.consumer.config import TrainConfig
from dflash.consumer.trainer import Trainer
from dflash.tools.demo.assets import tiny_target_dir

GOLDEN = Path(__file__).resolve().parent / "data" / "golden_cpu_run.json"
SHAPES = dict(num_layers=2, block_size=8, context_tokens=256, num_anchors=16, max_anchors_per_doc=8)
"""Small enough for a step in tens of milliseconds on one core."""
DOCS = (135, 68, 85, 179, 45)
"""Each shard's documents, in order: 512 tokens, two streams of 256 whatever the decode thread's timing."""
SHARDS = 6
"""12 steps."""
RUN = "golden"
FLAGS = dict(compile=False, cpu_threads=1, bucket="oldest", log_every=1, eval_every=0)
"""The flags that are not sizes: eager (the CPU's path), one thread and name-order claims (the module
docstring says why), a log record per step, no held-out evaluation (the spool has none)."""


def write_spool(root: Path, target: Path) -> Spool:
    """A finished spool of ``SHARDS`` seeded shards at ``target``'s width (a prompt, then the answer, per
    document; hidden states in bf16 as producers write them), with the run's plan and the campaign's size."""
    config = json.loads((target / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    layers = default_target_layer_ids(config["num_hidden_layers"])
    spool = Spool(root)
    g = torch.Generator().manual_seed(1)
    tokens = sum(DOCS)
    for seq in range(SHARDS):
        mask = torch.cat([torch.arange(n) >= int(torch.randint(4, n // 3, (1,), generator=g)) for n in DOCS])
        shard = Shard(
            input_ids=torch.randint(4, vocab, (tokens,), generator=g, dtype=torch.int32),
            loss_mask=mask,
            cu_seqlens=torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int64),
            sample_index=torch.arange(seq * len(DOCS), (seq + 1) * len(DOCS), dtype=torch.int64),
            hidden=torch.randn(tokens, len(layers) * hidden, generator=g).to(torch.bfloat16),
            meta=ShardMeta(
                target_model="tiny", layer_ids=layers, hidden_size=hidden, producer_id="p0", bucket=max(DOCS)
            ),
        )
        tmp = spool.new_tmp_path(shard_name(max(DOCS), "p0", seq))
        spool.publish(tmp, nbytes=write_shard(tmp, shard))
    samples = SHARDS * len(DOCS)
    spool.bind_run({"run": RUN, "plan": {"rows": samples, "epochs": 1}})
    spool.write_campaign(
        0,
        {
            "node_rank": 0,
            "num_nodes": 1,
            "epochs": 1,
            "samples": samples,
            "tokens": SHARDS * tokens,
            "loss_tokens": int(SHARDS * tokens * 0.8),
        },
    )
    spool.register_producers(["p0"])
    spool.mark_done("p0")
    return spool


def run(**flags) -> dict:
    """The seeded run (module docstring), ``flags`` (dflash-consume's, as ``TrainConfig.from_flat`` takes
    them) over ``FLAGS`` and ``SHAPES``: per step its loss, rate, gradient norm and samples; per
    trainable tensor the norm of its change; where it ran. The caller's torch threads, random state and
    denormal setting are left as they were (a Trainer sets all three)."""
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]), tempfile.TemporaryDirectory(prefix="dflash-golden-") as tmp:
            return _run(Path(tmp), flags)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)


def _run(tmp: Path, flags: dict) -> dict:
    target = tiny_target_dir()
    spool = write_spool(tmp / "spool", target)
    cfg = TrainConfig.from_flat(
        spool=str(spool.root),
        target=str(target),
        run=RUN,
        run_dir=str(tmp / "run"),
        **{**FLAGS, **SHAPES, **flags},
    )
    trainer = Trainer(cfg)
    try:
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        summary = trainer.train()
        moved = {
            n: float((p.detach() - before[n]).norm())
            for n, p in sorted(trainer.model.named_parameters())
            if p.requires_grad
        }
    finally:
        trainer.close()
    history = summary["history"]
    ledger = [
        json.loads(line) for line in (tmp / "run" / "metrics" / "ledger-r0.jsonl").read_text().splitlines()
    ]
    return {
        "steps": summary["steps"],
        "losses": [r["loss"] for r in history],
        "lrs": [r["lr"] for r in history],
        "grad_norms": [r["grad_norm"] for r in history],
        "samples": [r["samples"] for r in ledger],
        "update_norms": moved,
        "schedule_total_steps": trainer.schedule.total_steps,
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
