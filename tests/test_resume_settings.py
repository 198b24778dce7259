"""What a resumed run trains on: the schedule of the length it is given now, and the drafter and inputs the
checkpoint was trained with. In-process on the CPU with the shipped tiny Qwen3 target and synthetic
shards of its width (the feed and the trainer as ``dflash-consume`` runs them, no child process):

- a run extended by a larger ``--max-steps`` / ``--total-steps`` trains every new step at lr > 0 on a
  curve re-planned over the new length (before: the checkpoint's 5-step curve was kept and steps 6-20
  trained at lr 0, their samples used up); a length the run has passed is refused in one line;
- every setting that defines the drafter or its inputs is compared with the checkpoint's; a difference is
  refused in one line naming it (exit 2 from the CLI) unless ``--resume-changes`` says it is meant, and a
  shape the weights cannot load into is always refused; the consumer's ``--target`` is checked against
  the producers' (the spool's run record) before step 1.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from pipeline_helpers import write_synthetic_spool
from transformers import AutoConfig

from dflash.common.checkpoints.layout import LoadedCheckpoint
from dflash.common.contract.sample_set import SampleSet
from dflash.common.contract.spool import Spool
from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.layers import default_target_layer_ids
from dflash.common.target.head import target_fingerprint
from dflash.consumer import cli
from dflash.consumer.checkpointing.resume import check_resumable
from dflash.consumer.config import RESUME_CHANGES, TrainConfig
from dflash.consumer.schedule import LrSchedule
from dflash.consumer.trainer import Trainer

# the schedule tests step a scheduler without an optimizer step: only the rates are under test
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")

SHAPES = dict(context_tokens=128, num_anchors=16, num_layers=1, log_every=1, eval_every=0, compile=False)
"""Two 64-token samples a step, one draft layer: a step in tens of milliseconds."""


@pytest.fixture(scope="module")
def tiny(tiny_target: Path) -> dict:
    cfg = json.loads((tiny_target / "config.json").read_text())
    return {
        "hidden": cfg["hidden_size"],
        "vocab": cfg["vocab_size"],
        "layers": default_target_layer_ids(cfg["num_hidden_layers"]),
    }


def _spool(root: Path, tiny: dict, *, layers: list[int] | None = None, shards: int = 12) -> Path:
    """A finished spool of ``shards`` x 4 samples of 64 tokens at the tiny target's width: 24 steps."""
    write_synthetic_spool(
        root,
        hidden_size=tiny["hidden"],
        layer_ids=layers or tiny["layers"],
        num_shards=shards,
        samples_per_shard=4,
        tokens_per_sample=64,
        vocab=tiny["vocab"],
    )
    return root


def _trainer(spool: Path, target: Path, store: Path, **flags) -> Trainer:
    cfg = TrainConfig.from_flat(
        spool=str(spool), target=str(target), store=str(store), run="r", save_every=5, **SHAPES, **flags
    )
    return Trainer(cfg)


def _train(trainer: Trainer) -> list[float]:
    """Train to the end; the learning rate each step trained at (read before the step, as it uses it)."""
    used: list[float] = []
    step = trainer.train_step

    def spy(item, stats):
        used.append(trainer.schedule.lr)
        step(item, stats)

    trainer.train_step = spy
    try:
        trainer.train()
    finally:
        trainer.close()
    return used


@pytest.fixture(autouse=True)
def _process_state():
    """A Trainer seeds the global RNG and, on the CPU, flushes denormals and sets torch's threads: put
    back for the other tests of this process."""
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        yield
    torch.set_flush_denormal(False)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def five_steps(tmp_path_factory, tiny_target: Path, tiny: dict) -> dict:
    """A run of ``--max-steps 5 --save-every 5``: its store (checkpoint step 5) and its spool's rest."""
    tmp = tmp_path_factory.mktemp("five-steps")
    spool, store = _spool(tmp / "spool", tiny), tmp / "store"
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        rates = _train(_trainer(spool, tiny_target, store, max_steps=5))
    torch.set_flush_denormal(False)
    torch.set_num_threads(threads)
    assert len(rates) == 5 and all(r > 0 for r in rates)
    return {"spool": spool, "store": store}


@pytest.fixture
def resumable(tmp_path: Path, five_steps: dict) -> tuple[Path, Path]:
    """(spool, store) copies of the 5-step run, for a test to resume and consume."""
    spool, store = tmp_path / "spool", tmp_path / "store"
    shutil.copytree(five_steps["spool"], spool)
    shutil.copytree(five_steps["store"], store)
    return spool, store


