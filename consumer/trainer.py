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

import logging
import os
import signal
import time
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  first import in the main thread: concurrent first imports from threads crash

from dflash.common.checkpoints.load import load_latest_good, restore_rng_state
from dflash.common.checkpoints.redact import redact
from dflash.common.checkpoints.save import capture_rng_state, save_checkpoint
from dflash.common.checkpoints.store import CheckpointStoreError, open_store
from dflash.common.contract.sample_set import SampleSet
from dflash.common.contract.spool import Spool
from dflash.common.drafter.attention import recompile_count
from dflash.common.drafter.batch import DraftBatch, build_draft_batch, empty_packed
from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.decode_tau import EvalBudget, HeldOutDoc, decode_order_tau, read_held_out
from dflash.common.metrics import MetricsLog, format_console_line
from dflash.common.target.head import load_target_head
from dflash.consumer import distributed as D
from dflash.consumer.async_checkpoint import AsyncCheckpointer
from dflash.consumer.campaign import CampaignPlan, WarmupCosine, eta_s, read_plan
from dflash.consumer.config import TrainConfig
from dflash.consumer.feed import ShardFeed
from dflash.consumer.input_pipeline import InputPipeline, StepInput
from dflash.consumer.step import (
    StepStats,
    build_optimizer,
    cast_parameters,
    compile_drafter,
    forward_backward,
    initial_drafter,
)

log = logging.getLogger(__name__)

WARMUP_STEPS_FOR_RECOMPILES = 2


