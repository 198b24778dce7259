"""The consumer's training loop: claimed shards -> DFlash drafter steps -> checkpoints.

Build order is visible in ``Trainer.__init__`` (distributed -> model -> optimizer -> schedule ->
checkpoint resume -> data). ``train()`` reads top to bottom: take the next staged step, agree across ranks
whether anyone has data, step, ack, log, checkpoint.

The GPU never waits for the host: the input pipeline (``input_pipeline.py``) packs, samples anchors and
copies step n+1 while step n runs; nothing in a step reads a device value back (loss, accuracy and τ sums
stay on the device until a log line); the per-step agreement between ranks goes over a gloo group on the
CPU (a host round trip of well under a millisecond that never waits for the GPU, which is kept busy by
the steps already launched); checkpoints copy the state to host memory on the compute stream and write
and upload it from a background thread (``async_checkpoint.py``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  first import in the main thread: concurrent first imports from threads crash
import zarr
from transformers import AutoConfig, AutoTokenizer

from dflash.common.contract.sample_set import SampleSet
from dflash.common.contract.spool import Spool
from dflash.common.drafter.batch import DraftBatch, build_draft_batch, empty_packed
from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.dflash import recompile_count
from dflash.common.drafter.layers import SLIDING
from dflash.common.drafter.model import initial_drafter
from dflash.common.metrics import MetricsLog
from dflash.common.target.head import load_target_head
from dflash.consumer import distributed as D
from dflash.consumer.async_checkpoint import AsyncCheckpointer
from dflash.consumer.campaign import CampaignPlan, WarmupCosine, read_plan
from dflash.consumer.checkpointing import CheckpointingMixin
from dflash.consumer.config import TrainConfig
from dflash.consumer.feed import ShardFeed
from dflash.consumer.held_out import HeldOutEval
from dflash.consumer.input_pipeline import InputPipeline, StepInput
from dflash.consumer.interval_log import IntervalLogMixin
from dflash.consumer.loop_watch import LoopWatch, StepProfiler
from dflash.consumer.optim import clipped_step
from dflash.consumer.step import (
    StepStats,
    build_optimizer,
    cast_parameters,
    compile_drafter,
    forward_backward,
    make_loss,
)

log = logging.getLogger(__name__)

WARMUP_STEPS_FOR_RECOMPILES = 2


def _maybe_tokenizer(target: str):
    """The target's tokenizer when it ships one: it names the mask token (see choose_mask_token_id)."""
    try:
        return AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class StepAgreement:
    """The ranks' joint view before a step (Trainer._agree)."""

    have: bool  # some rank holds a step
    everyone: bool  # every rank holds a step or has no more data: stepping wastes no rank's slot
    exhausted: bool
    stop: bool
    fatal: bool
    epoch: int
    tokens: int

    @classmethod
    def of(cls, ranks: list[list[int]], *, last_epoch: int) -> StepAgreement:
        """From every rank's [has a step, drained, stop asked, fatal save error, its step's epoch, its
        tokens] (``Trainer._agree``): only the ranks whose step is of the lowest epoch train data this step
        (the others pad and keep theirs), and the step's epoch stays the last one when no rank has data."""
        epochs = [r[4] for r in ranks if r[0]]
        lowest = min(epochs) if epochs else last_epoch
        return cls(
            have=any(r[0] for r in ranks), everyone=all(r[0] or r[1] for r in ranks),
            exhausted=all(r[1] for r in ranks), stop=any(r[2] for r in ranks), fatal=any(r[3] for r in ranks),
            epoch=lowest, tokens=sum(r[5] for r in ranks if r[0] and r[4] == lowest),
        )  # fmt: skip