# ---- extending a run ------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["max_steps", "total_steps", "neither"])
def test_a_run_extended_by_a_larger_length_trains_every_new_step_at_a_positive_rate(
    resumable, tiny_target, flag, caplog
):
    """Extended by a flag: the new length's curve, decaying to its end. With neither flag (and no
    campaign in the spool) the run drains the spool on the length a fresh run gets (10000 steps)."""
    spool, store = resumable
    extra = {"max_steps": {"max_steps": 20}, "total_steps": {"max_steps": 20, "total_steps": 20}}.get(
        flag, {}
    )
    length = 20 if extra else 10_000
    with caplog.at_level(logging.WARNING, logger="dflash.consumer.trainer"):
        trainer = _trainer(spool, tiny_target, store, **extra)
        assert trainer.step == 5
        rates = _train(trainer)
        assert trainer.schedule.total_steps == length  # the console's step=k/length
    assert len(rates) == (15 if extra else 19) and all(r > 0 for r in rates), rates  # steps 6.., no lr 0
    if extra:
        assert rates == sorted(rates, reverse=True)  # the cosine of the new length, decaying
    said = [r.getMessage() for r in caplog.records if f"re-planned over {length} steps" in r.getMessage()]
    assert len(said) == 1 and "the checkpoint's curve was 5 steps" in said[0], said


def test_a_length_the_run_has_passed_is_refused_in_one_line(resumable, tiny_target):
    spool, store = resumable
    with pytest.raises(
        ValueError, match=r"--total-steps 5: run 'r' resumes at step 5, so every further"
    ) as e:
        _trainer(spool, tiny_target, store, total_steps=5)
    assert "give a --total-steps above 5 to extend it" in str(e.value) and "\n" not in str(e.value)


def test_a_length_below_max_steps_is_refused_before_anything_runs(tiny_target):
    with pytest.raises(ValueError, match="total-steps 10 is below max-steps 20: steps past 10 would train"):
        TrainConfig.from_flat(spool=".", target=str(tiny_target), total_steps=10, max_steps=20)


def test_more_epochs_extend_the_data_sized_curve_without_a_step_at_lr_0():
    """A campaign's curve runs on tokens: resumed with twice the data (more epochs), the rate picks up the
    longer curve at the tokens trained, and decays over the rest, never 0."""

    def schedule() -> LrSchedule:
        return LrSchedule(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 1, 10_000)

    first = schedule()
    first.size_from_data(10, 0.1, planned_tokens=1000, step_tokens=100, step=0)
    for step in range(1, 11):  # the whole first campaign
        first.count_tokens(100)
        first.step()
        first.replan(step)
    resumed = schedule()
    resumed.load_state_dict(first.state_dict())
    resumed.size_from_data(20, 0.1, planned_tokens=2000, step_tokens=100, step=10)
    rates = []
    for step in range(11, 21):
        rates.append(resumed.lr)
        resumed.count_tokens(100)
        resumed.step()
        resumed.replan(step)
    assert all(r > 0 for r in rates) and rates == sorted(rates, reverse=True), rates
    assert resumed.total_steps == 20


# ---- the drafter and its inputs -------------------------------------------------------------------------


def _drafter(target: Path, **over) -> DrafterConfig:
    """The tiny target's one-layer drafter (its config-only mask token, 3), ``over`` changed."""
    cfg = DrafterConfig.from_target_config(AutoConfig.from_pretrained(target), num_layers=1)
    cfg.target_fingerprint = "sha256:" + "a" * 32
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def _checkpoint(drafter: DrafterConfig) -> LoadedCheckpoint:
    return LoadedCheckpoint(
        step=5,
        epoch=0,
        url="file:///store/r/step-00000005",
        model_state={},
        optimizer_state={},
        scheduler_state={},
        rng_state={},
        trained=SampleSet(epoch=0),
        config={"train": {}, "drafter": drafter.to_dict()},
        meta={},
    )


