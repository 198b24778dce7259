"""``dflash-eval --watch STORE --run RUN``: evaluate every checkpoint of a run as it lands; mark the best.

A separate process (any GPU, or CPU) beside the trainer. Each pass, oldest step first, it evaluates every
finished checkpoint (``meta.json`` exists: save_checkpoint uploads it after the data files) that has no
record yet, with exactly the evaluation of a plain ``dflash-eval`` (``evaluate_with``: the real lossless
draft -> verify loop against the target, same prompts), then re-elects ``best``. Layout in the store
(common/checkpoints/save.py, docs/export-and-eval.md)::

    <run>/evals/step-<n:08d>.json   one record per evaluated checkpoint (what eval.jsonl gets, too)
    <run>/best.json                 the record of the best step, plus step and step_dir
    <run>/best                      "step-<n:08d>", written after best.json; the trainer's pruning keeps it

Why the records live in the store, not only in ``<run-dir>/metrics/eval.jsonl``: the store is what the
trainer, exporters and every watcher already share, so a restarted watcher, a second one on another box, or
one without a run dir all agree on what was evaluated, and a record sits next to the checkpoint it
describes. A record counts only for the same weights (the model file's sha256 from meta.json: a step
number re-used after a resume from an older checkpoint is a new checkpoint) and the same evaluation
settings (target, prompts, lengths, dtype: τ of different prompt sets must not be compared).

``best`` = the highest τ among evaluated checkpoints that still exist; ties keep the earlier step.
Stopping: SIGINT/SIGTERM while waiting exits 0 ("stopped"); during an evaluation it exits 130 and that
checkpoint, unrecorded, is evaluated on the next start.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.common.checkpoints.layout import (
    BEST_RECORD_FILE,
    EVALS_DIR,
    MODEL_FILE,
    CheckpointCorruptError,
    check_run,
    read_best_name,
    step_dir_name,
)
from dflash.common.checkpoints.load import finished_steps, load_checkpoint_weights, read_checkpoint_meta
from dflash.common.checkpoints.save import write_best
from dflash.common.checkpoints.store import (
    CheckpointStore,
    CheckpointStoreError,
    StoreKeyNotFoundError,
    open_store,
)
from dflash.common.cli.exits import fail, one_line
from dflash.common.cli.logs import log_to_console
from dflash.common.drafter.hf_format import ExportError
from dflash.common.metrics import MetricsLog
from dflash.common.redact import redact
from dflash.common.target.attach import build_drafter
from dflash.common.target.data import DataError
from dflash.tools.eval.config import PROG, EvalConfig, WatchConfig
from dflash.tools.eval.run import check_same_target, evaluate_with, load_target, resolve_device
from dflash.tools.export.run import checkpoint_drafter_config

log = logging.getLogger(__name__)

EVAL_LOG = "metrics/eval.jsonl"


class WatchStopped(Exception):
    """SIGINT/SIGTERM arrived (raised from the signal handler, so it also cuts a sleep short)."""


@dataclass(kw_only=True)
class Watch:
    """What every pass needs: the store, the loaded target and prompts, the flags and the eval log."""

    cfg: EvalConfig
    watch: WatchConfig
    store: CheckpointStore
    run: str
    settings: dict
    target: Any
    tokenizer: Any
    prompts: list
    device: Any
    dtype: Any
    eval_log: MetricsLog | None = None
    warned: set[str] = field(default_factory=set)
    in_flight: int | None = None
    """The step being evaluated (a stop then exits 130: that evaluation is lost)."""


# ------------------------------------------------------------------------------------------------ records


def record_key(run: str, step: int) -> str:
    return f"{run}/{EVALS_DIR}/{step_dir_name(step)}.json"


def model_sha256(meta: dict) -> str | None:
    """The checkpoint's identity: its weights' sha256 as meta.json records it."""
    return (meta.get("files") or {}).get(MODEL_FILE, {}).get("sha256")


def read_records(store: CheckpointStore, run: str) -> dict[int, dict]:
    """step -> its eval record, from ``<run>/evals/``; unreadable records are skipped (re-evaluated)."""
    records = {}
    for key in store.list(f"{run}/{EVALS_DIR}/"):
        try:
            rec = json.loads(store.get_bytes(key))
            records[int(rec["step"])] = rec
        except StoreKeyNotFoundError:  # deleted since the listing
            continue
        except (ValueError, KeyError, TypeError):
            log.warning("%s: not an eval record, ignored", store.url_for(key))
    return records


def is_current(record: dict | None, meta: dict, settings: dict) -> bool:
    """Does `record` describe these weights under these settings?"""
    return (
        record is not None
        and record.get("model_sha256") == model_sha256(meta)
        and record.get("settings") == settings
    )


def elect_best(records: dict[int, dict], metas: dict[int, dict], settings: dict) -> dict | None:
    """The current record with the highest τ among existing checkpoints; a tie keeps the earlier step."""
    best = None
    for step in sorted(metas):
        rec = records.get(step)
        if is_current(rec, metas[step], settings) and (best is None or rec["tau"] > best["tau"]):
            best = rec
    return best


def _best_summary(record: dict) -> dict:
    keep = ("step", "tau", "evaluated_at", "tokens_per_s", "model_sha256", "settings")
    return {k: record[k] for k in keep if k in record}


def mark_best(w: Watch, best: dict) -> bool:
    """Write ``best``/``best.json`` unless they already name `best` with its τ; True when written."""
    name = step_dir_name(best["step"])
    try:
        current = read_best_name(w.store, w.run)
        on_file = json.loads(w.store.get_bytes(f"{w.run}/{BEST_RECORD_FILE}"))
    except (CheckpointCorruptError, CheckpointStoreError, ValueError):
        current, on_file = None, {}
    if current == name and on_file.get("tau") == best["tau"]:
        return False
    write_best(w.store, w.run, best["step"], _best_summary(best))
    return True


# --------------------------------------------------------------------------------------------- evaluation


def evaluate_step(w: Watch, step: int) -> dict:
    """Load one checkpoint's drafter (weights + meta.json only, verified) and evaluate it -> its record."""
    started = time.monotonic()
    state, meta = load_checkpoint_weights(w.store, w.run, step)
    config = checkpoint_drafter_config(meta, w.run)
    check_same_target(w.cfg, w.target, config)
    drafter = build_drafter(state, config, w.target, device=w.device, dtype=w.dtype)
    report = evaluate_with(w.cfg, w.target, w.tokenizer, drafter, w.prompts)
    return {
        "step": step,
        "step_dir": step_dir_name(step),
        "tau": report.tau,
        "accept_rate": report.accept_rate,
        "accept_length_hist": report.accept_length_hist,
        "tokens_per_s": report.tokens_per_s,
        "decode_s": report.wall_s,
        "eval_s": time.monotonic() - started,
        "generated_tokens": report.generated_tokens,
        "verify_steps": report.verify_steps,
        "speedup": (report.baseline or {}).get("speedup"),
        "evaluated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "checkpoint_time": meta.get("time"),
        "model_sha256": model_sha256(meta),
        "device": str(w.device),
        "settings": w.settings,
    }


