"""The consumer's training loop: claimed shards -> DFlash drafter steps -> checkpoints.

Build order is visible in ``Trainer.__init__`` (device -> distributed -> drafter -> optimizer and schedule
-> checkpoint resume -> data -> logs). ``train()`` reads top to bottom: take the next staged step, agree
across ranks whether anyone has data, step, ack, log, checkpoint. The trainer owns parts that each decide
one thing: the ``Checkpointer`` (checkpointing/checkpointer.py) when to save and what a failed save means,
the ``IntervalLogger`` (interval_log.py) when to log, the ``LrSchedule`` (schedule.py) each step's rate,
the ``ConsumerHeartbeat`` (heartbeat.py) that this consumer is alive; each is handed its section of the
config and the state it reads (checkpointing/state.py) rather than reaching into the trainer.

The GPU never waits for the host: the input pipeline (``input_pipeline.py``) packs, samples anchors and
copies step n+1 while step n runs; nothing in a step reads a device value back (loss, accuracy and τ sums
stay on the device until a log line); the per-step agreement between ranks goes over a gloo group on the
CPU (a host round trip of well under a millisecond that never waits for the GPU, which is kept busy by
the steps already launched); checkpoints copy the state to host memory on the compute stream and write
and upload it from a background thread (``checkpointing/background.py``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import time
from pathlib import Path

import torch

from dflash.common.compile import import_dynamo_in_main_thread
from dflash.common.contract.spool import Spool
from dflash.common.drafter.batch import DraftBatch, build_draft_batch, empty_packed
from dflash.common.drafter.dflash import recompile_count
from dflash.common.drafter.loss import selector_weight
from dflash.common.fault import fault_point
from dflash.common.metrics import MetricsLog
from dflash.consumer import distributed as D
from dflash.consumer.agreement import RankView, StepAgreement
from dflash.consumer.campaign import CampaignPlan, read_plan
from dflash.consumer.checkpointing.checkpointer import Checkpointer
from dflash.consumer.checkpointing.state import TrainProgress, TrainState
from dflash.consumer.config import TrainConfig
from dflash.consumer.data_clock import DataPathClock
from dflash.consumer.drafter_setup import build_drafter, check_producers_target, set_up_device
from dflash.consumer.feed import ShardFeed
from dflash.consumer.heartbeat import ConsumerHeartbeat, dead_producers_phrase
from dflash.consumer.held_out import HeldOutEval
from dflash.consumer.input_pipeline import InputPipeline, StepInput
from dflash.consumer.interval_log import IntervalLogger, init_wandb
from dflash.consumer.loop_watch import LoopWatch, StepProfiler
from dflash.consumer.optim import build_optimizer, clipped_step
from dflash.consumer.step import StepStats, forward_backward, make_loss

import_dynamo_in_main_thread()  # before the checkpoint and feed threads start

log = logging.getLogger(__name__)

WARMUP_STEPS_FOR_RECOMPILES = 2
CAMPAIGN_WAIT_LOG_S = 30.0  # waiting for the producers' campaign: one line this often


class Trainer:
    """One consumer process's training: build everything in a visible order, then ``train()``. Composed of
    parts it owns: the checkpointer (resume, saves), the interval logger (log lines), the schedule, the
    data path (heartbeat, feed, input pipeline) and the held-out evaluation. ``device`` is where the
    launch placed this process (consumer/launch.py): 'cpu', 'cuda' or 'cuda:N'."""

    def __init__(self, cfg: TrainConfig, *, device: str = "cpu") -> None:
        self.cfg = cfg
        self.device, self.compute_dtype = set_up_device(device, cfg.host)
        self.dist = D.init_distributed(self.device)
        self.consumer_id = f"r{self.dist.rank}-{os.getpid()}"
        torch.manual_seed(cfg.seed + self.dist.rank)
        # The folder must exist (the CLI checks); its layout is created if the producers have not yet.
        self.spool = Spool(cfg.spool, create=True)
        backend = cfg.compile_options.resolved_backend(self.device.type)
        self.drafter_config, self.model, self.train_model = build_drafter(
            cfg.target,
            cfg.drafter,
            seed=cfg.seed,
            optim=cfg.optim,
            compile_options=cfg.compile_options,
            device=self.device,
            compute_dtype=self.compute_dtype,
            dist=self.dist,
        )
        # before any checkpoint or shard is touched: the producers fed this drafter's target and layers
        check_producers_target(self.spool.read_run(), self.drafter_config, cfg.target, cfg.spool)
        self.optimizer, self.schedule = build_optimizer(
            self.model,
            cfg.optim,
            device=self.device,
            schedule_steps=cfg.schedule_steps,
            compile_backend=backend,
        )
        self.loss_fn = make_loss(cfg.step, self.device)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.progress = TrainProgress()
        state = TrainState(self.model, self.optimizer, self.schedule, self.drafter_config, self.progress)
        self.generator = torch.Generator().manual_seed(cfg.seed * 1000 + self.dist.rank)
        # the store is proven writable and the run resumed before any file of this launch is written
        self.checkpoints = Checkpointer(
            cfg.checkpoints,
            state,
            run=cfg.run_name,
            run_dir=cfg.run_dir,
            run_config=cfg.to_dict(),
            dist=self.dist,
            device=self.device,
        )
        self.checkpoints.resume()  # every rank loads the same files
        self._fit_schedule_to_flags()
        self._build_data()
        self._build_logs(state)
        self.stop_requested = False
        """A SIGTERM or SIGINT asked this process to stop: it finishes the step, saves and ends."""
        self._deferred: StepInput | None = None  # a step held back while other ranks finish an epoch
        self._recompiles_after_warmup = 0
        self._recompiles_at_warmup: int | None = None
        self.first_step_s: float | None = None
        self.plan: CampaignPlan | None = None

    @property
    def step(self) -> int:
        """Optimizer steps taken, resumed ones counted."""
        return self.progress.step

    def _build_data(self) -> None:
        """The data path, in threads of this process: the heartbeat (this consumer alive to the others, the
        spool's depth), the shard feed (claims, decode, packing, acks, shard deletion) and the input
        pipeline (anchors, labels, the host->device copy)."""
        feed = self.cfg.feed
        self._padding_input: StepInput | None = None
        # the two data threads' stage times, which the loop's waits are charged to
        self.data_clock = DataPathClock()
        self.heartbeat = ConsumerHeartbeat(self.spool, self.consumer_id, timeout_s=feed.heartbeat_timeout_s)
        self.feed = ShardFeed(
            self.spool,
            self.consumer_id,
            context_tokens=self.cfg.step.context_tokens,
            skip=self.progress.trained,  # the live set: also drops duplicates of samples trained since the resume
            bucket=feed.claim_bucket,
            heartbeat_timeout_s=feed.heartbeat_timeout_s,
            pool_streams=feed.pool_streams,
            min_split_tokens=feed.min_split_tokens or None,
            fill_wait_s=feed.fill_wait_s,
            pin_memory=self.device.type == "cuda",
            expected_layer_ids=list(self.drafter_config.target_layer_ids),
            heartbeat=self.heartbeat,
            clock=self.data_clock.feed,
            packing_clock=self.data_clock.pipeline,
        )
        self.inputs = InputPipeline(
            lambda wait_s: self.feed.next_packed(wait_s=wait_s),
            self._build_batch,
            self.feed.exhausted,
            device=self.device,
            hidden_dtype=self.compute_dtype,
            depth=feed.prefetch_steps,
            clock=self.data_clock.pipeline,
        )

    def _build_logs(self, state: TrainState) -> None:
        """What the run reports, opened once it is resumed (no file of this launch is written before the
        store is proven writable): the metrics JSONL and the sample ledger (which samples each committed
        step trained, for exact audits after crashes) per rank under ``--run-dir``, wandb (rank 0), the
        held-out evaluation, the loop's watch, the interval logger and a profiler of ``--profile-steps``."""
        cfg = self.cfg
        self.metrics = self.ledger = None
        if cfg.run_dir:
            metrics_dir = Path(cfg.run_dir) / "metrics"
            self.metrics = MetricsLog(metrics_dir / f"consumer-{self.dist.rank}.jsonl")
            self.ledger = MetricsLog(metrics_dir / f"ledger-r{self.dist.rank}.jsonl")
        self.checkpoints.report_to(self.metrics)
        self.wandb = self._open_wandb() if self.dist.is_main else None
        self.held_out = HeldOutEval(
            self.spool, budget=cfg.logs.eval_budget, metrics=self.metrics, wandb=self.wandb
        )
        self.watch = LoopWatch(
            self.device,
            gc_mode=cfg.host.gc_mode,
            freeze_at_step=WARMUP_STEPS_FOR_RECOMPILES,
            data_clock=self.data_clock,
        )
        self.logger = IntervalLogger(
            cfg.logs,
            state,
            block_size=cfg.drafter.block_size,
            context_tokens=cfg.step.context_tokens,
            dist=self.dist,
            device=self.device,
            watch=self.watch,
            heartbeat=self.heartbeat,
            metrics=self.metrics,
            wandb=self.wandb,
        )
        window = cfg.logs.profile_window
        out = Path(cfg.run_dir or ".") / f"profile-r{self.dist.rank}.txt"
        self.profiler = StepProfiler(window, out, self.device) if window else None

    def train(self) -> dict:
        """Train until ``--max-steps``, the spool is drained or a stop is asked; the final save; a summary."""
        self._install_signal_handlers()
        try:
            self._loop()
            # always: when the last periodic save wrote this step, save() only waits for its background
            # write (exiting while it runs aborts the process and loses the checkpoint)
            self.checkpoints.save(final=True)
        finally:
            self.watch.close()
            self.inputs.close()
            self.feed.close()
            self.heartbeat.close()
        return self._summary()

    def _loop(self) -> None:
        cfg = self.cfg
        stats = StepStats()
        t_start = time.monotonic()
        while cfg.max_steps is None or self.progress.step < cfg.max_steps:
            item, agreed = self._next_input()
            if agreed is None:
                break
            if item is None:
                continue
            if self.first_step_s is None:
                fault_point(f"consumer{self.dist.rank}", "first-step")
                if not self._plan_campaign():
                    break
                self._say_phase("compiling" if self._compiles else "training")
            self._run_step(item, agreed, stats)
            if self.first_step_s is None:
                self.first_step_s = time.monotonic() - t_start
                self.checkpoints.prepare()  # host buffers, in the background
            self._check_recompiles()
            if self.logger.due(self.progress.step):
                self._log(stats)
                stats = StepStats()
            if cfg.logs.eval_every and self.progress.step % cfg.logs.eval_every == 0:
                self._evaluate(periodic=True)
            self.checkpoints.save_if_due()
        if stats.steps:
            self._log(stats)
        if (
            cfg.logs.eval_every
            and self.held_out.last_step != self.progress.step
            and self.first_step_s is not None
        ):
            self._evaluate()

    def _next_input(self) -> tuple[StepInput | None, StepAgreement | None]:
        """The step to train now and the ranks' agreement on it: (input, agreement) to step (padding when
        this rank has nothing for it), (None, agreement) to look again, (None, None) to stop."""
        with self.watch.waiting():
            item, self._deferred = self._deferred or self.inputs.get(timeout=0.5), None
        self.checkpoints.poll()  # a finished background save said at once; an outage past its bound stops
        agreed = self._agree(item)
        if agreed.fatal:  # the store refuses checkpoints: the state to local disk, one line, stop
            self.checkpoints.stop_to_fallback(self.checkpoints.stop_reason)
        if agreed.stop:
            log.warning("stop requested: saving a checkpoint at step %d", self.progress.step)
            return None, None
        if not agreed.have:
            return None, (None if agreed.exhausted else agreed)
        if not agreed.everyone:
            # another rank is still filling its stream (its feed waits while producers produce):
            # stepping now would give it a step of padding, a whole rank's slot empty. Keep ours.
            self._deferred = item
            return None, agreed
        if item is not None and item.batch.epoch > agreed.epoch:
            # another rank still trains an earlier epoch: keep this step for later (no step mixes
            # epochs, so none trains one row twice) and take part with padding
            self._deferred, item = item, None
        # no data of this rank's: take part in the collective step with padding only
        return item if item is not None else self._padding(), agreed

    def _run_step(self, item: StepInput, agreed: StepAgreement, stats: StepStats) -> None:
        """One optimizer step of the agreed epoch, its tokens counted into the schedule before it."""
        self.progress.epoch = agreed.epoch
        self.schedule.count_tokens(agreed.tokens)  # before the step: it sets the next step's rate from it
        if self.profiler is not None:
            self.profiler.before_step(self.progress.step)
        self.watch.begin()
        self.train_step(item, stats)
        self.watch.end(self.progress.step)
        if self.profiler is not None:
            self.profiler.after_step(self.progress.step)
        self.schedule.replan(self.progress.step)

    def _summary(self) -> dict:
        counters = self.feed.counters
        return {
            "steps": self.progress.step,
            "rank": self.dist.rank,
            "world_size": self.dist.world_size,
            "weights_sha256": self.weights_digest(),
            "samples_trained": len(self.progress.trained),
            # lost to this launch (corrupt shards, not in the trained set: the next launch re-produces them)
            "shards_quarantined": counters.shards_quarantined,
            "samples_quarantined": counters.samples_quarantined,
            "samples_duplicate": counters.samples_duplicate,
            "first_step_s": self.first_step_s,
            "recompiles_after_warmup": self._recompiles_after_warmup,
            "fill": counters.tokens_packed / max(1, counters.slots_packed),
            "last_save_stall_s": self.checkpoints.last_save_stall_s,
            "eval_s": self.held_out.budget.spent_s,
            "history": self.logger.history,
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

    def _build_batch(self, packed, generator: torch.Generator | None = None) -> DraftBatch:
        """Anchors, draft blocks, labels and weights of one packed stream (input pipeline thread)."""
        step = self.cfg.step
        return build_draft_batch(
            packed,
            generator=generator or self.generator,
            block_size=self.cfg.drafter.block_size,
            num_anchors=step.num_anchors,
            max_anchors_per_doc=step.max_anchors_per_doc,
            mask_token_id=self.drafter_config.mask_token_id,
            gamma=step.gamma,
        )

    def _padding(self) -> StepInput:
        """A step of pure padding (zero weight) for a rank without data while others step; built once, with
        its own generator so the input pipeline's anchor draws stay exactly the serial path's."""
        if self._padding_input is None:
            packed = empty_packed(self.cfg.step.context_tokens, self._hidden_width())
            batch = self._build_batch(packed, torch.Generator().manual_seed(0))
            self._padding_input = StepInput(
                batch.to(self.device, hidden_dtype=self.compute_dtype), tokens=0, weight=0.0, padding=True
            )
        return self._padding_input

    def train_step(self, item: StepInput, stats: StepStats) -> None:
        """Forward, backward, optimizer and schedule step; the step's samples acked and into the ledger."""
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
            selector_alpha=self._selector_alpha(),
        )
        grad_norm = clipped_step(self.optimizer, self.trainable, self.cfg.optim.grad_clip)
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        trained = [] if item.padding else self.feed.commit()
        self.progress.trained.add(trained)
        if self.ledger is not None:
            record = {
                "step": self.progress.step,
                "pid": os.getpid(),
                "epoch": self.progress.epoch,
                "samples": trained,
            }
            self.ledger.write(record)
        stats.add(result, weight=item.weight, grad_norm=grad_norm, tokens=item.tokens, samples=len(trained))

    def _selector_alpha(self) -> float:
        """A DFlash2 drafter's selector-loss weight this step (0 through its warm-up, then ramped)."""
        if self.drafter_config.arch != "dflash2":
            return 0.0
        step = self.cfg.step
        return selector_weight(
            self.step,
            self.schedule.total_steps,
            step.selector_loss_alpha,
            step.selector_warmup_ratio,
            step.selector_ramp_ratio,
        )

    def _plan_campaign(self) -> bool:
        """Read what the data gives (rank 0's reading for every rank; waited for, see ``_await_campaign``),
        size the schedule from it unless a length was given, and say the plan in one line. Called at the
        first step: producers write the campaign before their first shard. False: a stop came first (every
        rank agrees), no step is to be trained."""
        cfg, schedule, step = self.cfg, self.schedule, self.progress.step
        context_tokens = cfg.step.context_tokens
        override = None
        total_steps = cfg.optim.total_steps
        if total_steps or cfg.max_steps:
            override = f"--total-steps {total_steps}" if total_steps else f"--max-steps {cfg.max_steps}"
        self.plan, stopped = self._await_campaign(context_tokens, wait=override is None)
        if stopped:
            return False  # stopped while waiting for the campaign: no step on a made-up schedule
        if override is None and self.plan is not None:
            planned = self.plan.campaign.tokens * self.plan.epochs.epochs
            step_tokens = context_tokens * self.dist.world_size
            schedule.size_from_data(
                self.plan.total_steps, cfg.optim.warmup_ratio, planned, step_tokens, step=step
            )
        if self.plan is None and override is None and step and schedule.on_steps:
            # resumed on a checkpoint's curve of steps, the length unknown: the length a fresh run gets
            change = schedule.fit_length(cfg.schedule_steps, cfg.optim.warmup_ratio, step=step)
            if change and self.dist.is_main:
                log.warning("schedule: %s (no length given, no campaign in the spool)", change)
        if self.plan is None:
            log.warning(
                "no campaign in spool %s (producers have not counted the data): schedule of %d steps",
                self.spool.root,
                schedule.total_steps,
            )
            return True
        if self.dist.is_main:
            log.info(
                self.plan.describe(
                    schedule.warmup_steps, override=override, total_steps=schedule.total_steps, resumed=step
                )
            )
        if cfg.logs.eval_every and step == 0:  # the untrained drafter: the "before" of every later figure
            self._evaluate()
        return True

    def _await_campaign(self, context_tokens: int, *, wait: bool) -> tuple[CampaignPlan | None, bool]:
        """The campaign plan, rank 0's reading for every rank; with ``wait``, waited for while the spool's
        producers record a plan (their run record has one) but have not written its campaign yet, a line
        every ``CAMPAIGN_WAIT_LOG_S``; (plan, whether a stop ended the wait: every rank's answer).

        Why wait: producers write the campaign before their first shard, so a shard without it comes from
        a launch that lost a worker before its count (or from a node whose producers have not counted
        yet). Sizing the schedule without it trained on a made-up length of 10000 steps (lr 9e-6 .. 4e-5
        where the real plan's warm-up peaks at 6e-4) and counted those samples trained."""
        t0 = said = time.monotonic()
        while True:
            mine = read_plan(self.spool, context_tokens=context_tokens, world_size=self.dist.world_size)
            missing = wait and mine is None and "plan" in (self.spool.read_run() or {})
            stop = any(r[0] for r in D.gather_ints([int(self.stop_requested)], self.dist))
            plan, missing = D.broadcast_object((mine, missing), self.dist)
            if not missing or stop:
                return plan, stop and missing
            now = time.monotonic()
            if now - said >= CAMPAIGN_WAIT_LOG_S or said == t0:
                said = now
                if self.dist.is_main:
                    log.warning(
                        "waiting for the campaign in spool %s (%.0f s; state/campaign-n<node>.json, written by "
                        "dflash-produce once every worker counted its slice): the learning-rate schedule is "
                        "sized from it, no step trains before it%s",
                        self.spool.root,
                        now - t0,
                        dead_producers_phrase(self.spool, timeout_s=self.cfg.feed.heartbeat_timeout_s),
                    )
            time.sleep(1.0)

    def _fit_schedule_to_flags(self) -> None:
        """A resumed run with a length given by flag trains on a curve of that length: the checkpoint's
        curve (its old length) is re-planned over it from this step, and the change said in one line. A
        length the run has already passed is refused: every further step would train at lr 0."""
        cfg, step = self.cfg, self.progress.step
        given = cfg.optim.total_steps or cfg.max_steps
        if not step or not given or (cfg.max_steps is not None and cfg.max_steps <= step):
            return  # fresh (the curve is the flag's), data-sized, or nothing left to train
        if given <= step:
            raise ValueError(
                f"--total-steps {given}: run {cfg.run_name!r} resumes at step {step}, so every further step "
                f"would train at lr 0; give a --total-steps above {step} to extend it (the schedule is "
                "re-planned over the new length), or leave it out to size the schedule from the data"
            )
        change = self.schedule.fit_length(given, cfg.optim.warmup_ratio, step=step)
        if change and self.dist.is_main:
            flag = f"--total-steps {given}" if cfg.optim.total_steps else f"--max-steps {given}"
            log.warning("schedule: %s (%s)", change, flag)

    def _agree(self, item: StepInput | None) -> StepAgreement:
        """What every rank decides together before a step, from one small host-side collective: anyone
        has data, everyone is drained, a stop was asked, a save failed with no checkpoint to fall back
        on, the lowest epoch any rank's step holds (the step's epoch), and the tokens the step trains."""
        mine = RankView(
            has_step=item is not None,
            drained=self.inputs.exhausted() and self._deferred is None and item is None,
            stop_asked=self.stop_requested,
            save_failed=self.checkpoints.stop_reason is not None,
            epoch=item.batch.epoch if item is not None else -1,
            tokens=item.tokens if item is not None else 0,
            starved=item is None and self._deferred is None and not self.feed.producers_producing,
        )
        return StepAgreement.of(D.gather_ints(mine.encode(), self.dist), last_epoch=self.progress.epoch)

    @property
    def _compiles(self) -> bool:
        return self.cfg.compile_options.resolved_backend(self.device.type) != "eager"

    def _say_phase(self, phase: str) -> None:
        """A metrics event saying what the consumer does before its first step record (the demo's progress
        line and dflash-status show it: a first compile takes a minute and must not look like a hang)."""
        if self.metrics is not None and self.dist.is_main:
            self.metrics.write(
                {"event": "phase", "phase": phase, "step": self.progress.step, "time": time.time()}
            )
        if phase == "compiling" and self.dist.is_main:
            log.info("compiling the draft layers (the first step; cached for later launches)")

    def _log(self, stats: StepStats) -> None:
        """The interval's log line, after the saves that finished in it are said."""
        if stats.steps:
            self.checkpoints.report_finished()
        self.logger.log(stats, self.plan)

    def _evaluate(self, *, periodic: bool = False) -> None:
        """The held-out decode-order τ at this step (rank 0; consumer/held_out.py)."""
        if self.dist.is_main and self.progress.step == 0:
            self._say_phase("evaluating")
        if self.dist.is_main:
            history = self.logger.history
            in_loop = history[-1]["tau"] if history else None
            self.held_out.evaluate(self.model, self.progress.step, in_loop_tau=in_loop, periodic=periodic)

    def _check_recompiles(self) -> None:
        if self.progress.step == WARMUP_STEPS_FOR_RECOMPILES:
            self._recompiles_at_warmup = recompile_count()
        elif self._recompiles_at_warmup is not None:
            extra = recompile_count() - self._recompiles_at_warmup
            if extra > self._recompiles_after_warmup:
                self._recompiles_after_warmup = extra
                log.error(
                    "RECOMPILE after warm-up at step %d (%d so far): a step's shapes changed — this is a bug",
                    self.progress.step,
                    extra,
                )

    def _install_signal_handlers(self) -> None:
        def request_stop(signum, _frame):
            log.warning(
                "received %s: finishing the step, then checkpoint and exit", signal.Signals(signum).name
            )
            self.stop_requested = True

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)

    def _open_wandb(self):
        """The wandb run of ``--wandb-project`` (rank 0), its config the run's without the store's URL."""
        config = self.cfg.to_dict()
        config["checkpoints"].pop("store")
        run, run_dir = self.cfg.run_name, self.cfg.run_dir
        return init_wandb(self.cfg.logs.wandb_project, run=run, run_dir=run_dir, config=config)

    def record_end(self, event: dict) -> None:
        """How the run ended, as the last record of this rank's metrics (dflash-status shows it finished,
        stopped or failed); the summary's history is left out."""
        if self.metrics is None:
            return
        try:
            self.metrics.write({k: v for k, v in {**event, "time": time.time()}.items() if k != "history"})
        except OSError:
            pass  # the run dir itself may be what failed

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        D.close_distributed()