CHANGES = [
    # (setting as --resume-changes names it, the DrafterConfig fields given, what the line says)
    ("block-size", {"block_size": 8}, "--block-size 16, this run gives 8"),
    ("mask-token-id", {"mask_token_id": 5}, "--mask-token-id 3, this run gives 5"),
    (
        "target-layer-ids",
        {"target_layer_ids": [1, 2, 3, 4, 6]},
        "--target-layer-ids 1,2,3,4,5, this run gives 1,2,3,4,6",
    ),
    (
        "target",
        {"target_fingerprint": "sha256:" + "b" * 32},
        "--target (its weights' fingerprint) sha256:aaaaa…",
    ),
    ("target", {"vocab_size": 5000}, "--target (its vocabulary) 4096, this run gives 5000"),
    (
        "draft-layer-types",
        {"layer_types": ["sliding_attention"], "sliding_window": 64},
        "--draft-layer-types/--sliding-window layer_types ['full_attention'], sliding_window None, this run",
    ),
]


@pytest.mark.parametrize(
    ("name", "given", "says"), CHANGES, ids=[f"{c[0]}-{next(iter(c[1]))}" for c in CHANGES]
)
def test_a_resume_with_another_setting_is_refused_unless_the_change_is_meant(tiny_target, name, given, says):
    trained = _drafter(tiny_target)
    assert name in RESUME_CHANGES
    with pytest.raises(ValueError) as err:
        check_resumable(_checkpoint(trained), _drafter(tiny_target, **given), run="r", meant=frozenset())
    line = str(err.value)
    assert line.startswith("checkpoint step 5 of run 'r' was trained with ") and says in line, line
    assert f"--resume-changes {name} if the change is meant" in line and "\n" not in line
    # meant: resumed, the change said; another setting meant instead does not cover it
    accepted = check_resumable(_checkpoint(trained), _drafter(tiny_target, **given), run="r", meant={name})
    assert len(accepted) == 1 and accepted[0].startswith(says.split(" ")[0]), accepted
    others = frozenset(RESUME_CHANGES) - {name}
    with pytest.raises(ValueError):
        check_resumable(_checkpoint(trained), _drafter(tiny_target, **given), run="r", meant=others)


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"hidden_size": 128}, "--target (its hidden size) 256, this run gives 128"),
        ({"num_layers": 2, "layer_types": ["full_attention"] * 2}, "--num-layers 1, this run gives 2"),
        ({"target_layer_ids": [1, 2, 3, 4]}, "--target-layer-ids (how many) 5, this run gives 4"),
        ({"intermediate_size": 64}, "--target (its attention heads, head size, MLP width)"),
        ({"arch": "dflash2"}, "--drafter-arch dflash, this run gives dflash2"),
    ],
    ids=["hidden-size", "num-layers", "target-layer-count", "target-shape", "drafter-arch"],
)
def test_a_shape_the_weights_cannot_load_into_is_always_refused(tiny_target, given, says):
    with pytest.raises(ValueError) as err:
        check_resumable(
            _checkpoint(_drafter(tiny_target)),
            _drafter(tiny_target, **given),
            run="r",
            meant=frozenset(RESUME_CHANGES),
        )
    line = str(err.value)
    assert says in line and "its weights cannot load into this drafter" in line and "\n" not in line, line


def test_an_older_checkpoint_is_compared_on_what_it_recorded(tiny_target):
    """No fingerprint (recorded since), no layer types (all full attention then): not refused for them."""
    old = _drafter(tiny_target).to_dict()
    del old["layer_types"], old["sliding_window"], old["arch"]  # (no arch: DFlash, before DFlash2)
    old["target_fingerprint"] = None
    ckpt = _checkpoint(_drafter(tiny_target))
    ckpt.config["drafter"] = old
    assert check_resumable(ckpt, _drafter(tiny_target), run="r", meant=frozenset()) == []


def test_the_trainer_refuses_another_block_size_and_resumes_a_meant_one(resumable, tiny_target, caplog):
    spool, store = resumable
    with pytest.raises(ValueError, match="--block-size 16, this run gives 8: give the checkpoint's value"):
        _trainer(spool, tiny_target, store, block_size=8, max_steps=6)
    with caplog.at_level(logging.WARNING):
        trainer = _trainer(spool, tiny_target, store, block_size=8, max_steps=6, resume_changes="block-size")
        assert trainer.step == 5
        _train(trainer)
    assert any("resuming with --block-size 16 -> 8" in r.getMessage() for r in caplog.records)
    meta = json.loads((store / "r" / "step-00000006" / "meta.json").read_text())
    assert meta["config"]["drafter"]["block_size"] == 8  # the next checkpoint records the new value