def _finished_metas(w: Watch) -> dict[int, dict]:
    """step -> meta.json of every finished checkpoint; a corrupt meta.json is named once and skipped."""
    metas = {}
    for step in finished_steps(w.store, w.run):
        try:
            metas[step] = read_checkpoint_meta(w.store, w.run, step)
        except CheckpointCorruptError as err:  # pruned since the listing, or garbled: not evaluable
            _warn_once(w, f"meta:{step}", f"step {step}: skipped: {redact(str(err))}")
    return metas


def _warn_once(w: Watch, key: str, line: str) -> None:
    if key not in w.warned:
        w.warned.add(key)
        print(line, flush=True)


def _check_best_exists(w: Watch, metas: dict[int, dict]) -> None:
    """Say so (one line) when ``best`` names a checkpoint that is gone: the election below replaces it."""
    try:
        name = read_best_name(w.store, w.run)
    except CheckpointCorruptError as err:
        _warn_once(w, "best:garbled", f"{redact(str(err))}: electing the best again")
        return
    if name is not None and int(name.removeprefix("step-")) not in metas:
        _warn_once(w, f"best:{name}", f"best names {name}, which no longer exists: electing the best again")


def _progress(record: dict, best: dict | None) -> str:
    line = f"step {record['step']}: tau {record['tau']:.2f}"
    return line + (f" (best: step {best['step']}, {best['tau']:.2f})" if best else "")


