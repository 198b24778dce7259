"""dflash-eval --watch: every checkpoint of a store evaluated once, with the real draft -> verify loop; the
best by τ marked in the store; restarts evaluate nothing twice; the trainer's keep_last pruning keeps best.

Why not train a drafter per checkpoint: a drafter trained a few steps is too slow and its τ not ordered
for sure. Instead one drafter is trained ONCE (~2 s, on a random-weight target's own greedy continuations),
and "worse" is made deterministic: step 1 = trained, step 2 = the same weights (a tie: step 1 must keep
best), step 3 = an untrained drafter (τ = 1: nothing accepted). The target is built here from the demo
config with random weights, so the test does not need the shipped trained target.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from dflash.common.checkpoints.layout import BEST_FILE, BEST_RECORD_FILE, read_best_name, step_dir_name
from dflash.common.checkpoints.load import list_steps
from dflash.common.checkpoints.save import capture_rng_state, save_checkpoint
from dflash.common.contract.sample_set import SampleSet
from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.model import DFlashDrafter
from dflash.common.target.head import load_target_head
from dflash.tools.demo.assets import demo_dataset_path, tiny_target_dir
from dflash.tools.eval import watch as eval_watch
from dflash.tools.eval.cli import main

RUN, NEW_TOKENS, BLOCK, PROMPTS = "r1", 24, 8, 3


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls on 2 shared cores: 1 torch thread is much faster than 2 (see test_evaluate)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _random_target(out: Path) -> Path:
    """The demo target's config and tokenizer with random weights (seed 0), saved to `out`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True)
    for f in tiny_target_dir().iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copyfile(f, out / f.name)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out)).save_pretrained(out)
    return out


def _train_drafter(target_dir: Path) -> tuple[dict, dict, DrafterConfig]:
    """(trained weights, untrained weights, config): a 1-layer drafter fit to the target's greedy answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.common.drafter.batch import build_draft_batch, pack_samples
    from dflash.common.drafter.dflash import TargetRunner, greedy_generate
    from dflash.common.drafter.loss import draft_loss
    from dflash.tools.eval.run import load_prompts

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = load_prompts(str(demo_dataset_path()), tokenizer, num_prompts=PROMPTS)
    config = DrafterConfig.from_target_config(target.config, num_layers=1, block_size=BLOCK, mask_token_id=3)
    runner = TargetRunner(target, config.target_layer_ids)
    docs = []
    for i, prompt in enumerate(prompts):
        ids = torch.cat(
            [prompt, torch.tensor(greedy_generate(runner, prompt, max_new_tokens=NEW_TOKENS).tokens)]
        )
        runner.reset()
        docs.append((ids, torch.arange(ids.shape[0]) >= prompt.shape[0], runner.forward(ids)[1], i))
    runner.close()
    packed = pack_samples(docs, context_tokens=sum(d[0].shape[0] for d in docs))
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, load_target_head(target, dtype=torch.float32))
    untrained = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        batch = build_draft_batch(
            packed,
            block_size=BLOCK,
            num_anchors=32,
            max_anchors_per_doc=12,
            mask_token_id=3,
            gamma=7.0,
            generator=gen,
        )
        out = draft_loss(drafter(batch), batch, drafter.target_head.lm_head_weight)
        opt.zero_grad()
        out.loss().backward()
        opt.step()
    return {n: p.detach().clone() for n, p in drafter.named_parameters()}, untrained, config


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(target dir, trained weights, untrained weights, drafter config), built once for the module."""
    target_dir = _random_target(tmp_path_factory.mktemp("watch") / "target")
    trained, untrained, config = _train_drafter(target_dir)
    return target_dir, trained, untrained, config


def _save(store: Path, step: int, weights: dict, config: DrafterConfig, keep_last: int = 10) -> None:
    save_checkpoint(
        str(store),
        RUN,
        step,
        model_state=weights,
        optimizer_state={},
        scheduler_state={},
        rng_state=capture_rng_state(),
        trained=SampleSet(),
        config={"train": {"target": "tiny"}, "drafter": config.to_dict()},
        keep_last=keep_last,
    )


def _watch(target_dir: Path, store: Path, run_dir: Path, *extra: str) -> int:
    argv = ["--watch", str(store), "--run", RUN, "--target", str(target_dir), "--run-dir", str(run_dir)]
    argv += ["--dataset", str(demo_dataset_path()), "--num-prompts", str(PROMPTS), "--device", "cpu"]
    return main([*argv, "--max-new-tokens", str(NEW_TOKENS), *extra])


def _records(store: Path) -> dict[int, dict]:
    return {
        int(p.stem.removeprefix("step-")): json.loads(p.read_text())
        for p in (store / RUN / "evals").iterdir()
    }