class Trainer(CheckpointingMixin, IntervalLogMixin):
    """One consumer process's training: build everything in a visible order, then ``train()``."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self._set_up_device()
        self.dist = D.init_distributed(self.device)
        self.consumer_id = f"r{self.dist.rank}-{os.getpid()}"
        torch.manual_seed(cfg.seed + self.dist.rank)
        # The folder must exist (the CLI checks); its layout is created if the producers have not yet.
        self.spool = Spool(cfg.spool, create=True)
        self._build_model()
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg, self.device)
        self.loss_fn = make_loss(cfg, self.device)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.step = 0
        self.trained = SampleSet(epoch=0)
        self._replanning = False  # the data sized the schedule: its length follows the tokens trained
        self.generator = torch.Generator().manual_seed(cfg.seed * 1000 + self.dist.rank)
        # checkpoint resume (every rank loads the same files)
        self.store = None
        self._fatal_save_error: str | None = None
        self._outage_stop: str | None = None
        if cfg.checkpoint:
            self._open_store()
        self.checkpointer = AsyncCheckpointer(self.device)
        self.last_save_stall_s: float | None = None
        self._last_save_error: str | None = None
        self._saved_step: int | None = None
        if self.store is not None and cfg.resume == "auto":
            self._resume()
        self._build_data()
        self._open_logs()
        self.held_out = HeldOutEval(self.spool, budget=cfg.eval_budget, metrics=self.metrics, wandb=self.wandb)
        self._stop_requested = False
        self._deferred: StepInput | None = None  # a step held back while other ranks finish an epoch
        self._step_epoch = 0  # the campaign epoch of the last step (all its samples are of it)
        self._recompiles_after_warmup = 0
        self._recompiles_at_warmup: int | None = None
        self.first_step_s: float | None = None
        self.plan: CampaignPlan | None = None
        self._t_process = time.monotonic()
        self.history: list[dict] = []
        self.watch = LoopWatch(self.device, gc_mode=cfg.gc_mode, freeze_at_step=WARMUP_STEPS_FOR_RECOMPILES)
        window = cfg.profile_steps and cfg.profile_window
        out = Path(cfg.run_dir or ".") / f"profile-r{self.dist.rank}.txt"
        self.profiler = StepProfiler(window, out, self.device) if window else None

    def _set_up_device(self) -> None:
        self.device = torch.device(self.cfg.device)
        if self.device.type == "cuda":
            if self.cfg.expandable_segments and not {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & set(os.environ):
                # before this process's first CUDA allocation (the CLI and the benches make none before)
                torch.cuda.memory._set_allocator_settings("expandable_segments:True")
            if self.device.index is None:  # "cuda": the current device, named (streams and DDP want an index)
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu":
            torch.set_flush_denormal(True)  # tiny fp32 optimizer states turn denormal and crawl otherwise
            if self.cfg.cpu_threads:
                torch.set_num_threads(self.cfg.cpu_threads)
        if self.cfg.decode_threads:  # the feed's decoder: its chunk-decoding thread pool in this process
            zarr.config.set({"threading.max_workers": self.cfg.decode_threads})
        self.compute_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32

    def _build_model(self) -> None:
        """The drafter, sized from the target's config, with the target's frozen embedding + lm_head read
        from its safetensors; compiled; wrapped in DDP when the group has several ranks."""
        cfg = self.cfg
        self.drafter_config = DrafterConfig.from_target_config(
            AutoConfig.from_pretrained(cfg.target),
            num_layers=cfg.num_layers,
            block_size=cfg.block_size,
            target_layer_ids=cfg.target_layer_ids,
            mask_token_id=cfg.mask_token_id,
            tokenizer=_maybe_tokenizer(cfg.target),
            layer_types=cfg.layer_types,
            sliding_window=cfg.sliding_window,
        )
        if SLIDING in self.drafter_config.layer_types:
            log.info("draft layers %s, sliding window %d", self.drafter_config.layer_types, self.drafter_config.sliding_window)
        head = load_target_head(cfg.target, dtype=self.compute_dtype, device=self.device)
        self.drafter_config.target_fingerprint = head.fingerprint  # checkpoints and exports carry it
        self.model = initial_drafter(self.drafter_config, head, seed=cfg.seed + self.dist.rank).to(self.device)
        cast_parameters(self.model, cfg.param_dtype(self.device.type))
        if cfg.compile:
            compile_drafter(self.model, cfg.resolved_compile_backend(self.device.type))
        self.train_model: torch.nn.Module = self.model
        if self.dist.enabled:
            self.train_model = torch.nn.parallel.DistributedDataParallel(
                self.model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                gradient_as_bucket_view=True,
            )

    def _build_data(self) -> None:
        """The data path, in threads of this process: the shard feed (claims, decode, packing, acks, shard
        deletion) and the input pipeline (anchors, labels, the host->device copy)."""
        cfg = self.cfg
        self._padding_input: StepInput | None = None
        self.feed = ShardFeed(
            self.spool,
            self.consumer_id,
            skip=self.trained,  # the live set: also drops duplicates of samples trained since the resume
            pin_memory=self.device.type == "cuda",
            **self._feed_kwargs(),
        )
        self.inputs = InputPipeline(
            lambda wait_s: self.feed.next_packed(wait_s=wait_s),
            self._build_batch,
            self.feed.exhausted,
            device=self.device,
            hidden_dtype=self.compute_dtype,
            depth=cfg.prefetch_steps,
        )

    def _feed_kwargs(self) -> dict:
        """ShardFeed's settings from the config."""
        cfg = self.cfg
        return dict(
            context_tokens=cfg.context_tokens,
            bucket=cfg.claim_bucket,
            expected_layer_ids=list(self.drafter_config.target_layer_ids),
            heartbeat_timeout_s=cfg.heartbeat_timeout_s,
            pool_streams=cfg.pool_streams,
            min_split_tokens=cfg.min_split_tokens or None,
            fill_wait_s=cfg.fill_wait_s,
        )

    def _open_logs(self) -> None:
        """Metrics JSONL, the sample ledger (which samples each committed step trained, for exact audits
        after crashes) and wandb (rank 0)."""
        self.metrics = self.ledger = None
        if self.cfg.run_dir:
            metrics_dir = Path(self.cfg.run_dir) / "metrics"
            self.metrics = MetricsLog(metrics_dir / f"consumer-{self.dist.rank}.jsonl")
            self.ledger = MetricsLog(metrics_dir / f"ledger-r{self.dist.rank}.jsonl")
        self.wandb = self._init_wandb() if self.dist.is_main else None

    def train(self) -> dict:
        cfg = self.cfg
        self._install_signal_handlers()
        stats = StepStats()
        t_start = time.monotonic()
        try:
            while cfg.max_steps is None or self.step < cfg.max_steps:
                t_wait = time.perf_counter()
                item, self._deferred = self._deferred or self.inputs.get(timeout=0.5), None
                self.watch.waited(time.perf_counter() - t_wait)
                self._poll_saves()  # a finished background save said at once; an outage past its bound stops
                agreed = self._agree(item)
                if agreed.fatal:  # the store refuses checkpoints: the state to local disk, one line, stop
                    self._stop_to_fallback(self._fatal_save_error or self._outage_stop)
                if agreed.stop:
                    log.warning("stop requested: saving a checkpoint at step %d", self.step)
                    break
                if not agreed.have:
                    if agreed.exhausted:
                        break
                    continue
                if not agreed.everyone:
                    # another rank is still filling its stream (its feed waits while producers produce):
                    # stepping now would give it a step of padding, a whole rank's slot empty. Keep ours.
                    self._deferred, item = item, None
                    continue
                if item is not None and item.batch.epoch > agreed.epoch:
                    # another rank still trains an earlier epoch: keep this step for later (no step mixes
                    # epochs, so none trains one row twice) and take part with padding
                    self._deferred, item = item, None
                if item is None:  # others have data: take part in the collective step with padding only
                    item = self._padding()
                self._step_epoch = agreed.epoch
                tokens = agreed.tokens
                if self.first_step_s is None:
                    self._plan_campaign()
                    self._say_phase("compiling" if self._compiles else "training")
                self._count_tokens(tokens)  # before the step: the scheduler sets the next step's rate from it
                if self.profiler is not None:
                    self.profiler.before_step(self.step)
                self.watch.begin()
                self._train_step(item, stats)
                self.watch.end(self.step)
                if self.profiler is not None:
                    self.profiler.after_step(self.step)
                self._replan()
                if self.first_step_s is None:
                    self.first_step_s = time.monotonic() - t_start
                    if self.store is not None and self.dist.is_main:
                        self.checkpointer.prepare(self._device_state())  # host buffers, in the background
                self._check_recompiles()
                if self.step % cfg.log_every == 0:
                    self._log(stats)
                    stats = StepStats()
                if cfg.eval_every and self.step % cfg.eval_every == 0:
                    self._evaluate(periodic=True)
                if self.store is not None and self.step % cfg.save_every == 0:
                    self.save()
            if stats.steps:
                self._log(stats)
            if cfg.eval_every and self.held_out.last_step != self.step and self.first_step_s is not None:
                self._evaluate()
            # always: when the last periodic save wrote this step, save() only waits for its background
            # write (exiting while it runs aborts the process and loses the checkpoint)
            self.save(final=True)
        finally:
            self.watch.close()
            self.inputs.close()
            self.feed.close()
        return {
            "steps": self.step,
            "rank": self.dist.rank,
            "world_size": self.dist.world_size,
            "weights_sha256": self.weights_digest(),
            "samples_trained": len(self.trained),
            # lost to this launch (corrupt shards, not in the trained set: the next launch re-produces them)
            "shards_quarantined": self.feed.counters.shards_quarantined,
            "samples_quarantined": self.feed.counters.samples_quarantined,
            "samples_duplicate": self.feed.counters.samples_duplicate,
            "first_step_s": self.first_step_s,
            "recompiles_after_warmup": self._recompiles_after_warmup,
            "fill": self.feed.counters.tokens_packed / max(1, self.feed.counters.slots_packed),
            "last_save_stall_s": self.last_save_stall_s,
            "eval_s": self.held_out.budget.spent_s,
            "history": self.history,
        }

    def weights_digest(self) -> str:
        """sha256 over the trainable weights: equal on every rank of a healthy DDP group."""
        h = hashlib.sha256()
        for name, p in sorted(self.model.named_parameters()):
            if p.requires_grad:
                h.update(name.encode())
                # the stored bytes as they are (no fp32 copy: 12 s at 32B-class size, measured)
                h.update(p.detach().contiguous().view(torch.uint8).cpu().numpy())
        return h.hexdigest()

    def _hidden_width(self) -> int:
        return self.drafter_config.hidden_size * len(self.drafter_config.target_layer_ids)

    def _batch_kwargs(self) -> dict:
        """build_draft_batch's settings (besides the stream and the generator)."""
        cfg = self.cfg
        return dict(
            block_size=cfg.block_size,
            num_anchors=cfg.num_anchors,
            max_anchors_per_doc=cfg.max_anchors_per_doc,
            mask_token_id=self.drafter_config.mask_token_id,
            gamma=cfg.gamma,
        )

    def _build_batch(self, packed, generator: torch.Generator | None = None) -> DraftBatch:
        """Anchors, draft blocks, labels and weights of one packed stream (input pipeline thread)."""
        return build_draft_batch(packed, generator=generator or self.generator, **self._batch_kwargs())

    def _padding(self) -> StepInput:
        """A step of pure padding (zero weight) for a rank without data while others step; built once, with
        its own generator so the input pipeline's anchor draws stay exactly the serial path's."""
        if self._padding_input is None:
            packed = empty_packed(self.cfg.context_tokens, self._hidden_width())
            batch = self._build_batch(packed, torch.Generator().manual_seed(0))
            self._padding_input = StepInput(
                batch.to(self.device, hidden_dtype=self.compute_dtype), tokens=0, weight=0.0, padding=True
            )
        return self._padding_input

    def _train_step(self, item: StepInput, stats: StepStats) -> None:
        cfg = self.cfg
        batch = item.batch
        # The global supervised weight stays a device tensor: no host sync before the forward.
        weight = torch.tensor([item.weight], dtype=torch.float64)
        global_weight = D.all_reduce_sum(weight.to(self.device, non_blocking=True), self.dist)
        result = forward_backward(
            self.model,
            self.train_model,
            batch,
            loss_scale=self.dist.world_size / global_weight.clamp(min=1e-6),
            lce=self.loss_fn,
        )
        grad_norm = clipped_step(self.optimizer, self.trainable, cfg.grad_clip)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        trained = [] if item.padding else self.feed.commit()
        self.trained.add(trained)
        if self.ledger is not None:
            self.ledger.write({"step": self.step, "pid": os.getpid(), "epoch": self._step_epoch, "samples": trained})
        stats.add(result, weight=item.weight, grad_norm=grad_norm, tokens=item.tokens, samples=len(trained))

    def _count_tokens(self, step_tokens: int) -> None:
        """The step's tokens (all ranks) into the schedule's count: every rank adds the same sums, so every
        rank computes the same learning rate."""
        self.scheduler.lr_lambdas[0].tokens_done += step_tokens

    def _replan(self) -> None:
        """When the data sized the schedule, keep its estimated length right (``WarmupCosine.replan``)."""
        schedule: WarmupCosine = self.scheduler.lr_lambdas[0]
        if self._replanning:
            schedule.replan(
                self.step, self.plan.campaign.tokens * self.plan.epochs.epochs,
                self.cfg.context_tokens * self.dist.world_size,
            )  # fmt: skip

    def _plan_campaign(self) -> None:
        """Read what the data gives (rank 0's reading for every rank), size the schedule from it unless a
        length was given, and say the plan in one line. Called at the first step: producers write the
        campaign before their first shard."""
        cfg = self.cfg
        mine = read_plan(self.spool, context_tokens=cfg.context_tokens, world_size=self.dist.world_size)
        self.plan = D.broadcast_object(mine, self.dist)
        schedule: WarmupCosine = self.scheduler.lr_lambdas[0]
        override = None
        if cfg.total_steps or cfg.max_steps:
            override = f"--total-steps {cfg.total_steps}" if cfg.total_steps else f"--max-steps {cfg.max_steps}"
        elif self.plan is not None:
            schedule.resize(self.plan.total_steps, cfg.warmup_ratio)
            planned = self.plan.campaign.tokens * self.plan.epochs.epochs
            schedule.follow_tokens(planned, cfg.context_tokens * self.dist.world_size)
            self._replanning = True
            if self.step:  # resumed: the rest of the data from what the checkpoint trained
                if not schedule.tokens_done:  # a checkpoint from before the count: full streams, as planned
                    schedule.tokens_done = self.step * cfg.context_tokens * self.dist.world_size
                self._replan()
            for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
                group["lr"] = base * schedule(self.scheduler.last_epoch)  # this step's factor, resized
            self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        if self.plan is None:
            log.warning("no campaign in spool %s (producers have not counted the data): schedule of %d steps", self.spool.root, schedule.total_steps)  # fmt: skip
            return
        if self.dist.is_main:
            log.info(self.plan.describe(
                schedule.warmup_steps, override=override, total_steps=schedule.total_steps, resumed=self.step
            ))  # fmt: skip
        if cfg.eval_every and self.step == 0:  # the untrained drafter: the "before" of every later figure
            self._evaluate()


    def _agree(self, item: StepInput | None) -> StepAgreement:
        """What every rank decides together before a step, from one small host-side collective: anyone
        has data, everyone is drained, a stop was asked, a save failed with no checkpoint to fall back
        on, the lowest epoch any rank's step holds (the step's epoch), and the tokens the step trains."""
        mine = [
            item is not None, self.inputs.exhausted() and self._deferred is None and item is None,
            self._stop_requested, self._fatal_save_error is not None or self._outage_stop is not None,
            item.batch.epoch if item is not None else -1, item.tokens if item is not None else 0,
        ]  # fmt: skip
        return StepAgreement.of(D.gather_ints(mine, self.dist), last_epoch=self._step_epoch)

    @property
    def _compiles(self) -> bool:
        return self.cfg.compile and self.cfg.resolved_compile_backend(self.device.type) != "eager"

    def _say_phase(self, phase: str) -> None:
        """A metrics event saying what the consumer does before its first step record (the demo's progress
        line and dflash-status show it: a first compile takes a minute and must not look like a hang)."""
        if self.metrics is not None and self.dist.is_main:
            self.metrics.write({"event": "phase", "phase": phase, "step": self.step, "time": time.time()})
        if phase == "compiling" and self.dist.is_main:
            log.info("compiling the draft layers (the first step; cached for later launches)")

    def _evaluate(self, *, periodic: bool = False) -> None:
        """The held-out decode-order τ at this step (rank 0; consumer/held_out.py)."""
        if self.dist.is_main and self.step == 0:
            self._say_phase("evaluating")
        if self.dist.is_main:
            in_loop = self.history[-1]["tau"] if self.history else None
            self.held_out.evaluate(self.model, self.step, in_loop_tau=in_loop, periodic=periodic)

    def _check_recompiles(self) -> None:
        if self.step == WARMUP_STEPS_FOR_RECOMPILES:
            self._recompiles_at_warmup = recompile_count()
        elif self._recompiles_at_warmup is not None:
            extra = recompile_count() - self._recompiles_at_warmup
            if extra > self._recompiles_after_warmup:
                self._recompiles_after_warmup = extra
                log.error(
                    "RECOMPILE after warm-up at step %d (%d so far): a step's shapes changed — this is a bug",
                    self.step,
                    extra,
                )


    def _install_signal_handlers(self) -> None:
        def request_stop(signum, _frame):
            log.warning(
                "received %s: finishing the step, then checkpoint and exit", signal.Signals(signum).name
            )
            self._stop_requested = True

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        D.close_distributed()