def watch_pass(w: Watch) -> int:
    """Evaluate every finished, not yet evaluated checkpoint (oldest first), re-electing ``best`` after each;
    returns how many were evaluated."""
    metas = _finished_metas(w)
    records = read_records(w.store, w.run)
    _check_best_exists(w, metas)
    done = 0
    for step in sorted(metas):
        if is_current(records.get(step), metas[step], w.settings):
            continue
        w.in_flight = step
        try:
            record = evaluate_step(w, step)
        except (CheckpointCorruptError, ExportError) as err:  # pruned meanwhile, corrupt, other shape
            w.in_flight = None
            _warn_once(
                w, f"eval:{step}:{model_sha256(metas.pop(step))}", f"step {step}: not evaluated: {err}"
            )
            continue
        w.store.put_bytes(record_key(w.run, step), json.dumps(record, indent=2, sort_keys=True).encode())
        w.in_flight = None
        if w.eval_log is not None:
            w.eval_log.write(record)
        records[step] = record
        done += 1
        best = elect_best(records, metas, w.settings)
        mark_best(w, best)
        print(_progress(record, best), flush=True)
    best = elect_best(records, metas, w.settings)
    if done == 0 and best is not None and mark_best(w, best):  # e.g. the old best was pruned
        print(f"best: step {best['step']}, tau {best['tau']:.2f}", flush=True)
    return done


# -------------------------------------------------------------------------------------------------- CLI


@contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGINT/SIGTERM raise WatchStopped in the main thread (also ending a sleep); handlers restored after."""

    def stop(signum: int, _frame: Any) -> None:
        raise WatchStopped(signal.Signals(signum).name)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def open_watch(cfg: EvalConfig, watch: WatchConfig) -> Watch:
    """Check the store, load the target and prompts once (user errors raise)."""
    device, dtype = resolve_device(cfg)
    store = open_store(watch.watch)
    check_run(watch.run)
    store.check()  # no credentials, unreachable endpoint, missing bucket: exit 2 before loading the target
    tokenizer, target, prompts = load_target(cfg, device, dtype)
    eval_log = MetricsLog(Path(watch.run_dir) / EVAL_LOG) if watch.run_dir else None
    return Watch(
        cfg=cfg,
        watch=watch,
        store=store,
        run=watch.run,
        settings=cfg.settings(str(dtype).removeprefix("torch.")),
        target=target,
        tokenizer=tokenizer,
        prompts=prompts,
        device=device,
        dtype=dtype,
        eval_log=eval_log,
    )


def watch_loop(w: Watch) -> int:
    """Passes every --poll-s seconds (one with --once) -> exit code: 0 done or stopped while idle, 130
    stopped mid-evaluation, 1 a store failure under --once (without it the next pass retries)."""
    try:
        while True:
            try:
                done = watch_pass(w)
            except CheckpointStoreError as err:
                if w.watch.once:
                    print(f"{PROG}: {err}", file=sys.stderr)
                    return 1
                log.warning("%s; retrying in %.0fs", err, w.watch.poll_s)
                done = 0
            if w.watch.once:
                print(f"evaluated {done} checkpoint(s) of {w.store.url_for(w.run)}", flush=True)
                return 0
            time.sleep(w.watch.poll_s)
    except WatchStopped as sig:
        if w.in_flight is not None:
            print(f"stopped ({sig}) during step {w.in_flight}: not recorded, evaluated next time", flush=True)
            return 130
        print(f"stopped ({sig})", flush=True)
        return 0
    finally:
        if w.eval_log is not None:
            w.eval_log.close()


def run_watch(cfg: EvalConfig, watch: WatchConfig) -> int:
    """``dflash-eval --watch``: exit 2 on a user error (one line), 1 on a failed evaluation (one line),
    else watch_loop's code. SIGINT/SIGTERM are WatchStopped from here on."""
    log_to_console("eval")
    with _stop_on_signals():
        try:
            w = open_watch(cfg, watch)
        except (ExportError, DataError, ValueError, OSError, CheckpointStoreError) as err:
            fail(PROG, err)
        except WatchStopped as sig:
            print(f"stopped ({sig})", flush=True)
            return 0
        try:
            return watch_loop(w)
        except Exception as err:  # a bug or a broken device: one line, the traceback at DEBUG
            log.debug("watch failed", exc_info=True)
            step = f" evaluating step {w.in_flight}" if w.in_flight is not None else ""
            print(
                f"{PROG}: failed{step}: {one_line(err)}",
                file=sys.stderr,
            )
            return 1
