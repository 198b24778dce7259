"""Decode-order τ (common/drafter/decode_tau.py) walks a document exactly as dflash-eval decodes when the document's
response is the target's greedy output: the same verify steps, accepted counts, emitted tokens and context
features, with no target forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_evaluate import OracleProposer, _manual_greedy

from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.decode_tau import (
    HeldOutDoc,
    batched_teacher_forced_generate,
    decode_order_tau,
    first_response,
    teacher_forced_generate,
)
from dflash.common.drafter.dflash import DrafterProposer, TargetRunner, speculative_generate
from dflash.common.drafter.model import DFlashDrafter
from dflash.common.drafter.report import summarize
from dflash.common.target.head import load_target_head
from dflash.tools.demo.assets import build_tiny_target, demo_dataset_path, tiny_target_dir
from dflash.tools.eval.run import load_prompts

LAYERS = [1, 4, 7]
MAX_NEW = 40


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    target = build_tiny_target()
    tok = AutoTokenizer.from_pretrained(tiny_target_dir())
    prompts = load_prompts(str(demo_dataset_path()), tok, num_prompts=2)
    docs = []
    for p in prompts:  # the document a producer would spool: prompt + the target's greedy response
        ids = torch.tensor(p.tolist() + _manual_greedy(target, p, MAX_NEW))
        with torch.no_grad():
            out = target(ids[None], output_hidden_states=True)
        hidden = torch.cat([out.hidden_states[i + 1][0] for i in LAYERS], dim=-1)
        mask = np.zeros(len(ids), dtype=bool)
        mask[len(p) :] = True
        docs.append(HeldOutDoc(sample_index=len(docs), input_ids=ids.numpy(), loss_mask=mask, hidden=hidden))
    return target, prompts, docs


def _overfit(drafter: DFlashDrafter, docs: list[HeldOutDoc], steps: int = 30) -> None:
    """A few training steps on the documents themselves (the trainer's building blocks)."""
    from dflash.common.drafter.batch import build_draft_batch, pack_samples
    from dflash.common.drafter.loss import draft_loss

    packed = pack_samples(
        [
            (torch.from_numpy(d.input_ids), torch.from_numpy(d.loss_mask), d.hidden, d.sample_index)
            for d in docs
        ],
        context_tokens=sum(len(d.input_ids) for d in docs),
    )
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = build_draft_batch(
            packed,
            block_size=16,
            num_anchors=32,
            max_anchors_per_doc=16,
            mask_token_id=3,
            gamma=7.0,
            generator=gen,
        )
        out = draft_loss(drafter(batch), batch, drafter.target_head.lm_head_weight)
        opt.zero_grad()
        out.loss().backward()
        opt.step()
    drafter.eval()


def test_first_response_is_the_first_supervised_span():
    assert first_response(np.array([0, 0, 1, 1, 0, 1], dtype=bool)) == (2, 4)
    assert first_response(np.array([0, 1, 1], dtype=bool)) == (1, 3)
    assert first_response(np.zeros(4, dtype=bool)) is None


def test_the_walk_is_dflash_evals_loop_step_for_step(setup):
    """An oracle drafter right for 15, 0, 3, 1, 7 positions per block: same steps, tokens and features."""
    target, prompts, docs = setup
    runner = TargetRunner(target, LAYERS)
    for prompt, doc in zip(prompts, docs, strict=True):
        ref = doc.input_ids.tolist()
        live = OracleProposer(ref, 16, [15, 0, 3, 1, 7], target.config.vocab_size)
        walk = OracleProposer(ref, 16, [15, 0, 3, 1, 7], target.config.vocab_size)
        decoded = speculative_generate(runner, live, prompt, max_new_tokens=MAX_NEW)
        walked = teacher_forced_generate(
            walk, doc.input_ids, doc.hidden, start=len(prompt), max_new_tokens=MAX_NEW, block_size=16
        )
        assert walked.steps == decoded.steps and walked.tokens == decoded.tokens
        assert walk.starts == live.starts
        torch.testing.assert_close(torch.cat(walk.features), torch.cat(live.features), atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def drafter(setup):
    """A drafter that accepts some drafts, so the walk's branches all run."""
    target, _, docs = setup
    config = DrafterConfig.from_target_config(
        target.config, num_layers=1, mask_token_id=3, target_layer_ids=LAYERS
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, load_target_head(target, dtype=torch.float32))
    _overfit(drafter, docs)
    return drafter


def test_decode_order_tau_equals_dflash_eval_with_a_real_drafter(setup, drafter):
    target, prompts, docs = setup
    config = drafter.config
    runner = TargetRunner(target, LAYERS)
    gens = [
        speculative_generate(runner, DrafterProposer(drafter), p, max_new_tokens=MAX_NEW) for p in prompts
    ]
    decoded = summarize(gens, config.block_size)
    walked = decode_order_tau(drafter, docs)
    print(f"decode-order tau {walked.tau:.3f}, dflash-eval tau {decoded.tau:.3f}")
    assert decoded.tau > 1.02  # the drafter accepts drafts: every branch of the walk ran
    assert walked.verify_steps == decoded.verify_steps
    assert walked.tau == decoded.tau and walked.accept_rate == decoded.accept_rate
    assert walked.outputs == decoded.outputs


def test_the_batched_walk_equals_each_document_walked_alone(setup, drafter):
    """Documents of different lengths, budgets that end mid-block and a stop token, walked together in one
    batch per round: the same steps and tokens as each walked alone through dflash-eval's proposer."""
    _, prompts, docs = setup
    cases = []
    for prompt, doc in zip(prompts, docs, strict=True):
        start = len(prompt)
        cases += [(doc, start, MAX_NEW, ()), (doc, start, 7, ())]
    doc, start = docs[0], len(prompts[0])
    cases.append((doc, start, MAX_NEW, (int(doc.input_ids[start + 9]),)))  # stops at the 10th token
    cases.append((docs[1], 5, 12, ()))  # a shorter prompt: the batch's anchors differ widely
    alone = [
        teacher_forced_generate(
            DrafterProposer(drafter),
            d.input_ids,
            d.hidden,
            start=s,
            max_new_tokens=n,
            stop_token_ids=stop,
            block_size=drafter.config.block_size,
        )
        for d, s, n, stop in cases
    ]
    for stop in {c[3] for c in cases}:  # one batch per stop set (the batched walk takes one)
        picked = [i for i, c in enumerate(cases) if c[3] == stop]
        together = batched_teacher_forced_generate(
            drafter,
            [(cases[i][0].input_ids, cases[i][0].hidden, cases[i][1], cases[i][2]) for i in picked],
            stop_token_ids=stop,
        )
        for i, gen in zip(picked, together, strict=True):
            assert gen.steps == alone[i].steps and gen.tokens == alone[i].tokens, i
    assert any(a > 0 for g in alone for _, a, _ in g.steps)  # drafts were accepted: every branch ran
    assert len(alone[-2].tokens) <= 10 and alone[-2].tokens[-1] == cases[-2][3][0]  # the stop case stopped


def test_periodic_evaluations_keep_to_their_share_of_the_run():
    from dflash.consumer.held_out import EvalBudget

    budget = EvalBudget(0.03)
    assert budget.allows(0.0)  # nothing measured yet: the first one runs
    budget.add(1.0)  # one evaluation took 1 s
    assert not budget.allows(60.0)  # a second would make 2 s of 60 (3.3 %)
    assert budget.allows(70.0)  # 2 s of 70 s (2.9 %)
    budget.add(0.5)
    assert (budget.spent_s, budget.last_s) == (1.5, 0.5)
    assert not budget.allows(60.0) and budget.allows(70.0)  # 2 s again, priced at the last one


def test_the_batched_walk_equals_the_proposer_with_sliding_layers(setup):
    """The batched walk's key masks and the proposer's cache agree on sliding layers too (window 6 against
    documents of ~60 tokens): the same steps and tokens, and drafts were accepted."""
    target, prompts, docs = setup
    config = DrafterConfig.from_target_config(
        target.config,
        num_layers=2,
        mask_token_id=3,
        target_layer_ids=LAYERS,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=6,
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, load_target_head(target, dtype=torch.float32))
    _overfit(drafter, docs)
    cases = [
        (d.input_ids, d.hidden, len(p), n) for p, d in zip(prompts, docs, strict=True) for n in (MAX_NEW, 9)
    ]
    together = batched_teacher_forced_generate(drafter, cases)
    for (ids, hidden, start, n), gen in zip(cases, together, strict=True):
        alone = teacher_forced_generate(
            DrafterProposer(drafter), ids, hidden, start=start, max_new_tokens=n, block_size=config.block_size
        )
        assert gen.steps == alone.steps and gen.tokens == alone.tokens
    assert any(a > 0 for g in together for _, a, _ in g.steps)
