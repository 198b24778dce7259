"""dflash-eval: the speculative-decoding loop is lossless, its drafter path computes exactly what training
computes, and τ measured by decoding agrees with τ measured on training-style blocks of the same data."""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
import torch

from dflash.common.drafter.batch import build_draft_batch, pack_samples
from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.dflash import (
    DrafterProposer,
    Generation,
    TargetRunner,
    greedy_generate,
    speculative_generate,
)
from dflash.common.drafter.model import DFlashDrafter, TargetHead
from dflash.common.drafter.report import summarize
from dflash.common.target.head import load_target_head
from dflash.tools.demo.assets import (
    build_tiny_target,
    demo_dataset_path,
    materialize_tiny_target,
    tiny_target_dir,
)
from dflash.tools.eval.cli import main
from dflash.tools.eval.run import load_prompts

EOS = 2


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small matmuls (16-token blocks) on 2 cores shared with other processes run 50x slower with 2 torch
    threads (the threads spin against each other) than with 1; the timings below assume 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    return build_tiny_target()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir())


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return load_prompts(str(demo_dataset_path()), tokenizer, num_prompts=3)


def _manual_greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    """Reference without any cache: a full forward over the whole sequence for every new token."""
    ids = prompt.clone()
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids[None]).logits[0, -1].argmax()[None]])
    return ids[prompt.shape[0] :].tolist()


class OracleProposer:
    """Knows the greedy continuation; per block it drafts the first c tokens right and the rest wrong, c
    cycling through `pattern`. Records the context features the loop hands it."""

    def __init__(self, reference: list[int], block_size: int, pattern: list[int], vocab_size: int):
        self.reference, self.block_size, self.vocab_size = reference, block_size, vocab_size
        self.pattern = itertools.cycle(pattern)
        self.expected: list[int] = []
        self.reset()

    def reset(self) -> None:
        self.features: list[torch.Tensor] = []
        self.starts: list[int] = []

    def extend(self, features: torch.Tensor, start: int) -> None:
        self.features.append(features.clone())
        self.starts.append(start)

    def propose(self, anchor_token: int, anchor_pos: int, block_len: int) -> torch.Tensor:
        right = next(self.pattern)
        self.expected.append(min(right, block_len - 1))
        out = []
        for k in range(1, block_len):
            true = self.reference[anchor_pos + k]
            out.append(true if k <= right else (true + 1) % self.vocab_size)
        return torch.tensor(out)


# ------------------------------------------------------------------------------------------------ lossless


def test_random_drafter_is_lossless(target, prompts):
    """An untrained drafter: output identical to HF `generate(do_sample=False)` (same eos stop)."""
    config = DrafterConfig.from_target_config(target.config, num_layers=1, mask_token_id=3)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, load_target_head(target, dtype=torch.float32)).eval()
    runner = TargetRunner(target, config.target_layer_ids)
    for prompt in prompts:
        gen = speculative_generate(
            runner, DrafterProposer(drafter), prompt, max_new_tokens=20, stop_token_ids=[EOS]
        )
        ref = target.generate(prompt[None], max_new_tokens=20, do_sample=False)[0, prompt.shape[0] :].tolist()
        assert gen.tokens == ref
        assert sum(n for _, _, n in gen.steps) == len(gen.tokens) - 1  # the prefill emits the first token
        assert gen.target_forwards == 1 + len(gen.steps)


def test_oracle_drafter_is_lossless_and_accepts_exactly_the_right_prefix(target, prompts):
    """Drafts right for 15 (whole block), 0, 3, 1, 7 positions: the loop accepts exactly those, the output is
    the greedy output, and the context features it accumulates are the full-forward features of every
    accepted token (positions 0..end-1, no gaps, no repeats)."""
    block, max_new = 16, 40
    layer_ids = [1, 4, 7]  # 7 = the last layer: captured after the final norm, like hidden_states[-1]
    runner = TargetRunner(target, layer_ids)
    for prompt in prompts[:2]:
        cont = _manual_greedy(target, prompt, max_new)
        reference = prompt.tolist() + cont
        oracle = OracleProposer(reference, block, [15, 0, 3, 1, 7], target.config.vocab_size)
        gen = speculative_generate(runner, oracle, prompt, max_new_tokens=max_new)
        assert gen.tokens == cont
        assert [a for _, a, _ in gen.steps] == oracle.expected
        assert max(a for _, a, _ in gen.steps) == 15  # a fully accepted block (bonus after the last draft)
        feats = torch.cat(oracle.features)
        sizes = [f.shape[0] for f in oracle.features]
        assert oracle.starts == [sum(sizes[:i]) for i in range(len(sizes))]  # contiguous from position 0
        assert feats.shape[0] == prompt.shape[0] + sum(a + 1 for _, a, _ in gen.steps[:-1])
        with torch.no_grad():
            out = target(torch.tensor(reference)[None], output_hidden_states=True)
        full = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
        torch.testing.assert_close(feats, full[: feats.shape[0]], atol=2e-5, rtol=1e-4)