def test_once_marks_best_restarts_skip_and_pruning_keeps_best(setup, tmp_path, capsys):
    target_dir, trained, untrained, config = setup
    store, run_dir = tmp_path / "ckpt", tmp_path / "run"
    _save(store, 1, trained, config)
    _save(store, 2, trained, config)  # same weights: a tie, the earlier step keeps best
    _save(store, 3, untrained, config)  # later and worse
    (store / RUN / "step-00000004").mkdir()  # an unfinished upload (no meta.json): never evaluated

    t0 = time.monotonic()
    assert _watch(target_dir, store, run_dir, "--once") == 0
    first_s = time.monotonic() - t0
    out = capsys.readouterr().out
    records = _records(store)
    assert sorted(records) == [1, 2, 3]
    assert records[1]["tau"] == records[2]["tau"] > records[3]["tau"] + 1.0  # τ ordering first
    assert records[3]["tau"] == pytest.approx(1.0, abs=0.2)
    assert len(records[1]["accept_rate"]) == BLOCK and records[1]["tokens_per_s"] > 0
    assert read_best_name(str(store), RUN) == step_dir_name(1)
    best = json.loads((store / RUN / BEST_RECORD_FILE).read_text())
    assert best["step"] == 1 and best["tau"] == records[1]["tau"] and best["evaluated_at"]
    assert (store / RUN / BEST_FILE).read_text() == "step-00000001\n"
    lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    t1 = records[1]["tau"]
    assert lines == [f"step {s}: tau {records[s]['tau']:.2f} (best: step 1, {t1:.2f})" for s in (1, 2, 3)]
    log_lines = [json.loads(ln) for ln in (run_dir / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log_lines] == [1, 2, 3] and log_lines[0]["tau"] == t1

    # a restart evaluates nothing new and leaves best alone
    best_mtime = (store / RUN / BEST_FILE).stat().st_mtime_ns
    assert _watch(target_dir, store, run_dir, "--once") == 0
    assert "evaluated 0 checkpoint(s)" in capsys.readouterr().out
    assert len((run_dir / "metrics" / "eval.jsonl").read_text().splitlines()) == 3
    assert (store / RUN / BEST_FILE).stat().st_mtime_ns == best_mtime

    # the trainer's keep_last=2 pruning keeps the best step (1), deletes 2, 3 and the unfinished 4
    _save(store, 5, untrained, config, keep_last=2)
    _save(store, 6, untrained, config, keep_last=2)
    assert list_steps(str(store), RUN) == [1, 5, 6]

    # best names a step that is gone (an older trainer pruned it): one line, a new election
    shutil.rmtree(store / RUN / "step-00000001")
    assert _watch(target_dir, store, run_dir, "--once") == 0
    out = capsys.readouterr().out
    assert "best names step-00000001, which no longer exists" in out
    assert read_best_name(str(store), RUN) == step_dir_name(5)  # 5 and 6 tie: the earlier one
    print(f"first --once over 3 checkpoints: {first_s:.1f}s; taus {[records[s]['tau'] for s in (1, 2, 3)]}")


def test_prune_ignores_a_best_of_an_abandoned_timeline(setup, tmp_path):
    """A best above the new step belongs to the timeline a resume abandoned: pruned like the rest."""
    _, _, untrained, config = setup
    store = tmp_path / "ckpt"
    for step in (1, 2, 3):
        _save(store, step, untrained, config, keep_last=1)
    assert list_steps(str(store), RUN) == [3]
    (store / RUN / BEST_FILE).write_text("step-00000003\n")
    _save(store, 4, untrained, config, keep_last=1)
    assert list_steps(str(store), RUN) == [3, 4]  # kept: best
    _save(store, 2, untrained, config, keep_last=1)  # resumed from older: 3 and 4 are another timeline
    assert list_steps(str(store), RUN) == [2]


def test_sigterm_while_idle_exits_0_and_during_an_evaluation_130(setup, tmp_path, capsys, monkeypatch):
    target_dir, trained, _, config = setup
    store, run_dir = tmp_path / "ckpt", tmp_path / "run"
    _save(store, 1, trained, config)
    real_pass = eval_watch.watch_pass

    def pass_then_sigterm(w):
        done = real_pass(w)
        os.kill(os.getpid(), signal.SIGTERM)  # arrives in the sleep after the pass
        return done

    monkeypatch.setattr(eval_watch, "watch_pass", pass_then_sigterm)
    before = signal.getsignal(signal.SIGTERM)
    assert _watch(target_dir, store, run_dir, "--poll-s", "60") == 0
    assert "stopped (SIGTERM)" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored

    monkeypatch.setattr(eval_watch, "watch_pass", real_pass)
    _save(store, 2, trained, config)

    def killed_evaluation(w, step):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here
        raise AssertionError("SIGTERM did not stop the evaluation")

    monkeypatch.setattr(eval_watch, "evaluate_step", killed_evaluation)
    assert _watch(target_dir, store, run_dir, "--poll-s", "60") == 130
    assert "during step 2: not recorded" in capsys.readouterr().out
    assert sorted(_records(store)) == [1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--watch", "s"], "--watch needs --run RUN"),
        (["--watch", "s", "--run", "r", "--drafter", "d"], "exactly one of --drafter DIR or --watch STORE"),
        (["--drafter", "d", "--once"], "--once only with --watch"),
        (["--watch", "s", "--run", "r", "--json", "-"], "--json is for one drafter"),
        (["--watch", "s", "--run", "r", "--poll-s", "0"], "--poll-s must be > 0"),
    ],
)
def test_flag_errors_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--target", "t", "--dataset", "x", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


def test_a_run_name_with_a_slash_is_one_line_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--target", "t", "--dataset", "x", "--watch", str(tmp_path), "--run", "a/b", "--device", "cpu"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dflash-eval: error: run name 'a/b'")
