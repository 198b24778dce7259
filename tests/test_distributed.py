"""Several consumers train one drafter: gloo on CPU, the same code path as NCCL on CUDA."""

from __future__ import annotations

import datetime
import json
import os
import subprocess

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port
from pipeline_helpers import consume_cmd, cpu_env, write_synthetic_spool

from dflash.common.drafter.batch import build_draft_batch, pack_samples
from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.model import DFlashDrafter, TargetHead
from dflash.consumer.config import OptimConfig
from dflash.consumer.optim import build_optimizer
from dflash.consumer.step import forward_backward

pytestmark = pytest.mark.pipeline  # every test here starts processes

CFG = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    vocab_size=97,
    num_target_layers=8,
    num_layers=2,
    block_size=4,
    mask_token_id=0,
    target_layer_ids=[1, 2],
)
STEPS = 3


def _model_and_batches():
    torch.manual_seed(0)
    cfg = DrafterConfig(**CFG)
    head = TargetHead(torch.randn(97, 32), torch.randn(97, 32))
    model = DFlashDrafter(cfg, head)
    g = torch.Generator().manual_seed(1)
    batches = []
    for step in range(STEPS):
        per_rank = []
        for rank in range(2):
            n = 40 + 10 * rank + step  # unequal supervised counts: normalisation must be global
            samples = [
                (
                    torch.randint(0, 97, (n,), generator=g),
                    torch.rand(n, generator=g) > 0.2,
                    torch.randn(n, 64, generator=g),
                    rank,
                )
            ]
            packed = pack_samples(samples, context_tokens=64)
            per_rank.append(
                build_draft_batch(
                    packed,
                    block_size=4,
                    num_anchors=8,
                    max_anchors_per_doc=8,
                    mask_token_id=0,
                    gamma=7.0,
                    generator=g,
                )
            )
        batches.append(per_rank)
    return model, batches


def _ddp_worker(rank: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # hang guard: a rendezvous that cannot complete (a port taken meanwhile on a busy box) fails in 2 min
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    model, batches = _model_and_batches()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt, sched = build_optimizer(model, OptimConfig(), device=torch.device("cpu"), schedule_steps=10)
    for step in range(STEPS):
        batch = batches[step][rank]
        w = batch.label_weights.sum(dtype=torch.float64).reshape(1)
        dist.all_reduce(w)
        forward_backward(model, ddp, batch, loss_scale=2 / w.float(), chunk_tokens=16)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, out_path.format(rank=rank))
    dist.barrier()
    # Exit without tearing the group down: torch's gloo ProcessGroup destructor (run when DDP's reducer is
    # freed) joins its worker threads while holding the GIL, and a worker freeing a finished work item
    # needs the GIL: a deadlock seen on a quiet box (the test hung until its guard).
    os._exit(0)


def test_two_gloo_ranks_equal_one_process_on_the_same_data(tmp_path):
    """DDP + global-token normalisation == one process that sees both ranks' batches (sum / total weight).
    Measured max |diff| ~1e-7 (fp32 reduction order); asserted <= 1e-5."""
    out = str(tmp_path / "rank{rank}.pt")
    mp.start_processes(_ddp_worker, args=(free_port(), out), nprocs=2, start_method="spawn", join=True)
    ranks = [torch.load(out.format(rank=r), weights_only=True) for r in range(2)]
    for k in ranks[0]:
        assert torch.equal(ranks[0][k], ranks[1][k]), f"{k} differs across ranks"

    torch.set_num_threads(1)
    model, batches = _model_and_batches()
    opt, sched = build_optimizer(model, OptimConfig(), device=torch.device("cpu"), schedule_steps=10)
    for step in range(STEPS):
        total = sum(float(b.label_weights.sum(dtype=torch.float64)) for b in batches[step])
        for b in batches[step]:
            forward_backward(model, model, b, loss_scale=1 / total, chunk_tokens=16)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    single = model.state_dict()
    worst = max(float((single[k] - ranks[0][k]).abs().max()) for k in single)
    assert worst <= 1e-5, worst


def test_two_consumer_processes_keep_identical_weights_and_stop_together(tmp_path, tiny_target):
    """Two dflash-consume processes (env:// rendezvous, gloo) on one spool: every sample trained exactly
    once across the group, both stop when the spool is drained, weights identical on both ranks."""
    spool = write_synthetic_spool(
        tmp_path / "spool",
        hidden_size=256,
        layer_ids=[1, 2, 3, 4, 5],
        num_shards=5,
        samples_per_shard=6,
        tokens_per_sample=96,
        vocab=4096,
    )
    port = free_port()
    procs = []
    for rank in range(2):
        env = cpu_env(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        cmd = consume_cmd(
            spool.root,
            tiny_target,
            "--summary-json",
            str(tmp_path / "summary{rank}.json"),
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--run",
            "ddp",
        )
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p in procs:  # both ranks' logs: the first failure is often the other rank's
        assert p.returncode == 0, "\n".join(o[-3000:] for o in outs)
    s = [json.loads((tmp_path / f"summary{r}.json").read_text()) for r in range(2)]
    assert s[0]["weights_sha256"] == s[1]["weights_sha256"]
    assert s[0]["steps"] == s[1]["steps"] > 0
    assert s[0]["world_size"] == 2
    # the checkpoint's trained set is the union of both ranks: all 30 samples, each once
    from dflash.common.checkpoints.load import load_checkpoint

    ckpt = load_checkpoint(str(tmp_path / "ckpt"), "ddp")
    assert sorted(ckpt.trained.indices().tolist()) == list(range(30))
    assert not any(spool.ready_dir.iterdir())
