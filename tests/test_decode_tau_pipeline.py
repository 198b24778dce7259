"""On the user's path: the decode-order τ a consumer logs on its held-out set equals what
dflash-eval's draft→verify loop gives on the same checkpoint and the same held-out documents, when the
responses are the target's own greedy outputs (the bundled self-distilled answers)."""

from __future__ import annotations

import json

import pytest
import torch
from ledger_audit import read_jsonl
from pipeline_helpers import consume_cmd, cpu_env, produce_cmd, run

from dflash.tools.demo.assets import distilled_dataset_path

# Enough training for a margin no run-to-run noise reaches: 92 training rows x 6 epochs are 126 steps of the
# demo's drafter shape (2 layers, block 8), measured held-out τ 1.00 -> 1.15 in ~25 s of consumer time; 12
# rows x 1 epoch (3 steps, the loss still rising) moved it by 0.03 or not at all, by chance.
ROWS, HELD_OUT, EPOCHS = 96, 4, 6
MIN_GAIN = 0.07  # half the measured gain
# Tolerance: the eval shards hold bf16-rounded features (what producers spool), dflash-eval computes fp32
# ones live; a draft whose argmax sits on a near-tie can flip. Measured: equal (|Δ| = 0) on this data.
TOLERANCE = 0.05


@pytest.mark.slow
def test_logged_decode_order_tau_equals_dflash_eval_on_the_same_checkpoint_and_docs(tmp_path, tiny_target):
    from transformers import AutoModelForCausalLM

    from dflash.common.checkpoints.load import load_checkpoint
    from dflash.common.contract.shard_reader import read_shard
    from dflash.common.contract.spool import Spool
    from dflash.common.drafter.decode_tau import first_response
    from dflash.common.drafter.dflash import DrafterProposer, TargetRunner, speculative_generate
    from dflash.common.drafter.report import summarize
    from dflash.common.target.attach import build_drafter
    from dflash.tools.export.run import checkpoint_drafter_config

    data = tmp_path / "data.jsonl"
    with open(distilled_dataset_path(), encoding="utf-8") as f:
        data.write_text("".join(line for _, line in zip(range(ROWS), f, strict=False)))
    spool, ckpt, run_dir = tmp_path / "spool", tmp_path / "ckpt", tmp_path / "run"
    env = cpu_env()
    proc = run(
        produce_cmd(
            spool, tiny_target, data, "--run", "tau", "--eval-samples", str(HELD_OUT), "--epochs", str(EPOCHS)
        ),
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # --bucket oldest: shards claimed in name order (the default draws them at random, unseeded), so every
    # run trains the same steps and reaches the same τ
    proc = run(
        consume_cmd(
            spool,
            tiny_target,
            "--run",
            "tau",
            "--run-dir",
            str(run_dir),
            "--checkpoint",
            str(ckpt),
            "--lr",
            "2e-3",
            "--eval-every",
            "1000",
            "--compile-backend",
            "eager",
            "--log-every",
            "10",
            "--bucket",
            "oldest",
            "--num-layers",
            "2",
            "--block-size",
            "8",
            "--num-anchors",
            "64",
            "--max-anchors-per-doc",
            "16",
        ),
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in read_jsonl(run_dir / "metrics" / "consumer-0.jsonl") if r.get("event") == "eval"]
    final = load_checkpoint(str(ckpt), "tau")
    assert [r["step"] for r in evals] == [0, final.step]  # before the first step, after the last
    logged = evals[-1]["decode_tau"]

    # dflash-eval's loop, per held-out document: its prompt, the target live, the checkpoint's drafter, a
    # budget of the document's response length
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    drafter = build_drafter(
        final.model_state, checkpoint_drafter_config(final.meta, "tau"), target, dtype=torch.float32
    )
    runner = TargetRunner(target, drafter.config.target_layer_ids)
    gens = []
    for path in Spool(spool, create=False).eval_shards():
        shard = read_shard(path)
        cu = shard.cu_seqlens.tolist()
        for i in range(len(cu) - 1):
            ids, mask = shard.input_ids[cu[i] : cu[i + 1]], shard.loss_mask[cu[i] : cu[i + 1]].numpy()
            start, end = first_response(mask)
            gens.append(
                speculative_generate(
                    runner, DrafterProposer(drafter), ids[:start], max_new_tokens=end - start
                )
            )
    decoded = summarize(gens, drafter.config.block_size)
    assert len(gens) == evals[-1]["eval_docs"] >= HELD_OUT - 1
    print(
        json.dumps(
            {
                "logged_decode_order_tau": logged,
                "dflash_eval_tau": decoded.tau,
                "before_training": evals[0]["decode_tau"],
                "in_loop_tau": evals[-1]["in_loop_tau"],
            }
        )
    )
    # the drafter accepts drafts and clearly improved on its untrained self: not a comparison of two 1.0s
    assert decoded.tau >= evals[0]["decode_tau"] + MIN_GAIN, (decoded.tau, evals[0]["decode_tau"])
    assert decoded.verify_steps < decoded.generated_tokens - len(gens)
    assert abs(logged - decoded.tau) <= TOLERANCE, (logged, decoded.tau)
