"""Stream fill over whole runs, on the CPU: the real producer bucketing, spool, shards, feed and packing, with
the GPUs replaced by clocks.

Producer threads bucket log-normal chat lengths exactly as ``dflash-produce`` does (``producer/buckets.py``)
and write real shards (hidden width 8) into a real spool at a set token rate, heartbeating their phase;
consumer ranks run the real ``ShardFeed`` (claims, decode, ``best_fit`` packing) and take a step when the
trainer's rule says so, each step "taking" ``context / consumer_rate`` seconds. Fill = real tokens packed /
(steps x ranks x context): the share of the consumers' slots that held data.

Rates are a real run's (default: RESULTS.md's one-GPU run, 1.91 M tokens, producer 14.5 K tok/s, consumer
27 K tok/s), played ``--time-scale`` times faster: every rate is multiplied by it and every wait the code
makes (fill wait, heartbeat period) divided by it, so the run's shape is the real one's.

``--policy old``: the feed packed as soon as it held one stream's worth, and a short stream after 2 s
without enough samples whatever the producers were doing; the ranks stepped as soon as any had data (the
others padded). ``--policy new`` (today's code): a stream waits for a full pool (``pool_streams``) while
a producer produces (up to --fill-wait-s 30), and the ranks step when every rank holds a step or has no
more data (consumer/agreement.py).

    python ops/bench/fill_sim.py --context 4096 --ranks 1                       # the one-GPU run
    python ops/bench/fill_sim.py --context 4096 --ranks 3 --producer-rate 135000 --consumer-rate 23000
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from dflash.common.contract.names import shard_name
from dflash.common.contract.shard import Shard, ShardMeta
from dflash.common.contract.shard_writer import write_shard
from dflash.common.contract.spool import Spool
from dflash.consumer.config import FeedConfig
from dflash.consumer.feed import ShardFeed
from dflash.producer.buckets import BucketConfig, Bucketer, Sample

WIDTH = 8  # hidden width of the shards: the packing does not care, the writes stay cheap


def lengths(rng: random.Random, total: int, *, median: int, sigma: float, cap: int) -> list[int]:
    out, n = [], 0
    while n < total:
        x = min(cap, max(32, int(math.exp(rng.gauss(math.log(median), sigma)))))
        out.append(x)
        n += x
    return out


def produce(
    spool: Spool, pid: str, sizes: list[int], first_index: int, rate: float, stop: threading.Event
) -> None:
    """One producer: bucket the samples as dflash-produce does, write each batch as a shard at ``rate``."""
    bucketer, t0, written = Bucketer(BucketConfig()), time.monotonic(), 0
    spool.heartbeat("producer", pid, {"phase": "produce"})

    def write(batch, seq: int) -> None:
        nonlocal written
        seqlens = [len(s) for s in batch.samples]
        t = sum(seqlens)
        written += t
        wait = t0 + written / rate - time.monotonic()  # the GPU's forward of this batch
        if wait > 0 and stop.wait(wait):
            return
        shard = Shard(
            input_ids=torch.zeros(t, dtype=torch.int32),
            loss_mask=torch.ones(t, dtype=torch.bool),
            cu_seqlens=torch.tensor([0, *np.cumsum(seqlens).tolist()], dtype=torch.int64),
            sample_index=torch.tensor([s.sample_index for s in batch.samples], dtype=torch.int64),
            hidden=torch.zeros(t, WIDTH, dtype=torch.bfloat16),
            meta=ShardMeta(
                target_model="sim", layer_ids=[1], hidden_size=WIDTH, producer_id=pid, bucket=batch.bucket
            ),
        )
        tmp = spool.new_tmp_path(shard_name(batch.bucket, pid, seq))
        spool.publish(tmp, nbytes=write_shard(tmp, shard))
        spool.heartbeat("producer", pid, {"phase": "produce", "tokens": written})

    seq = 0
    for i, n in enumerate(sizes):
        for batch in bucketer.add(Sample(first_index + i, np.zeros(n, np.int32), np.ones(n, bool))):
            write(batch, seq)
            seq += 1
    for batch in bucketer.flush():
        write(batch, seq)
        seq += 1
    spool.heartbeat("producer", pid, {"phase": "done", "tokens": written})
    spool.mark_done(pid)


def simulate(args: argparse.Namespace, root: Path) -> dict:
    spool = Spool(root)
    rng = random.Random(args.seed)
    sizes = lengths(rng, args.tokens, median=args.median, sigma=args.sigma, cap=args.max_length)
    pids = [f"p{i}" for i in range(args.producers)]
    spool.register_producers(pids)
    stop = threading.Event()
    threads = [
        threading.Thread(
            target=produce,
            args=(
                spool,
                pid,
                sizes[i :: args.producers],
                i * 10**7,
                args.producer_rate * args.time_scale / args.producers,
                stop,
            ),
            daemon=True,
        )
        for i, pid in enumerate(pids)
    ]
    old, scale = args.policy == "old", args.time_scale
    feeds = [
        ShardFeed(
            spool,
            f"r{r}",
            context_tokens=args.context,
            bucket="random",
            heartbeat_timeout_s=60.0 / scale,
            fill_wait_s=(2.0 if old else args.fill_wait_s) / scale,
            poll_s=0.01,
            pool_streams=1 if old else args.pool_streams,  # old: packed at one stream's worth
            min_split_tokens=256 if old else FeedConfig.min_split_tokens,
        )
        for r in range(args.ranks)
    ]
    for t in threads:
        t.start()
    held: list = [None] * args.ranks
    steps = tokens = 0
    step_s = args.context / (args.consumer_rate * args.time_scale)
    t0 = time.monotonic()
    try:
        while True:
            for r, feed in enumerate(feeds):
                if held[r] is None and not feed.exhausted():
                    held[r] = feed.next_packed(wait_s=0.01)
            have = [h is not None for h in held]
            done = [feeds[r].exhausted() and held[r] is None for r in range(args.ranks)]
            if all(done):
                break
            if not any(have) or (not old and not all(h or d for h, d in zip(have, done, strict=True))):
                continue  # nothing to train yet, or (new) a rank still fills its stream
            time.sleep(step_s)  # the step on the GPUs
            steps += 1
            for r, packed in enumerate(held):
                if packed is not None:
                    tokens += int((packed.doc_ids >= 0).sum())
                    feeds[r].commit()
            held = [None] * args.ranks
    finally:
        stop.set()
        for feed in feeds:
            feed.close()
    wall = time.monotonic() - t0
    slots = steps * args.ranks * args.context
    return {
        "policy": args.policy,
        "context": args.context,
        "ranks": args.ranks,
        "producers": args.producers,
        "producer_rate": args.producer_rate,
        "consumer_rate_per_rank": args.consumer_rate,
        "time_scale": scale,
        "tokens": sum(sizes),
        "samples": len(sizes),
        "median": args.median,
        "sigma": args.sigma,
        "steps": steps,
        "steps_if_full": math.ceil(tokens / (args.ranks * args.context)),
        "fill": round(tokens / max(1, slots), 4),
        "wall_s": round(wall, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", choices=["old", "new"], default="new")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--producers", type=int, default=1)
    p.add_argument(
        "--producer-rate", type=float, default=14_500, help="real tokens/s, all producers together"
    )
    p.add_argument("--consumer-rate", type=float, default=27_000, help="real context tokens/s per rank")
    p.add_argument("--time-scale", type=float, default=4.0, help="play the run this many times faster")
    p.add_argument("--tokens", type=int, default=1_910_000, help="the one-GPU run of RESULTS.md: 1.91 M")
    p.add_argument("--median", type=int, default=900)
    p.add_argument("--sigma", type=float, default=0.8)
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--fill-wait-s", type=float, default=30.0)
    p.add_argument(
        "--pool-streams", type=int, default=FeedConfig.pool_streams, help="new policy: the feed's pool"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dflash-fill-"))
    try:
        out = simulate(args, root / "spool")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
