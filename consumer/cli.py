"""``dflash-consume``: one drafter-training process on one GPU (or the CPU).

Several consumers form one torch.distributed group when started with the env:// variables (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), e.g. by ``torchrun`` or ``ops/run_all.sh``.

Exit status (README "Errors and exit codes"): 0 when the spool is drained (or --max-steps reached) and the
final checkpoint is saved; 2 for a user or input error (bad flag, no GPU, a spool of another run or in use,
no S3 credentials, unreachable endpoint, no usable checkpoint), one line; 1 for a runtime failure, one line
(traceback with --log-level DEBUG); 130 when stopped by SIGINT/SIGTERM (after its stop checkpoint).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from dflash.common.cli.help import DefaultsHelpFormatter, plain_text

PROG = "dflash-consume"
EXIT_USAGE, EXIT_FAILURE, EXIT_INTERRUPTED = 2, 1, 130


def _fail(msg: str, code: int = EXIT_USAGE):
    print(f"{PROG}: error: {' '.join(str(msg).split())}", file=sys.stderr, flush=True)
    sys.exit(code)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=plain_text(__doc__), formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--gpu", required=True, help="GPU index (e.g. 5), or 'cpu'")
    p.add_argument("--spool", required=True, help="spool directory the producers write into")
    p.add_argument(
        "--target", required=True, help="target model folder or hub id (config + embedding/lm_head)"
    )
    p.add_argument(
        "--run",
        default=None,
        help="run name (checkpoint folder and trained-sample set key; default: the spool's run, else 'default')",
    )
    p.add_argument(
        "--run-dir", default=None, help="folder for metrics JSONL, plots and logs (default: none written)"
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        help="checkpoint store: s3://bucket/prefix or a local folder (default: no checkpoints)",
    )
    p.add_argument(
        "--resume",
        default="auto",
        choices=["auto", "none"],
        help="auto: resume from the latest good checkpoint of the run; none: start from scratch",
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=500,
        help="checkpoint every N steps (and at the end, and on SIGTERM)",
    )
    p.add_argument(
        "--keep-last", type=int, default=3, help="checkpoints to keep in the store (older ones are deleted)"
    )
    p.add_argument(
        "--max-steps", type=int, default=None, help="stop after N steps (default: when the spool is drained)"
    )
    p.add_argument(
        "--total-steps",
        type=int,
        default=None,
        help="cosine schedule length (default: max-steps, else 10000)",
    )
    p.add_argument("--num-layers", type=int, default=5, help="draft decoder layers")
    p.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="tokens per draft block: the anchor token plus block-size - 1 predicted positions",
    )
    p.add_argument(
        "--context-tokens", type=int, default=4096, help="packed context tokens per step (fixed shape)"
    )
    p.add_argument("--num-anchors", type=int, default=256, help="anchor blocks per step (fixed shape)")
    p.add_argument(
        "--max-anchors-per-doc",
        type=int,
        default=256,
        help="at most this many of a step's anchor blocks from one document (so long documents do not dominate)",
    )
    p.add_argument("--gamma", type=float, default=7.0, help="loss weight decay over block positions")
    p.add_argument(
        "--lr", type=float, default=6e-4, help="peak AdamW learning rate (after warmup, then cosine decay)"
    )
    p.add_argument(
        "--warmup-ratio",
        type=float,
        default=0.04,
        help="fraction of the schedule's steps spent in linear learning-rate warmup, in [0, 1)",
    )
    p.add_argument("--grad-clip", type=float, default=1.0, help="clip the gradient's global L2 norm to this")
    p.add_argument(
        "--eval-every",
        type=int,
        default=500,
        help="steps between decode-order acceptance-length evaluations on the held-out shards the producers "
        "spool with --eval-samples (also before the first step and after the last; 0: never)",
    )
    p.add_argument(
        "--eval-budget",
        type=float,
        default=0.03,
        help="largest share of the run's time periodic evaluations may take; one that would exceed it is "
        "skipped and said in the log",
    )
    p.add_argument("--loss-chunk-tokens", type=int, default=2048, help="query tokens per lm_head+CE chunk")
    p.add_argument(
        "--mask-token-id",
        type=int,
        default=None,
        help="token id of the draft mask (default: chosen from the tokenizer, docs/training.md)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="random seed of the drafter init and anchor sampling (each rank offsets it by its rank)",
    )
    p.add_argument("--log-every", type=int, default=10, help="console/metrics line every N steps")
    p.add_argument(
        "--wandb-project",
        default=None,
        help="log to this wandb project (offline unless WANDB_API_KEY is set; default: no wandb)",
    )
    p.add_argument(
        "--bucket",
        default="random",
        help="claim policy: random, oldest, fullest, or a bucket number",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=60.0,
        help="seconds before a silent consumer's claims are recovered",
    )
    p.add_argument("--no-compile", action="store_true", help="debug only: run the draft layers uncompiled")
    p.add_argument(
        "--compile-backend",
        default="inductor",
        choices=["inductor", "aot_eager", "eager"],
        help="torch.compile backend (aot_eager: CPU tests)",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch threads per CPU consumer (default: torch's own choice)",
    )
    p.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "bf16", "amp", "fp32"],
        help="parameters and Adam state: amp (fp32 + bf16 autocast), bf16 (fastest, but measured to learn "
        "worse), fp32; auto = amp on CUDA, fp32 on the CPU (docs/training.md)",
    )
    p.add_argument(
        "--pool-streams",
        type=int,
        default=4,
        help="samples held for packing, in streams' worth of tokens",
    )
    p.add_argument(
        "--min-split-tokens",
        type=int,
        default=256,
        help="fill a stream with at least this many empty slots with the head of a longer document, its "
        "tail going into a later stream; 0 = never split",
    )
    p.add_argument(
        "--fill-wait-s",
        type=float,
        default=2.0,
        help="seconds to wait for enough samples to fill a stream before packing a short one",
    )
    p.add_argument(
        "--prefetch-steps",
        type=int,
        default=2,
        help="steps packed and copied to the GPU ahead of the one training",
    )
    p.add_argument(
        "--target-layer-ids",
        default=None,
        help="target layers the producers captured, e.g. 1,9,17,25,33 (default: K=5 from 1 to L-3)",
    )
    p.add_argument("--log-level", default="INFO", help="logging level (DEBUG adds tracebacks to errors)")
    p.add_argument(
        "--summary-json",
        default=None,
        help="write a JSON summary of the run here at the end ({rank} is replaced by the rank; default: none)",
    )
    return p


def _parse_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        _fail(f"--target-layer-ids must be comma-separated integers, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s consumer[{os.environ.get('RANK', '0')}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    if args.gpu == "cpu":
        device = "cpu"
    elif args.gpu.isdigit():
        # Own exactly one GPU: nothing else in this process can touch the others.
        os.environ["CUDA_VISIBLE_DEVICES"] = args.gpu
        device = "cuda:0"
    else:
        _fail(f"--gpu must be a GPU index or 'cpu', got {args.gpu!r}")

    from dflash.common.checkpoints.layout import CheckpointCorruptError, CheckpointError
    from dflash.common.checkpoints.store import CheckpointStoreError
    from dflash.common.contract.spool import Spool, SpoolBusyError, SpoolError
    from dflash.consumer.config import TrainConfig

    debug = logging.getLogger().isEnabledFor(logging.DEBUG)
    rank = os.environ.get("RANK", "0")
    if device.startswith("cuda"):  # before anything is touched or loaded
        import torch

        if not torch.cuda.is_available():
            _fail(f"--gpu {args.gpu}: no CUDA device is visible (use --gpu cpu)")
    try:
        if not os.path.isdir(args.spool):
            raise ValueError(
                f"--spool {args.spool}: no such directory (start the producers first, or create it)"
            )
        # The spool belongs to one run: take its run name (or check ours against it), and one consumer
        # group at a time: a live consumer of this rank holds lock-consumer-r<rank>.
        spool = Spool(args.spool)
        recorded = (spool.read_run() or {}).get("run")
        run = args.run or recorded or "default"
        spool.bind_run({"run": run}, who="this consumer")
        lock = spool.acquire_lock(f"consumer-r{rank}", f"dflash-consume rank {rank} of run {run!r}")  # noqa: F841
    except SpoolBusyError as err:
        _fail(f"{err}; this is run {run!r}")
    except (ValueError, SpoolError, OSError) as err:
        _fail(str(err))

    try:
        cfg = TrainConfig(
            spool=args.spool,
            target=args.target,
            run=run,
            run_dir=args.run_dir,
            device=device,
            checkpoint=args.checkpoint,
            resume=args.resume,
            save_every=args.save_every,
            keep_last=args.keep_last,
            max_steps=args.max_steps,
            total_steps=args.total_steps,
            num_layers=args.num_layers,
            block_size=args.block_size,
            context_tokens=args.context_tokens,
            num_anchors=args.num_anchors,
            max_anchors_per_doc=args.max_anchors_per_doc,
            gamma=args.gamma,
            lr=args.lr,
            warmup_ratio=args.warmup_ratio,
            eval_every=args.eval_every,
            eval_budget=args.eval_budget,
            grad_clip=args.grad_clip,
            loss_chunk_tokens=args.loss_chunk_tokens,
            mask_token_id=args.mask_token_id,
            seed=args.seed,
            log_every=args.log_every,
            wandb_project=args.wandb_project,
            bucket=args.bucket,
            heartbeat_timeout_s=args.heartbeat_timeout,
            compile=not args.no_compile,
            compile_backend=args.compile_backend,
            cpu_threads=args.cpu_threads,
            precision=args.precision,
            pool_streams=args.pool_streams,
            min_split_tokens=args.min_split_tokens,
            prefetch_steps=args.prefetch_steps,
            fill_wait_s=args.fill_wait_s,
            target_layer_ids=_parse_ids(args.target_layer_ids),
        )
        from dflash.consumer.trainer import Trainer

        trainer = Trainer(cfg)
    except CheckpointCorruptError as err:
        logging.getLogger(PROG).debug("traceback", exc_info=True)
        _fail(f"{err}; no usable checkpoint: fix or remove it, or start over with --resume none")
    except (ValueError, SpoolError, OSError, CheckpointStoreError, CheckpointError) as err:
        logging.getLogger(PROG).debug("traceback", exc_info=True)
        _fail(str(err))
    except KeyboardInterrupt:
        _fail("interrupted", EXIT_INTERRUPTED)
    except Exception as err:  # noqa: BLE001 - a runtime failure at start-up (e.g. the group's rendezvous)
        logging.getLogger(PROG).debug("traceback", exc_info=True)
        _fail(f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}", EXIT_FAILURE)
    try:
        summary = trainer.train()
        if trainer.metrics is not None:  # the run's end in the metrics, quarantine losses included
            trainer.metrics.write(
                {"event": "end", "time": time.time(), **{k: v for k, v in summary.items() if k != "history"}}
            )
    except KeyboardInterrupt:
        _fail("interrupted", EXIT_INTERRUPTED)
    except Exception as err:  # noqa: BLE001 - a runtime failure: one line; the traceback with DEBUG only
        if debug:
            logging.getLogger(PROG).exception("training failed")
        _fail(f"{type(err).__name__}: {err}", EXIT_FAILURE)
    finally:
        trainer.close()
    summary.pop("history", None)
    if args.summary_json:
        with open(args.summary_json.replace("{rank}", str(summary.get("rank", 0))), "w") as f:
            json.dump(summary, f, indent=2)
    logging.getLogger(PROG).info("done: %s", json.dumps(summary))
    lost = summary.get("samples_quarantined") or 0
    if lost:
        logging.getLogger(PROG).warning(
            "%d samples of %d quarantined shards were not trained (quarantine/ in the spool says why); "
            "the next launch of this run (the same command) produces and trains them",
            lost,
            summary.get("shards_quarantined", 0),
        )
    if getattr(trainer, "_stop_requested", False):
        print(
            f"{PROG}: stopped by a signal at step {summary.get('steps')} (checkpoint saved)", file=sys.stderr
        )
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