def _maybe_tokenizer(target: str):
    """The target's tokenizer when it ships one: it names the mask token (see choose_mask_token_id)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError):
        return None


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda":
            if self.device.index is None:  # "cuda": the current device, named (streams and DDP want an index)
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.dist = D.init_distributed(self.device)
        self.consumer_id = f"r{self.dist.rank}-{os.getpid()}"
        torch.manual_seed(cfg.seed + self.dist.rank)
        if self.device.type == "cpu":
            torch.set_flush_denormal(True)  # tiny fp32 optimizer states turn denormal and crawl otherwise
            if cfg.cpu_threads:
                torch.set_num_threads(cfg.cpu_threads)
        self.compute_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        # The folder must exist (the CLI checks); its layout is created if the producers have not yet.
        self.spool = Spool(cfg.spool, create=True)

        # model: sized from the target's config; frozen embedding + lm_head read from its safetensors
        from transformers import AutoConfig

        target_config = AutoConfig.from_pretrained(cfg.target)
        tokenizer = _maybe_tokenizer(cfg.target)
        self.drafter_config = DrafterConfig.from_target_config(
            target_config,
            num_layers=cfg.num_layers,
            block_size=cfg.block_size,
            target_layer_ids=cfg.target_layer_ids,
            mask_token_id=cfg.mask_token_id,
            tokenizer=tokenizer,
        )
        head = load_target_head(cfg.target, dtype=self.compute_dtype, device=self.device)
        seed = cfg.seed + self.dist.rank
        self.model = initial_drafter(self.drafter_config, head, seed=seed).to(self.device)
        cast_parameters(self.model, cfg.param_dtype(self.device.type))
        if cfg.compile:
            compile_drafter(self.model, cfg.compile_backend)
        self.train_model: torch.nn.Module = self.model
        if self.dist.enabled:
            self.train_model = torch.nn.parallel.DistributedDataParallel(
                self.model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                gradient_as_bucket_view=True,
            )
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg, self.device)
        self.step = 0
        self.trained = SampleSet(epoch=0)
        self._replanning = False  # the data sized the schedule: its length follows the tokens trained
        self.generator = torch.Generator().manual_seed(cfg.seed * 1000 + self.dist.rank)

        # checkpoint resume (every rank loads the same files)
        self.store = open_store(cfg.checkpoint) if cfg.checkpoint else None
        self.checkpointer = AsyncCheckpointer(self.device)
        self.last_save_stall_s: float | None = None
        self._last_save_error: str | None = None
        if self.store is not None and cfg.resume == "auto":
            self._resume()

        # data
        self.feed = ShardFeed(
            self.spool,
            self.consumer_id,
            context_tokens=cfg.context_tokens,
            skip=self.trained,  # the live set: also drops duplicates of samples trained since the resume
            bucket=cfg.claim_bucket,
            expected_layer_ids=list(self.drafter_config.target_layer_ids),
            heartbeat_timeout_s=cfg.heartbeat_timeout_s,
            pool_streams=cfg.pool_streams,
            min_split_tokens=cfg.min_split_tokens or None,
            fill_wait_s=cfg.fill_wait_s,
            pin_memory=self.device.type == "cuda",
        )
        self.inputs = InputPipeline(
            lambda wait_s: self.feed.next_packed(wait_s=wait_s),
            self._build_batch,
            self.feed.exhausted,
            device=self.device,
            hidden_dtype=self.compute_dtype,
            depth=cfg.prefetch_steps,
        )
        self._padding_input: StepInput | None = None
        self.metrics = None
        self.ledger = None
        if cfg.run_dir:
            metrics_dir = Path(cfg.run_dir) / "metrics"
            self.metrics = MetricsLog(metrics_dir / f"consumer-{self.dist.rank}.jsonl")
            # The sample ledger: which samples each committed step trained, for exact audits after crashes.
            self.ledger = MetricsLog(metrics_dir / f"ledger-r{self.dist.rank}.jsonl")
        self.wandb = self._init_wandb() if self.dist.is_main else None
        self._stop_requested = False
        self._recompiles_after_warmup = 0
        self._recompiles_at_warmup: int | None = None
        self.first_step_s: float | None = None
        self.plan: CampaignPlan | None = None
        self._held_out: list[HeldOutDoc] = []
        self._held_out_shards = 0
        self._eval_step: int | None = None  # the step last evaluated
        self.evals = EvalBudget(cfg.eval_budget)
        self._saved_step: int | None = None
        self._t_process = time.monotonic()
        self.history: list[dict] = []

    # ------------------------------------------------------------------------------ resume / save
    def _resume(self) -> None:
        ckpt = load_latest_good(self.store, self.cfg.run)
        if ckpt is None:
            log.info("no checkpoint under %s/%s: starting fresh", redact(self.cfg.checkpoint), self.cfg.run)
            return
        missing, unexpected = self.model.load_state_dict(ckpt.model_state, strict=False)
        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        if trainable & set(missing) or unexpected:
            raise ValueError(
                f"checkpoint step {ckpt.step} does not fit this drafter: missing {sorted(trainable & set(missing))[:3]}"
                f" unexpected {sorted(unexpected)[:3]}"
            )
        self.optimizer.load_state_dict(ckpt.optimizer_state)
        self.scheduler.load_state_dict(ckpt.scheduler_state)
        rng = ckpt.rng_state.get(self.dist.rank) if isinstance(ckpt.rng_state, dict) else None
        if rng is not None:
            restore_rng_state(rng)
        self.step = ckpt.step
        self.trained = ckpt.trained
        log.info("resumed from step %d (%d samples already trained)", self.step, len(self.trained))

    def save(self, *, final: bool = False) -> None:
        """Checkpoint the group's state (rank 0 writes, every rank takes part in merging the trained sets).

        The state is copied to host memory on the compute stream and written in the background
        (``async_checkpoint.py``): training stalls only for that copy. A periodic checkpoint the store refuses
        (S3 outage longer than the retries, lost permissions, full disk) is ONE error line when its write
        ends, and training goes on: ``latest`` still names the previous good checkpoint and the next save
        tries again; losing a checkpoint costs at most redoing its steps after a crash, stopping would cost
        the run. The ``final`` save (data drained, SIGTERM) waits for its write and raises on every rank if
        it failed: exiting 0 without it would throw away the run's tail without anyone noticing.
        """
        if self.store is None:
            return
        if not (final and self._saved_step == self.step):  # else the last periodic save wrote this step
            self._submit_save()
        if final:
            error = None
            if self.dist.is_main:
                self._report_saves(self.checkpointer.wait())
                error = self._last_save_error  # the newest save's outcome: this step's
            error = D.broadcast_object(error, self.dist)  # every rank knows the outcome
            if error is not None:
                raise CheckpointStoreError(error)

    def _submit_save(self) -> None:
        for blob in D.all_gather_bytes(self.trained.to_bytes(), self.dist):
            self.trained.update(SampleSet.from_bytes(blob))  # in place: the feed skips from this set
        trained = SampleSet.from_bytes(self.trained.to_bytes())  # frozen at this step; the live set grows on
        trained.epoch = self._epoch()  # recorded in the checkpoint (the merged set: equal on every rank)
        rng_states = D.all_gather_object(capture_rng_state(), self.dist)
        self._saved_step = self.step
        if not self.dist.is_main:
            return
        step, scheduler_state = self.step, self.scheduler.state_dict()
        config = {"train": self.cfg.to_dict(), "drafter": self.drafter_config.to_dict()}

        def write(host: dict) -> str:
            return save_checkpoint(
                self.store,
                self.cfg.run,
                step,
                model_state=host["model"],
                optimizer_state=host["optimizer"],
                scheduler_state=scheduler_state,
                rng_state=dict(enumerate(rng_states)),
                trained=trained,
                config=config,
                keep_last=self.cfg.keep_last,
            )

        self.checkpointer.snapshot_and_write(step, self._device_state(), write)
        self._report_saves(self.checkpointer.collect())

    def _device_state(self) -> dict:
        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        model_state = {k: v for k, v in self.model.state_dict().items() if k in trainable}
        return {"model": model_state, "optimizer": self.optimizer.state_dict()}

    def _report_saves(self, outcomes) -> None:
        """One log line (and metrics event) per finished save, oldest first."""
        for out in outcomes:
            stall = out.waited_s + out.copy_s
            self.last_save_stall_s = stall
            self._last_save_error = None
            if out.error is not None:
                error = f"checkpoint step {out.step} failed: {redact(out.error)}"
                self._last_save_error = error
                log.error("%s; training goes on, latest still names the previous checkpoint", error)
                event = {"event": "checkpoint_failed", "step": out.step, "error": error}
            else:
                log.info(
                    "checkpoint step %d -> %s (%.1f GB; training stalled %.2fs, written in %.1fs in the background)",
                    out.step,
                    redact(out.url),
                    out.snapshot_gb,
                    stall,
                    out.write_s,
                )
                event = {"event": "checkpoint", "step": out.step, "url": redact(out.url)}
            if self.metrics:
                self.metrics.write(
                    {**event, "stall_s": stall, "write_s": out.write_s, "gb": out.snapshot_gb, "time": time.time()}
                )

    # ------------------------------------------------------------------------------ the loop
    def train(self) -> dict:
        cfg = self.cfg
        self._install_signal_handlers()
        stats = StepStats()
        t_start = time.monotonic()
        try:
            while cfg.max_steps is None or self.step < cfg.max_steps:
                item = self.inputs.get(timeout=0.5)
                have, exhausted, stop, tokens = D.sum_ints(
                    [item is not None, self.inputs.exhausted(), self._stop_requested, item.tokens if item else 0],
                    self.dist,
                )
                if stop:
                    log.warning("stop requested: saving a checkpoint at step %d", self.step)
                    break
                if not have:
                    if exhausted == self.dist.world_size:
                        break
                    if self.dist.is_main:  # waiting for data: still say when a background save has landed
                        self._report_saves(self.checkpointer.collect())
                    continue
                if item is None:  # others have data: take part in the collective step with padding only
                    item = self._padding()
                if self.first_step_s is None:
                    self._plan_campaign()
                self._train_step(item, stats)
                self._replan(tokens)
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
            if cfg.eval_every and self._eval_step != self.step and self.first_step_s is not None:
                self._evaluate()
            # always: when the last periodic save wrote this step, save() only waits for its background
            # write (exiting while it runs aborts the process and loses the checkpoint)
            self.save(final=True)
        finally:
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
            "eval_s": self.evals.spent_s,
            "history": self.history,
        }

    def weights_digest(self) -> str:
        """sha256 over the trainable weights: equal on every rank of a healthy DDP group."""
        import hashlib

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
        cfg = self.cfg
        return build_draft_batch(
            packed,
            block_size=cfg.block_size,
            num_anchors=cfg.num_anchors,
            max_anchors_per_doc=cfg.max_anchors_per_doc,
            mask_token_id=self.drafter_config.mask_token_id,
            gamma=cfg.gamma,
            generator=generator or self.generator,
        )

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
            chunk_tokens=cfg.loss_chunk_tokens,
        )
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        trained = [] if item.padding else self.feed.commit()
        self.trained.add(trained)
        if self.ledger is not None:
            self.ledger.write({"step": self.step, "pid": os.getpid(), "samples": trained})
        stats.add(result, weight=item.weight, grad_norm=grad_norm, tokens=item.tokens, samples=len(trained))

    def _replan(self, step_tokens: int) -> None:
        """Count the step's tokens (all ranks) and, when the data sized the schedule, keep its length right
        (``WarmupCosine.replan``). Every rank computes the same from the same sums: the same learning rate."""
        schedule: WarmupCosine = self.scheduler.lr_lambdas[0]
        schedule.tokens_done += step_tokens
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
            self._replanning = True
            if self.step:  # resumed: the rest of the data from what the checkpoint trained
                if not schedule.tokens_done:  # a checkpoint from before the count: full streams, as planned
                    schedule.tokens_done = self.step * cfg.context_tokens * self.dist.world_size
                self._replan(0)
            for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
                group["lr"] = base * schedule(self.scheduler.last_epoch)  # this step's factor, resized
            self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        if self.plan is None:
            log.warning("no campaign in spool %s (producers have not counted the data): schedule of %d steps", self.spool.root, schedule.total_steps)  # fmt: skip
            return
        if self.dist.is_main:
            log.info(self.plan.describe(schedule.warmup_steps, override=override))
        if cfg.eval_every and self.step == 0:  # the untrained drafter: the "before" of every later figure
            self._evaluate()

    def _load_held_out(self) -> list[HeldOutDoc]:
        """The held-out documents of the spool's eval/ shards (re-read when more shards have landed)."""
        shards = self.spool.eval_shards()
        if len(shards) != self._held_out_shards:
            self._held_out = read_held_out(shards)
            self._held_out_shards = len(shards)
        return self._held_out

    def _evaluate(self, *, periodic: bool = False) -> None:
        """Decode-order τ of the drafter on the held-out documents (rank 0; the others wait at the next
        collective). Nothing to do when the producers spool no held-out set (--eval-samples 0); a periodic
        evaluation that would take the evaluations past ``eval_budget`` of the run's time is skipped."""
        if not self.dist.is_main:
            return
        docs = self._load_held_out()
        if not docs:
            return
        if periodic and not self.evals.allows(time.monotonic() - self._t_process):
            log.info(
                "eval step %d skipped: evaluations would take more than %.0f%% of the run (--eval-budget)",
                self.step, 100 * self.cfg.eval_budget,
            )  # fmt: skip
            return
        self._eval_step = self.step  # evaluated (a skipped one does not count: the last step still runs)
        t0 = time.monotonic()
        report = decode_order_tau(self.model, docs)
        took = time.monotonic() - t0
        self.evals.add(took)
        in_loop = self.history[-1]["tau"] if self.history else None
        rec = {
            "event": "eval", "time": time.time(), "step": self.step, "decode_tau": report.tau,
            "accept_rate": report.accept_rate, "eval_docs": report.prompts, "verify_steps": report.verify_steps,
            "eval_s": took, "in_loop_tau": in_loop,
        }  # fmt: skip
        if self.metrics:
            self.metrics.write(rec)
        if self.wandb is not None:
            self.wandb.log({"decode_tau": report.tau}, step=self.step)
        loop = f", in-loop τ {in_loop:.2f}" if in_loop is not None else ""
        share = self.evals.spent_s / max(1e-9, time.monotonic() - self._t_process)
        log.info(
            "eval step %d: decode-order τ %.2f on %d held-out docs%s (%.1f s; evaluation %.1f%% of the run)",
            self.step, report.tau, report.prompts, loop, took, 100 * share,
        )  # fmt: skip

    def _epoch(self) -> int:
        """The epoch in progress (0-based), by how much has been trained: epochs overlap (a producer starts
        the next one when its slice of this one is done), so this counts samples, not ids."""
        if self.plan is None:
            return 0
        return min(self.plan.epochs.epochs - 1, len(self.trained) // max(1, self.plan.campaign.samples))

    def _campaign_fields(self, step_s: float) -> dict:
        """epoch k/N, the planned steps and the ETA at this interval's step time (metrics and console)."""
        if self.plan is None:
            return {}
        total = self.scheduler.lr_lambdas[0].total_steps
        out = {"epoch": self._epoch() + 1, "epochs": self.plan.epochs.epochs, "total_steps": total}
        eta = eta_s(self.step, total, step_s)
        return {**out, "eta_s": eta} if eta is not None else out

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

    def _log(self, stats: StepStats) -> None:
        if stats.steps == 0:
            return
        if self.dist.is_main:
            self._report_saves(self.checkpointer.collect())
        B = self.cfg.block_size
        sums = torch.tensor(
            [
                float(stats.loss_sum),
                stats.weight_sum,
                float(stats.tau_sum),
                float(stats.blocks),
                stats.tokens,
                stats.samples,
            ],
            dtype=torch.float64,
        )
        correct = torch.as_tensor(stats.correct).cpu().to(torch.float64).expand(B)
        valid = torch.as_tensor(stats.valid).cpu().to(torch.float64).expand(B)
        packed = torch.cat([sums, correct, valid])
        if self.dist.enabled and self.device.type == "cuda":
            packed = packed.to(self.device)
        D.all_reduce_sum(packed, self.dist)
        packed = packed.cpu()
        loss_sum, weight_sum, tau_sum, blocks, tokens, samples = packed[:6].tolist()
        correct, valid = packed[6 : 6 + B], packed[6 + B :]
        elapsed = time.monotonic() - stats.t0
        acc_per_pos = (correct / valid.clamp(min=1)).tolist()
        acc = float(correct[1:].sum() / valid[1:].sum().clamp(min=1))
        spool_stats = self._spool_summary()
        rec = {
            "time": time.time(),
            "step": self.step,
            "loss": loss_sum / max(weight_sum, 1e-9),
            "acc": acc,
            "acc_per_pos": acc_per_pos,
            "tau": tau_sum / max(blocks, 1.0),
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(stats.grad_norm),
            "tok_s": tokens / max(elapsed, 1e-9),
            # share of the context slots that held real tokens (packing quality), over this interval
            "fill": tokens / max(1.0, stats.steps * self.dist.world_size * self.cfg.context_tokens),
            "samples": len(self.trained),
            "interval_samples": samples,
            # the interval's raw sums: averages over a run are sum(tokens) / sum(seconds), not mean(tok_s)
            "interval_tokens": int(tokens),
            "interval_s": elapsed,
            **self._campaign_fields(elapsed / stats.steps),
            "world_size": self.dist.world_size,
            **spool_stats,
        }
        if self.device.type == "cuda":
            rec["mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.history.append(rec)
        self.feed.heartbeat_counters.update(
            step=self.step, samples=len(self.trained), tok_s=rec["tok_s"], world_size=self.dist.world_size
        )
        if not self.dist.is_main:
            return
        if self.metrics:
            self.metrics.write(rec)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in rec.items() if k not in ("acc_per_pos", "time")}, step=self.step)
        log.info(format_console_line(rec, elapsed_s=time.monotonic() - self._t_process, eta_s=rec.get("eta_s")))

    def _spool_summary(self) -> dict:
        """Spool depth and the producers' summed rate, as the feed's heartbeat thread last saw them."""
        return dict(self.feed.spool_summary)

    def _init_wandb(self):
        if not self.cfg.wandb_project:
            return None
        import os

        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        return wandb.init(
            project=self.cfg.wandb_project,
            name=self.cfg.run,
            mode=mode,
            dir=self.cfg.run_dir or None,
            config={k: v for k, v in self.cfg.to_dict().items() if k != "checkpoint"},
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
