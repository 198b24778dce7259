"""Serving parity: a trained drafter, exported by ``dflash-export``, loads in a FRESH interpreter
with ``AutoModel.from_pretrained(folder, trust_remote_code=True)`` (the public DFlash way), computes the
trainer's block outputs (<= 1e-6 in fp32) and its ``spec_generate`` equals plain greedy decoding of the
target token for token; for a full-attention and a sliding-window drafter.

The fresh interpreter never imports the ``dflash`` package (asserted): what runs is the folder's
``dflash.py``, i.e. what a user of the export gets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash.common.checkpoints.save import capture_rng_state, save_checkpoint
from dflash.common.contract.sample_set import SampleSet
from dflash.common.drafter.batch import build_draft_batch, pack_samples
from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.dflash import TargetRunner, greedy_generate
from dflash.common.drafter.loss import draft_loss
from dflash.common.drafter.model import DFlashDrafter
from dflash.common.target.head import load_target_head
from dflash.tools.demo.assets import demo_dataset_path, materialize_tiny_target
from dflash.tools.eval.run import load_prompts
from dflash.tools.export.cli import main as export_main

EOS = 2
NEW_TOKENS = 40
LAYOUTS = {
    "full": {},
    "sliding": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 12},
}
BATCH_FIELDS = (
    "doc_ids",
    "anchors",
    "anchor_valid",
    "hidden",
    "positions",
    "block_input_ids",
    "block_positions",
)

# Runs in a fresh interpreter: loads each export with AutoModel(trust_remote_code) and reports, per folder,
# the block outputs' distance to the trainer's and whether spec_generate equals HF greedy generate.
CHILD = textwrap.dedent(
    r"""
    import json, sys
    from types import SimpleNamespace
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    torch.set_num_threads(1)
    target_dir, device, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    out = {}
    for name, (folder, data_path) in cases.items():
        data = torch.load(data_path)
        draft = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).to(device).eval()
        draft.attach_target(target)
        batch = SimpleNamespace(block_size=data["block_size"], **{k: v.to(device) for k, v in data["batch"].items()})
        with torch.no_grad():
            blocks = draft(batch).cpu()
        valid = data["batch"]["anchor_valid"]
        runs = []
        for prompt in data["prompts"]:
            ids = prompt[None].to(device)
            stats = draft.spec_generate(input_ids=ids, max_new_tokens=data["new_tokens"], temperature=0.0,
                                        target=target, stop_token_ids=[data["eos"]], return_stats=True)
            greedy = target.generate(ids, max_new_tokens=data["new_tokens"], do_sample=False,
                                     eos_token_id=data["eos"], pad_token_id=data["eos"])
            runs.append({"equal": stats.output_ids.tolist() == greedy.tolist(), "steps": stats.acceptance_lengths,
                         "new": stats.num_output_tokens})
        out[name] = {
            "class": type(draft).__module__ + "." + type(draft).__name__,
            "layer_types": list(draft.spec.layer_types), "window": draft.spec.sliding_window,
            "max_diff": float((blocks[valid] - data["blocks"][valid]).abs().max()),
            "runs": runs,
        }
    out["project_imported"] = sorted(m for m in sys.modules if m == "dflash" or m.startswith("dflash."))
    print("RESULT " + json.dumps(out))
    """
)


def _documents(target, prompts, layer_ids):
    """Each prompt + the target's own greedy continuation, with the captured features (what a producer
    spools from self-distilled data): the drafter overfits them, so spec_generate accepts drafts."""
    runner = TargetRunner(target, layer_ids)
    docs = []
    for i, prompt in enumerate(prompts):
        cont = greedy_generate(runner, prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=[EOS]).tokens
        ids = torch.cat([prompt, torch.tensor(cont)])
        runner.reset()
        _, feats = runner.forward(ids)
        docs.append((ids, torch.arange(ids.shape[0]) >= prompt.shape[0], feats, i))
    runner.close()
    return docs


def _train(config: DrafterConfig, target, docs, steps: int = 60) -> DFlashDrafter:
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, load_target_head(target, dtype=torch.float32))
    packed = pack_samples(docs, context_tokens=sum(d[0].shape[0] for d in docs))
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = build_draft_batch(
            packed,
            block_size=config.block_size,
            num_anchors=48,
            max_anchors_per_doc=16,
            mask_token_id=config.mask_token_id,
            gamma=7.0,
            generator=gen,
        )
        loss = draft_loss(drafter(batch), batch, drafter.target_head.lm_head_weight)
        opt.zero_grad()
        loss.loss().backward()
        opt.step()
    return drafter.eval()


def _export(tmp_path: Path, name: str, drafter: DFlashDrafter, target_dir: Path) -> Path:
    store = tmp_path / "ckpt"
    save_checkpoint(
        str(store),
        name,
        40,
        model_state=dict(drafter.named_parameters()),
        optimizer_state={},
        scheduler_state={},
        rng_state=capture_rng_state(),
        trained=SampleSet(),
        config={"train": {"target": str(target_dir)}, "drafter": drafter.config.to_dict()},
    )
    out = tmp_path / f"export-{name}"
    assert export_main([f"{store}/{name}", str(out), "--dtype", "float32"]) == 0
    assert export_main(["--check", str(out)]) == 0
    return out


def _prepare(tmp_path: Path, tiny_target: Path) -> dict[str, tuple[str, str]]:
    """Train (on the CPU), export and record the trainer's block outputs for both layouts -> the child's cases."""
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    prompts = load_prompts(str(demo_dataset_path()), tokenizer, num_prompts=3)
    cases = {}
    docs = None
    for name, layout in LAYOUTS.items():
        config = DrafterConfig.from_target_config(
            target.config, num_layers=2, block_size=8, mask_token_id=3, **layout
        )
        docs = docs or _documents(target, prompts, config.target_layer_ids)
        drafter = _train(config, target, docs)
        folder = _export(tmp_path, name, drafter, tiny_target)
        batch = build_draft_batch(
            pack_samples(docs, context_tokens=sum(d[0].shape[0] for d in docs)),
            block_size=8,
            num_anchors=60,
            max_anchors_per_doc=20,
            mask_token_id=3,
            gamma=7.0,
            generator=torch.Generator().manual_seed(1),
        )
        with torch.no_grad():
            blocks = drafter(batch)  # the trainer's drafter, as trained (not reloaded)
        data = {
            "batch": {k: getattr(batch, k) for k in BATCH_FIELDS},
            "block_size": batch.block_size,
            "blocks": blocks,
            "prompts": prompts,
            "new_tokens": NEW_TOKENS,
            "eos": EOS,
        }
        torch.save(data, tmp_path / f"{name}.pt")
        cases[name] = (str(folder), str(tmp_path / f"{name}.pt"))
    return cases


def _run_child(tmp_path: Path, tiny_target: Path, device: str, cases: dict) -> dict:
    env = {
        **os.environ,
        "HF_MODULES_CACHE": str(tmp_path / "hf-modules"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": "",
    }
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tiny_target), device, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _assert_parity(result: dict, atol: float) -> None:
    assert result["project_imported"] == [], "the fresh interpreter imported the dflash package"
    for name, layout in LAYOUTS.items():
        got = result[name]
        assert got["class"].startswith("transformers_modules.") and got["class"].endswith(
            ".dflash.DFlashDraftModel"
        )
        assert got["layer_types"] == layout.get("layer_types", ["full_attention"] * 2)
        assert got["window"] == layout.get("sliding_window")
        assert got["max_diff"] <= atol, (name, got["max_diff"])
        assert all(run["equal"] for run in got["runs"]), (name, got["runs"])
        steps = [n for run in got["runs"] for n in run["steps"]]
        assert sum(steps) / len(steps) > 1.5, (
            name,
            steps,
        )  # drafts were accepted, often: not only bonus tokens
        print(
            f"{name}: block max diff {got['max_diff']:.2e}, tau {sum(steps) / len(steps):.2f} over {len(steps)} steps"
        )


@pytest.fixture(scope="module")
def looping_target(tmp_path_factory) -> Path:
    """The tiny target with random weights: its greedy continuations are loops that a 60-step drafter
    learns (many drafts accepted), so the exported loop is tested on accepted blocks, not only on bonus
    tokens (the trained target's prose is beyond such a drafter: tests/test_evaluate.py says the same)."""
    return materialize_tiny_target(tmp_path_factory.mktemp("looping") / "target", weights="random")


@pytest.mark.pipeline
def test_export_loads_with_automodel_in_a_fresh_interpreter_and_matches_training(tmp_path, looping_target):
    torch.set_num_threads(1)
    cases = _prepare(tmp_path, looping_target)
    _assert_parity(_run_child(tmp_path, looping_target, "cpu", cases), atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_export_loads_with_automodel_on_cuda(tmp_path, looping_target):
    """The same with the exported code on CUDA, fp32: its block forward runs compiled flex_attention there
    (attention backend auto), within 1e-5 of the CPU trainer's SDPA (the fp32 flex-vs-dense gap measured on
    an H200 is <= 2e-6); spec_generate (SDPA on the GPU) equal to transformers' greedy generate."""
    cases = _prepare(tmp_path, looping_target)
    _assert_parity(_run_child(tmp_path, looping_target, "cuda", cases), atol=1e-5)


def test_spec_generate_takes_the_public_call(tiny_target):
    """In process, with the public keyword call: batch size 1 only (one line), and stop tokens cut."""
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    config = DrafterConfig.from_target_config(target.config, num_layers=1, block_size=4, mask_token_id=3)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).eval()
    ids = torch.tensor([[5, 17, 99, 300]])
    with pytest.raises(ValueError, match=r"batch size 1"):
        drafter.spec_generate(
            input_ids=ids.repeat(2, 1), max_new_tokens=4, temperature=0.0, target=target, stop_token_ids=None
        )
    full = drafter.spec_generate(
        input_ids=ids, max_new_tokens=12, temperature=0.0, target=target, stop_token_ids=None
    )
    assert full.shape == (1, 16) and torch.equal(full[:, :4], ids)
    stop = int(full[0, 7])
    cut = drafter.spec_generate(
        input_ids=ids, max_new_tokens=12, temperature=0.0, target=target, stop_token_ids=[stop]
    )
    first = full[0, 4:].tolist().index(stop)
    assert cut.tolist() == full[:, : 4 + first + 1].tolist()
    stats = SimpleNamespace(
        **vars(
            drafter.spec_generate(
                input_ids=ids,
                max_new_tokens=12,
                temperature=0.0,
                target=target,
                stop_token_ids=None,
                return_stats=True,
            )
        )
    )
    assert stats.num_output_tokens == 12 and sum(stats.acceptance_lengths) == 11  # the prefill emits one
