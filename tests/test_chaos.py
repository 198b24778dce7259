"""Chaos: kill -9 random pipeline processes (and Ctrl-C the whole pipeline once) while ``ops/run_all.sh``
trains, restarting either by itself (``--restarts``) or by the user simply running the same command
again, then audit every sample exactly.

The pipeline (2 CPU producers, 2 CPU consumers in one gloo DDP group, the tiny target, ~36 chat rows with a
few rows the producers must drop, two epochs: each sample id names one training of a row in one epoch) runs under a killer thread that SIGKILLs a producer parent, a producer
worker or a consumer at moments bounded by the launch's progress (during start-up, after some steps, right
after a checkpoint), following a plan (CI: ``CI_PLAN``, the kills after start-up; the soak: a long random plan), and
once sends SIGINT to the whole process group (a terminal's Ctrl-C). Each invocation of run_all.sh gets a
``--restarts`` budget (CI: 0; the soak: random, 0-3): a kill -9 within the budget makes it
discard the spool's flow and restart everything from the latest checkpoint; past the budget, or after the
Ctrl-C, it exits and the test runs the same command again (a *plain re-run*: the spool is kept, the launch
discards its leftovers). Afterwards the consumers' sample ledgers (one line per committed optimizer step: step,
pid, sample indices) and the checkpoints left in the store are audited:

- launch L (one life of the pipeline) resumed from step r_L (= its first ledger step - 1) and is
  *durable* up to d_L, the step the next launch resumed from (the final checkpoint for the last launch);
  its ledger lines with step <= d_L are durable, later ones are its lost tail;
- durable sets of different launches are disjoint and their union is exactly the eligible samples
  (dataset rows minus the rows the producers drop), which is the final checkpoint's trained set;
- no launch trains a sample twice, so a sample trained k > 1 times was trained once durably and once in
  the lost tail of each of k - 1 killed launches;
- every checkpoint left in the store holds exactly the samples its lineage trained up to its step;
- no shard was ever quarantined, nothing is left in the spool, no process is left running.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from pipeline_helpers import REPO, as_from_a_terminal, cpu_env

from dflash.tools.demo.assets import demo_dataset_path

RUN = "chaos"
GOOD_ROWS = 30
EPOCHS = 2
MAX_LENGTH = 512
MIN_LOSS_TOKENS = 32  # dflash-produce: 2 x --block-size (16)
# Rows the producers must drop (never train), inserted at these dataset positions. The non-list row makes
# the file mixed-type, so it is read as raw JSON rows: the path with the fewest guarantees from arrow.
BAD_ROWS = {
    3: {"messages": [{"role": "user", "content": "no answer"}]},
    17: {"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x" * 80}]},
    29: {"messages": "not a list"},
    41: {"messages": [{"role": "user", "content": "Ok?"}, {"role": "assistant", "content": "Yes."}]},  # short
    55: {"messages": [{"role": ["user"], "content": "hi"}, {"role": "assistant", "content": "y" * 80}]},
    66: {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
}
# --budget-gb: a spool of a few shards keeps the producer alive (blocked on backpressure) while the consumers
# train, so a producer kill after a checkpoint finds it running.
PRODUCER_ARGS = f"--max-length {MAX_LENGTH} --batch-tokens 2048 --budget-gb 0.002"
# --heartbeat-timeout: dead consumers are found by pid at once; the timeout only catches hung ones, and a
# live consumer starved of CPU for longer than it would have its claims re-delivered (a duplicate).
CONSUMER_ARGS = (
    "--context-tokens 512 --num-anchors 32 --max-anchors-per-doc 8 --save-every 2 --log-every 1 "
    "--compile-backend eager --heartbeat-timeout 120 --keep-last 1000"
)
KILL_KINDS = ["producer", "worker", "consumer-0", "consumer-1"]
CTRL_C = "ctrl-c"  # SIGINT to run_all.sh's process group: a clean stop, run_all exits 130, the test re-runs
# The plan CI runs, fixed so a verdict never depends on the plan a run drew: the kills after start-up (a
# consumer after some steps, the producer parent right after a checkpoint) and the Ctrl-C, each followed by
# the same command run again (--restarts 0: a kill -9 past the budget). Four lives. A restart within the
# budget, and the start-up kills (a worker, the parent, a consumer), are test_startup_kills.py's: three
# restarts of one run_all.sh, each after a kill at a named phase, not a moment left to the box's speed. The
# soak (DFLASH_CHAOS_SEED, docs/testing.md) draws long random plans of every kind and budget.
CI_PLAN = [
    ("consumer-0", "progress"),
    (CTRL_C, "progress"),
    ("producer", "checkpoint"),
]
CI_RESTARTS = 0


def _random_plan(rng: random.Random, num_kills: int) -> list[tuple[str, str]]:
    """A soak plan: every kind of kill -9 at least once (twice from 9 kills on) and one Ctrl-C, the rest
    at random; half the moments during start-up, the rest after progress or a checkpoint, shuffled."""
    if num_kills < len(KILL_KINDS) + 1:
        raise ValueError(f"DFLASH_CHAOS_KILLS must be at least {len(KILL_KINDS) + 1}, got {num_kills}")
    kinds = KILL_KINDS * (2 if num_kills >= 2 * len(KILL_KINDS) + 1 else 1) + [CTRL_C]
    kinds += [rng.choice(KILL_KINDS) for _ in range(num_kills - len(kinds))]
    n_startup, n_progress = num_kills // 2, (num_kills - num_kills // 2 + 1) // 2
    whens = ["startup"] * n_startup + ["progress"] * n_progress
    whens += ["checkpoint"] * (num_kills - len(whens))
    rng.shuffle(kinds)
    rng.shuffle(whens)
    return list(zip(kinds, whens, strict=True))


INVOCATION = "=== the test runs run_all.sh, invocation "
_STARTED = re.compile(r"^started (\S+) \(pid (\d+)\)", re.M)
_FAILED = re.compile(r"run_all\.sh: (\S+) \(pid (\d+)\) failed with exit code (\d+)")


# ------------------------------------------------------------------------------------------ /proc helpers
def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _children(pid: int) -> list[int]:
    return [p for p in _pids() if (st := _stat(p)) is not None and st[1] == pid and st[0] not in ("Z", "X")]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _marked(mark: str) -> list[int]:
    """Live processes whose environment carries ``mark``: everything the pipeline started, orphans too."""
    needle = mark.encode()
    out = []
    for pid in _pids():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0") and _alive(pid):
            out.append(pid)
    return out


# ------------------------------------------------------------------------------------------ run artefacts
def _read_jsonl(path: Path) -> tuple[list[dict], int]:
    """Records of a JSONL file and the number of torn lines (a process killed mid-write)."""
    if not path.exists():
        return [], 0
    out, torn = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            torn += 1
    return out, torn


def _ledger_count(run_dir: Path, ranks: tuple[int, ...] = (0, 1)) -> int:
    n = 0
    for r in ranks:
        p = run_dir / "metrics" / f"ledger-r{r}.jsonl"
        if p.exists():
            n += p.read_bytes().count(b"\n")
    return n


def _checkpoint_events(run_dir: Path) -> int:
    p = run_dir / "metrics" / "consumer-0.jsonl"
    return p.read_text().count('"event": "checkpoint"') if p.exists() else 0


def _current_launch(run_dir: Path) -> dict[str, int]:
    try:
        text = (run_dir / "pids").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


class Killer:
    """SIGKILLs one process of each new pipeline launch, following ``plan`` [(kind, when)], until the plan
    is done or run_all.sh exits.

    Every moment is bounded by the launch's own progress, not by the clock, so how much one launch trains
    before its kill does not depend on the box's speed or load, and the plan cannot run out of work:

    - "startup": 0.3-3 s into the launch, but no later than its first committed step (a worker: 0-0.3 s
      after the workers know their slices);
    - "progress": right after 1-2 new committed steps (0-0.3 s later);
    - "checkpoint": right after the next checkpoint (0-0.3 s later);
    - once the latest checkpoint holds ``reserve`` of the samples, every further kill lands before the launch
      claims its first shard (it trains nothing), and a worker kill becomes a kill of its parent.

    A killed worker's sibling keeps producing until its slice is done (dflash-produce then fails), so that
    slice gets trained: the worker picked is the one with the most work left, the costliest to lose, and a
    worker that already finished is not picked (its parent is killed instead).
    """

    def __init__(self, run_dir: Path, out_path: Path, spool: Path, ckpt: Path, num_samples: int, plan, rng):
        self.run_dir, self.out_path, self.plan, self.rng = run_dir, out_path, plan, rng
        self.spool, self.ckpt, self.num_samples, self.reserve = spool, ckpt, num_samples, 0.6
        self.kills: list[dict] = []
        self.notes: list[str] = []
        self.error: BaseException | None = None
        self._halt = threading.Event()
        self.t0 = time.monotonic()
        self.thread = threading.Thread(target=self.run, name="chaos-killer", daemon=True)

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        try:
            self._run()
        except BaseException as err:  # reported by the test
            self.error = err

    def _live(self, launch: dict[str, int]) -> bool:
        """The launch can still be hit: its consumers run and the test has not called stop(). Judged from
        the launch's own processes, not from the test's handle on run_all.sh, which the main thread swaps
        for each re-run (a killer reading a stale handle once gave up on a whole launch)."""
        return not self._halt.is_set() and _alive(launch["consumer-0"]) and _alive(launch["consumer-1"])

    def _sleep(self, s: float) -> None:
        self._halt.wait(s)

    def _ending(self, launch: dict[str, int]) -> bool:
        """A consumer of this launch finished normally: the pipeline is draining, a kill would not restart."""
        out = self.out_path.read_text()
        tail = out[out.rfind(f"(pid {launch['consumer-1']})") :]
        return "consumer-0 finished" in tail or "consumer-1 finished" in tail

    def _trained_fraction(self) -> float:
        from dflash.common.contract.sample_set import SampleSet

        try:
            name = (self.ckpt / RUN / "latest").read_text().strip()
            return (
                len(SampleSet.from_bytes((self.ckpt / RUN / name / "trained.bin").read_bytes()))
                / self.num_samples
            )
        except (OSError, ValueError):
            return 0.0

    def _run(self) -> None:
        seen: set[int] = set()
        while len(self.kills) < len(self.plan) and not self._halt.is_set():
            kind, when = self.plan[len(self.kills)]
            launch = self._wait_new_launch(seen)
            if launch is None:
                return
            seen.add(launch["consumer-0"])
            t_launch = time.monotonic()
            if self._trained_fraction() >= self.reserve:
                when = "before-work"
                kind = "producer" if kind == "worker" else kind
            if not self._wait(when, kind, launch):
                if not self._halt.is_set():
                    self.notes.append(f"launch {launch} ended before its {when} kill")
                continue  # the next launch (a restart or the test's re-run) gets this kill
            consumers = [launch["consumer-0"], launch["consumer-1"]]
            if not all(_alive(p) for p in consumers) or self._ending(launch):
                self.notes.append(f"launch {launch} ended on its own before the {when} kill")
                continue
            try:
                pid, kind = self._pick_target(kind, launch)
                if kind == CTRL_C:
                    os.killpg(pid, signal.SIGINT)
                else:
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # exited between the check and the kill
                self.notes.append(f"{kind} of launch {launch} exited before its kill")
                continue
            self.kills.append(
                {
                    "kind": kind,
                    "when": when,
                    "pid": pid,
                    "launch": launch,
                    "after_s": round(time.monotonic() - t_launch, 1),
                    "at_s": round(time.monotonic() - self.t0, 1),
                }
            )

    def _wait_new_launch(self, seen: set[int]) -> dict[str, int] | None:
        deadline = time.monotonic() + 120
        while not self._halt.is_set() and time.monotonic() < deadline:  # across re-runs too
            launch = _current_launch(self.run_dir)
            if (
                {"producer", "consumer-0", "consumer-1"} <= set(launch)
                and launch["consumer-0"] not in seen
                and all(_alive(p) for p in launch.values())
            ):
                return launch
            self._sleep(0.05)
        if not self._halt.is_set():
            self.notes.append("no new launch within 120 s")
        return None

    def _work_left(self) -> dict[int, int]:
        """Samples each producer worker (by pid) still has to produce, from its spool heartbeat (workers past
        tokenization only; the heartbeat is rate-limited, so a worker may have finished more than it says)."""
        left = {}
        for hb in (self.spool / "state").glob("producer-*.json"):
            try:
                rec = json.loads(hb.read_text())
            except (OSError, ValueError):
                continue
            c = rec.get("counters", {})
            if c.get("phase") == "tokenize":  # its slice is not known yet
                continue
            left[rec.get("pid")] = c.get("total", 0) - c.get("samples", 0) - c.get("dropped", 0)
        return left

    def _workers(self, launch: dict[str, int]) -> list[int]:
        return [c for c in _children(launch["producer"]) if "spawn_main" in _cmdline(c)]

    def _claimed_any(self) -> bool:
        """A consumer of the current launch holds a shard (launches start with an empty claimed/)."""
        return any(True for d in (self.spool / "claimed").iterdir() for _ in d.iterdir())

    def _wait_until(self, launch: dict[str, int], probe, deadline_s: float, what: str) -> None:
        deadline = time.monotonic() + deadline_s
        while self._live(launch) and not probe():
            if time.monotonic() > deadline:
                self.notes.append(f"{what}: nothing happened within {deadline_s:.0f} s, killing anyway")
                return
            self._sleep(0.02)

    def _wait(self, when: str, kind: str, launch: dict[str, int]) -> bool:
        steps = lambda: _ledger_count(self.run_dir, ranks=(0,))  # noqa: E731  (one line per step and rank)
        start_steps = steps()
        if when == "before-work":  # it trains nothing: the launch's first claim (or 0.2-1.5 s) comes first
            t_end = time.monotonic() + self.rng.uniform(0.2, 1.5)
            self._wait_until(launch, lambda: time.monotonic() >= t_end or self._claimed_any(), 60, when)
        elif when == "startup" and kind == "worker":  # once the workers know their slices

            def slices_known() -> bool:
                workers, left = self._workers(launch), self._work_left()
                return bool(workers) and all(w in left for w in workers)

            self._wait_until(launch, slices_known, 120, "worker slices")  # a hang guard: start-up under load
            self._sleep(self.rng.uniform(0.0, 0.3))
        elif when == "startup":
            t_end = time.monotonic() + self.rng.uniform(0.3, 3.0)
            self._wait_until(launch, lambda: time.monotonic() >= t_end or steps() > start_steps, 60, when)
        elif when == "progress":
            target = start_steps + self.rng.randint(1, 2)
            self._wait_until(launch, lambda: steps() >= target, 60, when)
            self._sleep(self.rng.uniform(0.0, 0.3))
        else:
            target = _checkpoint_events(self.run_dir) + 1
            self._wait_until(launch, lambda: _checkpoint_events(self.run_dir) >= target, 60, when)
            self._sleep(self.rng.uniform(0.0, 0.3))
        return self._live(launch)

    def _pick_target(self, kind: str, launch: dict[str, int]) -> tuple[int, str]:
        if kind == CTRL_C:
            return os.getpgid(launch["consumer-0"]), kind  # the group of this run_all.sh invocation
        if kind == "worker":
            workers = self._workers(launch)
            left = self._work_left()
            busy = [w for w in workers if left.get(w, 0) > 0]
            if busy:
                return max(busy, key=lambda w: (left[w], self.rng.random())), "worker"
            kind = "producer"  # not spawned yet (or both already finished): the parent instead
        if kind == "producer" and not _alive(launch["producer"]):
            kind = self.rng.choice(["consumer-0", "consumer-1"])  # it finished its work: a consumer instead
        return launch[kind], kind


def _write_dataset(path: Path) -> list[dict]:
    with open(demo_dataset_path(), encoding="utf-8") as f:
        rows = [
            {"messages": json.loads(line)["messages"]} for _, line in zip(range(GOOD_ROWS), f, strict=False)
        ]
    for pos, row in sorted(BAD_ROWS.items()):
        rows.insert(pos, row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _eligible(data: Path, target: Path, cache: Path) -> set[int]:
    """The samples producers keep, from a clean single tokenization pass with the producers' settings."""
    from transformers import AutoTokenizer

    from dflash.common.target.chat import tokenize_slice
    from dflash.common.target.data import DataConfig, load_raw_dataset

    cfg = DataConfig(
        dataset=str(data), max_length=MAX_LENGTH, min_loss_tokens=MIN_LOSS_TOKENS, cache_dir=str(cache)
    )
    ds = load_raw_dataset(cfg)
    out = tokenize_slice(ds, AutoTokenizer.from_pretrained(target), cfg, np.arange(len(ds)))
    return {int(i) for i, s in zip(out["sample_index"], out["status"], strict=True) if s == "ok"}