def test_stop_token_and_length_budget(target, prompts):
    prompt = prompts[0]
    cont = _manual_greedy(target, prompt, 30)
    runner = TargetRunner(target, [1, 2])
    for max_new in (1, 2, 5, 17):  # budgets below, at and above one block
        oracle = OracleProposer(prompt.tolist() + cont, 16, [15], target.config.vocab_size)
        gen = speculative_generate(runner, oracle, prompt, max_new_tokens=max_new)
        assert gen.tokens == cont[:max_new]
    stop = cont[9]  # a token the target emits: decoding ends right after its first occurrence
    first = cont.index(stop)
    oracle = OracleProposer(prompt.tolist() + cont, 16, [15], target.config.vocab_size)
    gen = speculative_generate(runner, oracle, prompt, max_new_tokens=30, stop_token_ids=[stop])
    assert gen.tokens == cont[: first + 1]
    base = greedy_generate(runner, prompt, max_new_tokens=30, stop_token_ids=[stop])
    assert base.tokens == gen.tokens and base.target_forwards == len(base.tokens)


def test_target_features_match_the_producer_capture(target):
    """Eval's context features = what the producer stores for training (same layers, same semantics)."""
    from dflash.common.target.capture import LayerCapture

    ids = torch.randint(0, 4096, (23,), generator=torch.Generator().manual_seed(0))
    runner = TargetRunner(target, [1, 3, 7])
    runner.reset()
    _, feats = runner.forward(ids)
    runner.close()
    capture = LayerCapture(target, [1, 3, 7], stop_early=False)
    try:
        with torch.no_grad():
            want = capture.run(ids[None])
    finally:
        capture.close()
    torch.testing.assert_close(feats, want, atol=1e-5, rtol=1e-5)


# -------------------------------------------------------------------------------------------------- drafter