def test_the_cli_says_a_refused_resume_in_one_line_and_exits_2(resumable, tiny_target, capsys):
    spool, store = resumable
    argv = ["--gpu", "cpu", "--spool", str(spool), "--target", str(tiny_target), "--checkpoint", str(store)]
    argv += ["--run", "r", "--num-layers", "1", "--mask-token-id", "5", "--no-compile"]
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("dflash-consume: error: checkpoint step 5 of run 'r' was trained with ")
    mask = json.loads((store / "r" / "step-00000005" / "meta.json").read_text())["config"]["drafter"]
    assert f"--mask-token-id {mask['mask_token_id']}, this run gives 5" in err[-1], err[-1]


# ---- the consumer's target against the producers' -------------------------------------------------------


def _other_target(tmp: Path, target: Path) -> Path:
    """A copy of ``target`` with other weights of the same shape (its embedding rows moved)."""
    from safetensors.torch import load_file, save_file

    other = tmp / "other-target"
    shutil.copytree(target, other)
    weights = load_file(str(other / "model.safetensors"))
    key = next(k for k in weights if k.endswith("embed_tokens.weight"))
    weights[key] = weights[key] + 0.01
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    return other


@pytest.mark.parametrize("recorded", ["fingerprint", "folder only"])
def test_a_target_other_than_the_producers_is_refused_before_step_1(tmp_path, tiny_target, tiny, recorded):
    spool = _spool(tmp_path / "spool", tiny, shards=1)
    other = _other_target(tmp_path, tiny_target)
    record = {"run": "r", "model": str(other), "layer_ids": tiny["layers"]}
    if recorded == "fingerprint":
        record["target_fingerprint"] = target_fingerprint(other)
    Spool(spool).bind_run(record)
    with pytest.raises(ValueError) as err:
        _trainer(spool, tiny_target, tmp_path / "store", max_steps=1)
    line = str(err.value)
    assert f"--target {tiny_target}: not the model the producers of spool {spool} ran ({other}" in line
    assert "give the producers' --model as --target" in line and "\n" not in line
    assert len(list(Spool(spool).ready_dir.iterdir())) == 1  # nothing claimed


def test_target_layers_other_than_the_producers_are_refused_before_step_1(tmp_path, tiny_target, tiny):
    spool = _spool(tmp_path / "spool", tiny, shards=1)
    Spool(spool).bind_run({"run": "r", "model": str(tiny_target), "layer_ids": [1, 2, 3, 4, 6]})
    with pytest.raises(
        ValueError, match="captured target layers 1,2,3,4,6 .*give --target-layer-ids 1,2,3,4,6"
    ):
        _trainer(spool, tiny_target, tmp_path / "store", max_steps=1)


def test_the_producers_own_target_passes(tmp_path, tiny_target, tiny):
    spool = _spool(tmp_path / "spool", tiny, shards=1)
    fingerprint = target_fingerprint(tiny_target)
    record = {
        "run": "r",
        "model": str(tiny_target),
        "target_fingerprint": fingerprint,
        "layer_ids": tiny["layers"],
    }
    Spool(spool).bind_run(record)
    assert _train(_trainer(spool, tiny_target, tmp_path / "store", max_steps=1))
    meta = json.loads(next((tmp_path / "store" / "r").glob("step-*/meta.json")).read_text())
    assert meta["config"]["drafter"]["target_fingerprint"] == fingerprint


def test_weights_that_do_not_fit_without_a_recorded_drafter_are_one_line():
    """The last net under ``check_resumable``: a checkpoint that records no drafter and does not fit is one
    line naming the first tensor, never torch's multi-line error."""
    from dflash.consumer.checkpointing.resume import restore
    from dflash.consumer.checkpointing.state import TrainProgress, TrainState

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    state = TrainState(model, optimizer, LrSchedule(optimizer, 1, 10), None, TrainProgress())
    ckpt = LoadedCheckpoint(
        step=5,
        epoch=0,
        url="file:///store/r/step-00000005",
        model_state={"weight": torch.zeros(3, 5), "bias": torch.zeros(3)},
        optimizer_state={},
        scheduler_state={},
        rng_state={},
        trained=SampleSet(epoch=0),
        config={},
        meta={},
    )
    with pytest.raises(
        ValueError, match=r"^checkpoint step 5 does not fit this drafter: size mismatch for weight"
    ) as e:
        restore(ckpt, state, rank=0)
    assert "\n" not in str(e.value)