def _check_clean_stop(i: int, launch: dict[str, int], tail: set[int], out_text: str, err_text: str) -> None:
    """The launch a Ctrl-C stopped lost nothing (the consumers' stop checkpoint holds every step they
    committed), and its stop is no failure: its invocation's stderr (run_all.sh's lines and the commands'
    one-line reports it passes on, "dflash-produce: error: 1 worker(s) failed" among them) says nothing
    failed."""
    assert not tail, f"the Ctrl-C of launch {i} lost trained samples {sorted(tail)[:10]}"
    started = out_text.index(f"started consumer-0 (pid {launch['consumer-0']})")
    n = out_text[:started].count(INVOCATION)
    earlier = out_text[out_text.rfind(INVOCATION, 0, started) : started].count("started consumer-0 ")
    # this invocation's stderr from the restart that started this launch (if it was not its first)
    section = err_text.split(INVOCATION)[n].split("run_all.sh: restart ")[earlier]
    assert "failed" not in section, f"the Ctrl-C's invocation reported a failure:\n{section[-2000:]}"


@pytest.mark.slow
def test_kill9_at_random_loses_nothing_and_trains_each_sample_once_per_timeline(tmp_path, tiny_target):
    # CI_PLAN by default, so a verdict never depends on which plan a run happened to draw; the soak sets
    # DFLASH_CHAOS_SEED (and DFLASH_CHAOS_KILLS) to draw others (the failure message names the seed).
    soak = "DFLASH_CHAOS_SEED" in os.environ
    seed = int(os.environ.get("DFLASH_CHAOS_SEED", "0"))
    rng = random.Random(seed)
    data = tmp_path / "data.jsonl"
    rows = _write_dataset(data)
    run_dir, spool, ckpt = tmp_path / "run", tmp_path / "spool", tmp_path / "ckpt"
    out_path, err_path = tmp_path / "run_all.out", tmp_path / "run_all.err"
    token = uuid.uuid4().hex
    mark = f"DFLASH_CHAOS_MARK={token}"  # inherited by every process the pipeline starts
    env = cpu_env(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp_path / "hf"),
        TOKENIZERS_PARALLELISM="false",
        DFLASH_CHAOS_MARK=token,
    )
    plan = _random_plan(rng, int(os.environ.get("DFLASH_CHAOS_KILLS", "10"))) if soak else list(CI_PLAN)
    num_kills = len(plan)
    cmd = [
        "bash",
        str(REPO / "ops" / "run_all.sh"),
        "--keep-spool",
        "--producers",
        "cpu:2",
        "--consumers",
        "cpu:2",
        "--model",
        str(tiny_target),
        "--dataset",
        str(data),
        "--run",
        RUN,
        "--run-dir",
        str(run_dir),
        "--spool",
        str(spool),
        "--checkpoint",
        str(ckpt),
        "--epochs",
        str(EPOCHS),
        "--producer-args",
        PRODUCER_ARGS,
        "--consumer-args",
        CONSUMER_ARGS,
    ]
    t0 = time.monotonic()
    budgets: list[int] = []  # --restarts of each invocation
    budget_rng = random.Random(seed + 1)  # not the killer thread's generator: a seed replays the same plan
    out_path.write_text("")
    err_path.write_text("")

    def invoke() -> subprocess.Popen:
        budgets.append(budget_rng.choice([0, 1, 2, 3]) if soak else CI_RESTARTS)
        with open(out_path, "a") as out_f, open(err_path, "a") as err_f:
            for f in (out_f, err_f):  # where each invocation's lines start (the Ctrl-C's are checked)
                f.write(f"{INVOCATION}{len(budgets)}\n")
                f.flush()
            return subprocess.Popen(
                as_from_a_terminal([*cmd, "--restarts", str(budgets[-1])]),
                stdout=out_f,
                stderr=err_f,
                env=env,
                cwd=tmp_path,
                start_new_session=True,
            )

    proc = invoke()
    killer = Killer(run_dir, out_path, spool, ckpt, len(rows) * EPOCHS, plan, rng)
    killer.thread.start()
    try:
        deadline = time.monotonic() + 90 * (num_kills + 3)  # a hang guard over every invocation (a busy box)
        rc = None
        while True:
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = None
                break
            if rc == 0 or len(budgets) > num_kills + 1:
                break
            proc = invoke()  # the user runs the same command again
        killer.stop()
        killer.thread.join(timeout=10)
        deadline = time.monotonic() + 5  # killed processes take a moment to go
        while _marked(mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [(p, _cmdline(p)[:120]) for p in _marked(mark)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in _marked(mark):  # only processes this test started (they carry its mark)
            os.kill(pid, signal.SIGKILL)
    wall = time.monotonic() - t0
    out_text, err_text = out_path.read_text(), err_path.read_text()

    def diag() -> str:
        logs = "".join(
            f"\n--- {p.name} (tail)\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
            for p in sorted((run_dir / "logs").glob("*.log"))
        )
        return (
            f"seed={seed} (rerun with DFLASH_CHAOS_SEED={seed}) wall={wall:.0f}s rc={rc}\nplan={plan}\n"
            f"kills={json.dumps(killer.kills)}\nnotes={killer.notes}\n--- run_all stderr\n{err_text[-4000:]}{logs}"
        )

    print(f"chaos: {len(killer.kills)} kills, wall {wall:.1f} s, seed {seed}")
    for k in killer.kills:
        print(
            f"  kill {k['kind']:<10} {k['when']:<10} {k['after_s']:5.1f} s into its launch, at {k['at_s']:5.1f} s"
        )
    assert killer.error is None, f"killer thread failed: {killer.error!r}\n{diag()}"
    assert rc == 0, f"run_all.sh did not finish cleanly\n{diag()}"
    # Every kill moment is bounded by progress (see Killer), so the whole plan lands on any box
    assert len(killer.kills) == num_kills, f"only {len(killer.kills)} kills landed\n{diag()}"
    plain_reruns = len(budgets) - 1
    assert plain_reruns >= 1, "no plain re-run happened"  # the Ctrl-C always ends an invocation

    # ---- every restart was caused by one of our kills, in the launch it hit
    starts = _STARTED.findall(out_text)
    launches: list[dict[str, int]] = []
    for name, pid in starts:
        if name == "producer":
            launches.append({})
        launches[-1][name] = int(pid)
    failures = _FAILED.findall(err_text)
    restarts = err_text.count("run_all.sh: restart ")
    kill9 = [k for k in killer.kills if k["kind"] != CTRL_C]
    assert len(failures) == len(kill9), diag()
    assert restarts + plain_reruns == len(killer.kills) == len(launches) - 1, diag()
    if not soak:  # CI_PLAN: the same command after each kill -9 and after the Ctrl-C
        assert (restarts, plain_reruns) == (0, 3), diag()
    said = (out_text + err_text).count("run 'chaos' continues")  # every later launch said so (prepare)
    assert said == len(launches) - 1, diag()
    for kill, launch in zip(killer.kills, launches, strict=False):
        assert kill["launch"] == launch, diag()  # kill i ended launch i
    for (name, pid, _code), kill in zip(failures, kill9, strict=True):
        launch = kill["launch"]
        if kill["kind"] == "worker":  # the parent reports its dead worker
            assert (name, int(pid)) == ("producer", launch["producer"]), diag()
        else:
            assert int(pid) == kill["pid"], diag()

    # ---- the samples producers keep: a clean tokenization pass, cross-checked with the last producers
    eligible_rows = _eligible(data, tiny_target, tmp_path / "hf-audit")
    assert not eligible_rows & set(BAD_ROWS) and len(eligible_rows) >= GOOD_ROWS - 4, sorted(
        set(range(len(rows))) - eligible_rows
    )
    eligible = {k * len(rows) + r for k in range(EPOCHS) for r in eligible_rows}  # sample ids, every epoch
    last_producers = json.loads((spool / "state" / "producers.json").read_text())["producers"]
    suffixes = {p.rpartition(".")[2] for p in last_producers}  # ids are unique per launch: n0p0.<launch>
    assert len(last_producers) == 2 and len(suffixes) == 1 and int(suffixes.pop()) <= len(launches), (
        last_producers
    )
    final_counters = [
        json.loads((spool / "state" / f"producer-{p}.json").read_text())["counters"] for p in last_producers
    ]
    assert sum(c["dropped"] for c in final_counters) == len(rows) - len(eligible_rows)  # once, not per epoch

    # ---- ledgers: one line per committed step and rank, tagged with the process id
    launch_of: dict[int, int] = {}
    for i, launch in enumerate(launches):
        for name in ("consumer-0", "consumer-1"):
            assert launch[name] not in launch_of, "pid reused across launches"
            launch_of[launch[name]] = i
    lines_of: list[list[dict]] = [[] for _ in launches]
    torn_total = 0
    for rank in (0, 1):
        recs, torn = _read_jsonl(run_dir / "metrics" / f"ledger-r{rank}.jsonl")
        torn_total += torn
        for rec in recs:
            i = launch_of[rec["pid"]]
            assert launches[i][f"consumer-{rank}"] == rec["pid"], "ledger line in the wrong rank's file"
            lines_of[i].append({**rec, "rank": rank})
    assert torn_total <= 2 * len(killer.kills)  # a line cut by a kill: only ever the last of a life

    # resume step r_L of each launch that trained, and its durable step d_L (what the next launch resumed)
    from dflash.common.checkpoints.layout import TRAINED_FILE, step_dir_name
    from dflash.common.checkpoints.load import list_steps, load_checkpoint
    from dflash.common.contract.sample_set import SampleSet

    final = load_checkpoint(str(ckpt), RUN)
    active = [i for i, lines in enumerate(lines_of) if lines]
    resumed = {i: min(r["step"] for r in lines_of[i]) - 1 for i in active}
    durable_step = {a: resumed[b] for a, b in zip(active, active[1:], strict=False)}
    durable_step[active[-1]] = final.step
    assert max(r["step"] for r in lines_of[active[-1]]) == final.step, diag()

    prefix: dict[int, set[int]] = {}  # what launch L resumed with
    trained_so_far: set[int] = set()
    durable_sizes = 0
    extra_trainings: Counter = Counter()
    tails: dict[int, set[int]] = {}
    for i in active:
        r, d = resumed[i], durable_step[i]
        steps_by_rank = [sorted(x["step"] for x in lines_of[i] if x["rank"] == k) for k in (0, 1)]
        for steps in steps_by_rank:  # committed steps are consecutive from the resume point
            assert steps == list(range(r + 1, r + 1 + len(steps))), (i, steps)
        assert r <= d <= max(max(s) for s in steps_by_rank if s), (i, r, d)
        assert all(set(range(r + 1, d + 1)) <= set(s) for s in steps_by_rank), (
            "a durable step lacks a rank's line"
        )
        per_launch = Counter(s for x in lines_of[i] for s in x["samples"])
        assert max(per_launch.values(), default=1) == 1, (
            f"launch {i} trained a sample twice: {per_launch.most_common(3)}"
        )
        durable = {s for x in lines_of[i] if x["step"] <= d for s in x["samples"]}
        tail = {s for x in lines_of[i] if x["step"] > d for s in x["samples"]}
        prefix[i] = set(trained_so_far)
        assert not durable & trained_so_far, (
            f"launch {i} re-trained durable samples {sorted(durable & trained_so_far)[:10]}"
        )
        assert not tail & trained_so_far, f"launch {i} tail re-trained durable samples"
        trained_so_far |= durable
        durable_sizes += len(durable)
        extra_trainings.update(tail)
        tails[i] = tail
    assert durable_sizes == len(trained_so_far), "durable sets of launches overlap"
    for i, kill in enumerate(killer.kills):
        if kill["kind"] == CTRL_C:
            _check_clean_stop(i, launches[i], tails.get(i, set()), out_text, err_text)
    assert trained_so_far == eligible, (
        f"missing {sorted(eligible - trained_so_far)[:20]} unexpected {sorted(trained_so_far - eligible)[:20]}\n{diag()}"
    )
    assert set(final.trained.indices().tolist()) == eligible
    # every sample trained k times: once durably, k-1 times in lost tails of killed launches (checked above)
    total = Counter(s for lines in lines_of for x in lines for s in x["samples"])
    assert all(total[s] == 1 + extra_trainings[s] for s in eligible)
    assert set(total) == eligible

    # ---- every checkpoint left in the store holds exactly what its lineage trained up to its step
    for step in list_steps(str(ckpt), RUN):  # the trained set alone: loading every weight file costs ~15 s
        blob = (ckpt / RUN / step_dir_name(step) / TRAINED_FILE).read_bytes()
        got = set(SampleSet.from_bytes(blob).indices().tolist())
        lineages = [
            prefix[i] | {s for x in lines_of[i] if x["step"] <= step for s in x["samples"]}
            for i in reversed(active)
            if resumed[i] <= step <= max(x["step"] for x in lines_of[i])
        ]
        assert got in lineages, f"checkpoint step {step} holds a trained set no launch had"

    # ---- no partial shard read, nothing left claimed or queued, no process left behind
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log"))
    assert "quarantining" not in logs and "ShardFormatError" not in logs
    assert '"samples_quarantined": 0' in logs and not re.search(
        r'"(shards|samples)_quarantined": [1-9]', logs
    )
    assert not any((spool / "quarantine").iterdir())
    from dflash.common.contract.spool import Spool

    sp = Spool(spool, create=False)
    assert sp.is_drained(), sp.stats()
    assert not [p for d in (spool / "claimed").iterdir() for p in d.iterdir()]
    assert not left, f"processes left running after run_all.sh exited: {left}"
    print(
        f"chaos: launches {len(launches)}, trained {len(eligible)} samples, {sum(extra_trainings.values())} "
        f"extra trainings in lost tails, final step {final.step}, wall {wall:.1f} s; {plain_reruns} plain re-runs "
        f"(--restarts per invocation {budgets})"
    )