@pytest.mark.parametrize(
    "layout", [None, (["sliding_attention", "full_attention"], 10)], ids=["full", "sliding-window-10"]
)
def test_drafter_proposer_equals_the_training_forward(layout):
    """A block drafted at inference (cached context K/V, context fed in pieces) has the same hidden states as
    the same block in a training batch (dense mask kv < anchor within the document); with a sliding layer
    too (documents of 25 and 40 tokens, window 10)."""
    from transformers import AutoConfig

    torch.manual_seed(0)
    layer_types, window = layout or (None, None)
    config = DrafterConfig.from_target_config(
        AutoConfig.from_pretrained(tiny_target_dir()),
        num_layers=2,
        block_size=8,
        mask_token_id=3,
        layer_types=layer_types,
        sliding_window=window,
    )
    drafter = DFlashDrafter(config, TargetHead(torch.randn(4096, 256) * 0.1, torch.randn(4096, 256) * 0.1))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    drafter.eval()
    lengths = (25, 40)
    docs = [
        (torch.randint(0, 4096, (n,)), torch.ones(n, dtype=torch.bool), torch.randn(n, 5 * 256), i)
        for i, n in enumerate(lengths)
    ]
    batch = build_draft_batch(
        pack_samples(docs, context_tokens=80),
        block_size=8,
        num_anchors=12,
        max_anchors_per_doc=6,
        mask_token_id=3,
        gamma=7.0,
        generator=torch.Generator().manual_seed(1),
    )
    with torch.no_grad():
        want = drafter(batch)
    proposer = DrafterProposer(drafter)
    checked = 0
    for n in range(batch.num_anchors):
        if not batch.anchor_valid[n]:
            continue
        anchor = int(batch.anchors[n])
        doc_start = 0 if batch.doc_ids[anchor] == 0 else lengths[0]
        pos = anchor - doc_start
        proposer.reset()
        proposer.extend(batch.hidden[doc_start : doc_start + pos // 2], 0)
        proposer.extend(batch.hidden[doc_start + pos // 2 : anchor], pos // 2)
        got = proposer.block_hidden(batch.block_input_ids[n], pos)
        torch.testing.assert_close(got, want[n], atol=2e-5, rtol=1e-4)
        checked += 1
    assert checked >= 8


# -------------------------------------------------------------------------------------------------- metrics


def test_summarize_counts_by_hand():
    gens = [
        Generation(
            tokens=list(range(9)), steps=[(4, 3, 4), (4, 0, 1), (3, 2, 3)], target_forwards=4, wall_s=1.0
        ),
        Generation(tokens=[5, 6], steps=[(2, 1, 1)], target_forwards=2, wall_s=1.0),
    ]
    r = summarize(
        gens, 4, baseline=[Generation(tokens=list(range(9)), wall_s=3.0), Generation(tokens=[5, 7])]
    )
    assert r.generated_tokens == 11 and r.verify_steps == 4
    assert r.tau == pytest.approx(9 / 4)
    assert r.tau_per_prompt == [pytest.approx(8 / 3), 1.0]
    # position k accepted / drafted: k=1: 3 of 4, k=2: 2 of 3 (the 2-token block has no k=2), k=3: 1 of 2
    assert r.accept_rate == [1.0, 0.75, pytest.approx(2 / 3), 0.5]
    assert r.accept_length_hist == [0, 2, 0, 1, 1]
    assert r.target_forwards_per_token == pytest.approx(6 / 11)
    assert r.tokens_per_s == pytest.approx(5.5)
    assert r.baseline["mismatched_prompts"] == 1 and r.baseline["speedup"] == pytest.approx(5.5 / (11 / 3))
    assert r.outputs == [list(range(9)), [5, 6]]
    # the speed-up figure says what it means on the device it was measured on
    from dflash.tools.eval.run import format_table

    cpu, gpu = format_table(r, "cpu"), format_table(r, "cuda:0")
    assert "below 1x is expected here" in cpu and "tokens per verify step" in cpu
    assert "wall clock on this GPU" in gpu and "below 1x" not in gpu
    assert "(speedup:" not in format_table(summarize(gens, 4), "cpu")  # no baseline, no speed-up


def test_load_prompts_formats(tmp_path, tokenizer):
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "more"},
            ]
        },
        {"conversations": [{"from": "human", "value": "hey"}, {"from": "gpt", "value": "yo"}]},
        {"turns": ["what is 2+2?", "and 3+3?"]},
        {"prompt": "plain"},
        {"messages": [{"role": "assistant", "content": "no user turn"}]},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_prompts(str(path), tokenizer, num_prompts=10)
    texts = [tokenizer.decode(p) for p in got]
    assert len(texts) == 4
    assert (
        texts[0]
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "hey" in texts[1] and "what is 2+2?" in texts[2] and "3+3" not in texts[2] and "plain" in texts[3]
    assert len(load_prompts(str(path), tokenizer, num_prompts=2)) == 2
    assert len(load_prompts(str(path), tokenizer, num_prompts=10, max_prompt_tokens=12)) < 4


def test_cli_errors_are_one_line(tmp_path, target, capsys):
    from dflash.common.drafter.hf_format import export_drafter

    config = DrafterConfig.from_target_config(target.config, num_layers=1, mask_token_id=3)
    export_drafter(DFlashDrafter(config).state_dict(), config, tmp_path / "export")
    weightless = tmp_path / "weightless"  # config + tokenizer, no weights
    weightless.mkdir()
    for path in tiny_target_dir().iterdir():
        if path.suffix != ".safetensors":
            shutil.copyfile(path, weightless / path.name)
    cases = [
        (str(tiny_target_dir()), ["--drafter", str(tmp_path / "none")], "no config.json"),
        (str(tiny_target_dir()), ["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (str(weightless), [], "is incomplete: no weights (model.safetensors"),  # checked before loading
    ]
    for target_dir, extra, match in cases:
        argv = ["--target", target_dir, "--drafter", str(tmp_path / "export"), "--dataset", "x.jsonl", *extra]
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("dflash-eval: error: ")]
        assert exc.value.code == 2 and len(lines) == 1 and match in lines[0] and "Traceback" not in err, err


# ---------------------------------------------------------------------------------- train -> export -> eval


@pytest.mark.pipeline  # a whole in-process run, tens of seconds on 2 cores: the full suite
def test_train_export_eval_tau_agrees_with_training_tau(tmp_path, tokenizer):
    """τ of `dflash-eval` = τ of the trainer's building blocks on the same data.

    Data: 12 demo prompts; each document is prompt + the target's own greedy continuation (40 tokens), with the
    loss mask on the continuation, so every label is the token greedy decoding emits. A 1-layer drafter
    (B = 16) trains for 60 steps with pack_samples -> build_draft_batch -> DFlashDrafter -> draft_loss over the
    captured features, is checkpointed, exported with `dflash-export` and run by `dflash-eval`.

    Why the numbers are comparable, and which: a block anchored at position a sees the same context features
    (positions < a), the same positions and the same labels (the greedy tokens) in training and at decode
    time, so its τ is the same number in both. They differ in WHICH anchors they average over: training
    samples anchors uniformly, decoding visits a, a + τ(a), ... So (1) "replay" τ: the training-style τ of every
    anchor, averaged over the anchors decoding visits, must equal the eval τ up to float ties (measured:
    eval 3.545 = replay 3.545 over the same 132 verify steps, CPU fp32; asserted within 2 %); (2) the in-loop τ
    over uniform anchors is NOT the decode τ whenever acceptance varies along the text: long accepted runs are
    crossed in one step, so they weigh less in decoding than in a uniform average (measured: 6.833 uniform vs
    3.545 decode, so it is reported, not asserted). Timing: ~21 s on 2 busy cores with 1 torch thread.
    """
    from transformers import AutoModelForCausalLM

    from dflash.common.checkpoints.save import capture_rng_state, save_checkpoint
    from dflash.common.contract.sample_set import SampleSet
    from dflash.common.drafter.loss import draft_loss
    from dflash.tools.export.cli import main as export_main

    torch.manual_seed(0)
    # random weights: their greedy continuations are loops a 60-step drafter learns well (τ ~3.5); the
    # trained target's are prose, where the drafter is right rarely and float near-ties between the batched
    # and the cached forward move a verify step or two. This test is about the evaluator, not the target.
    target_dir = materialize_tiny_target(tmp_path / "target", weights="random")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    num_prompts, new_tokens, block = 12, 40, 16
    prompts = load_prompts(str(demo_dataset_path()), tokenizer, num_prompts=num_prompts)
    config = DrafterConfig.from_target_config(target.config, num_layers=1, block_size=block, mask_token_id=3)

    runner = TargetRunner(target, config.target_layer_ids)
    docs = []
    for i, prompt in enumerate(prompts):
        cont = greedy_generate(runner, prompt, max_new_tokens=new_tokens, stop_token_ids=[EOS]).tokens
        ids = torch.cat([prompt, torch.tensor(cont)])
        runner.reset()
        _, feats = runner.forward(ids)
        mask = torch.arange(ids.shape[0]) >= prompt.shape[0]
        docs.append((ids, mask, feats, i))
    runner.close()
    packed = pack_samples(docs, context_tokens=sum(d[0].shape[0] for d in docs))

    drafter = DFlashDrafter(config, load_target_head(target, dtype=torch.float32))
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    kw = {"block_size": block, "mask_token_id": 3, "gamma": 7.0, "generator": gen}
    for _ in range(60):
        batch = build_draft_batch(packed, num_anchors=64, max_anchors_per_doc=4, **kw)
        out = draft_loss(drafter(batch), batch, drafter.target_head.lm_head_weight)
        opt.zero_grad()
        out.loss().backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
    drafter.eval()

    # training-style τ of EVERY anchor (all candidates), with the trainer's τ rule (draft_loss)
    all_anchors = build_draft_batch(
        packed, num_anchors=num_prompts * new_tokens, max_anchors_per_doc=new_tokens, **kw
    )
    with torch.no_grad():
        hidden = drafter(all_anchors)
        loss = draft_loss(hidden, all_anchors, drafter.target_head.lm_head_weight)
        preds = (hidden[:, 1:] @ drafter.target_head.lm_head_weight.t()).argmax(-1)
    correct = (preds == all_anchors.labels[:, 1:]) & (all_anchors.label_weights[:, 1:] > 0)
    tau_block = 1 + torch.cumprod(correct.long(), 1).sum(1)
    valid = all_anchors.anchor_valid
    tau_uniform = float(loss.tau_sum / loss.num_blocks)
    assert tau_block[valid].float().mean().item() == pytest.approx(tau_uniform)  # same rule as draft_loss
    tau_at = {int(a): int(t) for a, t, v in zip(all_anchors.anchors, tau_block, valid, strict=True) if v}

    # replay: the anchors greedy decoding visits, each emitting min(τ, tokens left)
    emitted, steps, start = 0, 0, 0
    for ids, mask, _, _ in docs:
        prompt_len, num_new = int((~mask).sum()), int(mask.sum())
        anchor, made = prompt_len, 1
        while made < num_new:
            n = min(tau_at[start + anchor], num_new - made)
            emitted, steps, made, anchor = emitted + n, steps + 1, made + n, anchor + n
        start += ids.shape[0]
    tau_replay = emitted / steps

    store = tmp_path / "ckpt"
    save_checkpoint(
        str(store),
        "demo",
        60,
        model_state=dict(drafter.named_parameters()),
        optimizer_state=opt.state_dict(),
        scheduler_state={},
        rng_state=capture_rng_state(),
        trained=SampleSet(),
        config={"train": {"target": str(target_dir)}, "drafter": config.to_dict()},
    )
    assert export_main([f"{store}/demo", str(tmp_path / "export"), "--dtype", "float32"]) == 0
    report_path = tmp_path / "eval.json"
    argv = [
        "--target",
        str(target_dir),
        "--drafter",
        str(tmp_path / "export"),
        "--dataset",
        str(demo_dataset_path()),
    ]
    argv += ["--num-prompts", str(num_prompts), "--max-new-tokens", str(new_tokens), "--device", "cpu"]
    assert main([*argv, "--baseline", "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())

    print(
        f"tau: eval {report['tau']:.3f}, replay {tau_replay:.3f} ({steps} steps), uniform in-loop {tau_uniform:.3f}"
    )
    assert report["outputs"] == [d[0][d[1]].tolist() for d in docs]  # eval decoded exactly the training data
    assert report["baseline"]["mismatched_prompts"] == 0
    assert report["verify_steps"] == steps
    assert report["tau"] == pytest.approx(tau_replay, rel=0.02)
    assert (
        1.5 < report["tau"] < block
    )  # the drafter is right often, but not always: a real test of acceptance
    assert report["target_forwards_per_token"] < 0.6
    assert len(report["accept_rate"]) == block and report["accept_rate"][1] > report["accept_rate"][8] > 0


# ------------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_lossless_fp32_and_bf16_report(tmp_path, tokenizer):
    """On CUDA: fp32 speculative decoding equals greedy decoding token for token; the bf16 export path runs
    end to end (bf16 numbers are reported, not asserted: a 16-token verify forward and a 1-token forward
    round differently, so greedy ties can flip)."""
    from dflash.common.drafter.hf_format import export_drafter
    from dflash.common.target.attach import load_exported_drafter
    from dflash.tools.eval.run import evaluate, format_table

    msgs = [
        [{"role": "user", "content": text}] for text in ("What does zip do?", "Explain os.path.join.", "Hi")
    ]
    prompts = [
        torch.tensor(
            tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )
        for m in msgs
    ]
    target = build_tiny_target().cuda()
    config = DrafterConfig.from_target_config(target.config, num_layers=2, mask_token_id=3)
    torch.manual_seed(0)
    drafter = (
        DFlashDrafter(config, load_target_head(target, dtype=torch.float32, device="cuda")).cuda().eval()
    )
    runner = TargetRunner(target, config.target_layer_ids)
    proposer = DrafterProposer(drafter)
    for prompt in prompts:
        spec = speculative_generate(runner, proposer, prompt, max_new_tokens=64)
        assert spec.tokens == greedy_generate(runner, prompt, max_new_tokens=64).tokens
    runner.close()

    export_drafter(drafter.state_dict(), config, tmp_path / "export")
    target16 = build_tiny_target(dtype=torch.bfloat16).cuda()
    drafter16 = load_exported_drafter(tmp_path / "export", target16, device="cuda")
    assert drafter16.fc.weight.dtype == torch.bfloat16 and drafter16.fc.weight.is_cuda
    report = evaluate(target16, drafter16, prompts, max_new_tokens=64, baseline=True)
    print(format_table(report))
    assert report.generated_tokens == 3 * 64 and report.tau >= 1.0
    assert report.verify_steps == round(report.target_forwards_per_token * report.generated_tokens) - 3
