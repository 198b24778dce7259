"""Sampling: speculative rejection sampling is lossless in distribution.

What "lossless" means here: every token the draft -> verify loop emits is distributed exactly as the
target's own sampling (softmax(logits / T), cut to the top-p nucleus), whatever the drafter proposes.
The verdicts are chi-square tests at significance 0.001 on draws from seeded generators, so they are
deterministic (never a matter of timing or load); a negative control (the classic bug: resampling from p
instead of the residual after a rejection) shows the same test rejects a sampler that is not lossless.

Why the memoised target: the prefill of one prompt is the same 2,000 times over, and the verify forward
depends only on the first token and the draft, so ``MemoTarget`` runs the real ``TargetRunner`` once per
distinct call sequence and replays its outputs: ``speculative_generate`` runs unchanged, every logit is
the target's own, and 2,000 runs take seconds instead of a minute.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import TopPLogitsWarper

from dflash.common.drafter import dflash as drafter_module
from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.dflash import (
    DrafterProposer,
    Sampling,
    TargetRunner,
    speculative_generate,
    verify_sampled,
    warp_probs,
)
from dflash.common.drafter.model import DFlashDrafter
from dflash.common.target.head import load_target_head
from dflash.tools.demo.assets import build_tiny_target

RUNS = 2000
ALPHA = 1e-3  # significance level: a lossless sampler fails a test by chance with probability 0.001
PROMPT = [5, 300, 17, 99, 12, 7]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def chi_square(
    observed: Counter, expected: dict, n: int, min_expected: float = 5.0
) -> tuple[float, int, float]:
    """Pearson's test of counts against probabilities: cells expecting >= 5 on their own, the rest pooled
    into one; -> (statistic, degrees of freedom, p-value = the chi-square survival function)."""
    big = [k for k, p in expected.items() if n * p >= min_expected]
    exp = [n * expected[k] for k in big]
    obs = [observed.get(k, 0) for k in big]
    rest_exp, rest_obs = n - sum(exp), n - sum(obs)
    if rest_exp > 1e-9 or rest_obs:
        exp.append(max(rest_exp, 1e-9))
        obs.append(rest_obs)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    df = len(exp) - 1
    p_value = float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )
    return stat, df, p_value


# --------------------------------------------------------------------------------------- the rule alone


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    for top_p, want in (
        (1.0, [0.5, 0.3, 0.15, 0.05]),
        (0.7, [0.625, 0.375, 0, 0]),
        (0.5, [1, 0, 0, 0]),
        (0.81, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    ):
        got = warp_probs(logits, Sampling(temperature=1.0, top_p=top_p))
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), atol=1e-6, rtol=0)
    sharp = warp_probs(logits, Sampling(temperature=0.5))
    torch.testing.assert_close(sharp, torch.softmax(logits / 0.5, -1))
    with pytest.raises(ValueError, match="top_p"):
        Sampling(temperature=1.0, top_p=0.0)


def _law(p: torch.Tensor, draft: list[int], q: torch.Tensor | None) -> dict[tuple[int, int], float]:
    """The exact law of (accepted drafts, next token) of speculative sampling, written out: draft k is
    accepted with min(1, p_k(d)/q_k(d)) once all before it were; a rejection draws from max(p_k - q_k, 0)
    normalised; after every draft, the bonus from p_b."""
    law: dict[tuple[int, int], float] = {}
    reach = 1.0
    for k, d in enumerate(draft):
        qk = torch.nn.functional.one_hot(torch.tensor(d), p.shape[1]).double() if q is None else q[k].double()
        accept = min(1.0, float(p[k, d]) / float(qk[d]))
        residual = (p[k].double() - qk).clamp(min=0)
        for t in range(p.shape[1]):
            if residual.sum() > 0:
                law[(k, t)] = reach * (1 - accept) * float(residual[t] / residual.sum())
        reach *= accept
    for t in range(p.shape[1]):
        law[(len(draft), t)] = reach * float(p[len(draft), t])
    return law


@pytest.mark.parametrize("draft_mode", ["greedy", "sample"])
def test_verify_sampled_follows_the_exact_law_of_speculative_sampling(draft_mode):
    """A 3-position block over a 6-token vocabulary, 20,000 verifications of one draft: (accepted, next
    token) follows the law written out by hand, including the bonus after a fully accepted block."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=g) * 1.5
    sampling = Sampling(temperature=1.0, generator=torch.Generator().manual_seed(1))
    p = warp_probs(logits, sampling)
    if draft_mode == "greedy":
        draft, q = [int(p[0].argmax()), int(p[1].argsort()[-2])], None  # a likely and a less likely draft
    else:
        q = torch.softmax(torch.randn(2, 6, generator=g), -1)
        draft = [int(p[0].argmax()), int(q[1].argmax())]  # one with p/q > 1 or < 1, whichever it is
    n = 20_000
    seen = Counter(verify_sampled(logits, torch.tensor(draft), q, sampling) for _ in range(n))
    law = _law(p, draft, q)
    assert sum(law.values()) == pytest.approx(1.0)
    stat, df, p_value = chi_square(seen, law, n)
    assert p_value > ALPHA, (stat, df, p_value)


@pytest.mark.parametrize("draft_mode", ["greedy", "sample"])
def test_the_emitted_token_is_distributed_as_p(draft_mode):
    """The point of the rule: the first emitted token is distributed as p_1, whatever q, when the draft
    is what the drafter proposes (its argmax, or a fresh draw from q each time)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, generator=g) * 1.5
    gen = torch.Generator().manual_seed(4)
    sampling = Sampling(temperature=1.0, generator=gen)
    q = torch.softmax(torch.randn(1, 6, generator=g) * 1.5, -1)
    n, first = 20_000, Counter()
    for _ in range(n):
        if draft_mode == "greedy":
            draft, probs = torch.tensor([int(q[0].argmax())]), None
        else:
            draft, probs = torch.multinomial(q[0], 1, generator=gen), q
        accepted, token = verify_sampled(logits, draft, probs, sampling)
        first[int(draft[0]) if accepted else token] += 1
    _, _, p_value = chi_square(first, dict(enumerate(warp_probs(logits[0], sampling).tolist())), n)
    assert p_value > ALPHA, p_value


def test_certain_and_impossible_drafts():
    sampling = Sampling(temperature=1.0, generator=torch.Generator().manual_seed(0))
    logits = torch.tensor([[0.0, 50.0, 0.0], [0.0, 0.0, 50.0], [1.0, 2.0, 3.0]])
    assert all(verify_sampled(logits, torch.tensor([1, 2]), None, sampling)[0] == 2 for _ in range(200))
    top = Sampling(temperature=1.0, top_p=0.5, generator=torch.Generator().manual_seed(0))
    outcomes = {
        verify_sampled(torch.tensor([[3.0, 0.0, 0.0], [0.0, 0.0, 0.0]]), torch.tensor([2]), None, top)
        for _ in range(200)
    }
    assert outcomes == {(0, 0)}  # token 2 is outside the nucleus: never accepted, never the residual draw


# ----------------------------------------------------------------------------------- the loop, end to end


class MemoTarget:
    """``TargetRunner``'s interface over a real one, replaying each forward's outputs by the call sequence
    (see the module docstring): the same calls in the same order give the same numbers."""

    def __init__(self, runner: TargetRunner):
        self.runner, self.device, self.memo = runner, runner.device, {}
        self.calls: list = []

    def reset(self) -> None:
        self.calls, self.tokens = [], []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def crop(self, length: int) -> None:
        self.tokens = self.tokens[:length]
        self.calls.append(("crop", length))

    def forward(self, ids: torch.Tensor, *, last_logits_only: bool = False, capture: bool = True):
        self.calls.append((tuple(ids.tolist()), last_logits_only, capture))
        key = tuple(self.calls)
        if key not in self.memo:
            self.runner.reset()
            for call in self.calls:  # replay the whole sequence on the real cache
                if call[0] == "crop":
                    self.runner.crop(call[1])
                else:
                    out = self.runner.forward(
                        torch.tensor(call[0]), last_logits_only=call[1], capture=call[2]
                    )
            self.memo[key] = out
        self.tokens += ids.tolist()
        return self.memo[key]


class TargetGreedyProposer:
    """Drafts the target's most likely token after [prompt, anchor]: accepted with probability p(argmax),
    about one time in two here, so both branches of the rule run often."""

    block_size = 2

    def __init__(self, argmax_after: dict[int, int]):
        self.argmax_after = argmax_after

    def reset(self) -> None: ...

    def extend(self, features, start) -> None: ...

    def propose(self, anchor_token: int, anchor_pos: int, block_len: int) -> torch.Tensor:
        return torch.tensor([self.argmax_after.get(anchor_token, 0)])


class TargetLikeSampler(TargetGreedyProposer):
    """Samples drafts from q = softmax(1.5 * target logits + a fixed perturbation): close to p but not p,
    so p/q is above 1 for some tokens and below for others (the ratio branch of the rule), over a few
    likely tokens (so the memoised target holds few verify forwards)."""

    def __init__(self, logits_after: dict[int, torch.Tensor]):
        self.logits_after = logits_after
        self.noise = torch.randn(
            next(iter(logits_after.values())).shape[-1], generator=torch.Generator().manual_seed(5)
        )

    def draft_logits(self, anchor_token: int, anchor_pos: int, block_len: int) -> torch.Tensor:
        base = self.logits_after.get(anchor_token, self.noise)  # a rare first token: any q will do
        return (1.5 * base + self.noise)[None]


class MemoProposer:
    """A proposer's drafts replayed by its call sequence (features fingerprinted): the untrained DFlash
    drafter proposes the same block for the same context every run; computing it once keeps 2,000 runs
    fast, as MemoTarget does for the target."""

    def __init__(self, proposer: DrafterProposer):
        self.proposer, self.block_size, self.memo, self.calls = proposer, proposer.block_size, {}, []

    def reset(self) -> None:
        self.calls = []

    def extend(self, features: torch.Tensor, start: int) -> None:
        self.calls.append(
            ("extend", start, features.shape[0], round(float(features.double().sum()), 6), features)
        )

    def propose(self, anchor_token: int, anchor_pos: int, block_len: int) -> torch.Tensor:
        self.calls.append(("propose", anchor_token, anchor_pos, block_len))
        key = tuple(c[:4] for c in self.calls)
        if key not in self.memo:
            self.proposer.reset()
            for call in self.calls[:-1]:
                if call[0] == "extend":
                    self.proposer.extend(call[4], call[1])
            self.memo[key] = self.proposer.propose(anchor_token, anchor_pos, block_len)
        return self.memo[key]


@pytest.fixture(scope="module")
def setup():
    target = build_tiny_target()
    config = DrafterConfig.from_target_config(target.config, num_layers=1, block_size=4, mask_token_id=3)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, load_target_head(target, dtype=torch.float32)).eval()
    runner = TargetRunner(target, config.target_layer_ids)
    return target, drafter, runner


def _target_law(target, sampling: Sampling, reference_warp) -> tuple[dict, dict[int, torch.Tensor]]:
    """The target's own law of its first two sampled tokens after PROMPT, from plain forwards without a
    cache and transformers' own top-p warper: P(t1, t2) = p(t1 | prompt) p(t2 | prompt, t1) for every t1
    that can fill a cell (the rest is pooled by the test); and the target's logits after each such t1."""
    prompt = torch.tensor(PROMPT)
    with torch.no_grad():
        p1 = reference_warp(target(prompt[None]).logits[0, -1:])[0]
        law, logits_after = {}, {}
        for t1 in (p1 * RUNS >= 5).nonzero().squeeze(1).tolist():
            logits_after[t1] = target(torch.cat([prompt, torch.tensor([t1])])[None]).logits[0, -1]
            p2 = reference_warp(logits_after[t1][None])[0]
            law.update({(t1, t2): float(p1[t1] * p2[t2]) for t2 in (p2 > 0).nonzero().squeeze(1).tolist()})
    return law, logits_after


def _hf_warp(temperature: float, top_p: float):
    warper = TopPLogitsWarper(top_p) if top_p < 1 else None

    def warp(logits: torch.Tensor) -> torch.Tensor:
        scores = logits.float() / temperature
        if warper is not None:
            scores = warper(None, scores)
        return torch.softmax(scores, -1)

    return warp


def _first_two(runner, proposer, sampling: Sampling) -> Counter:
    memo = MemoTarget(runner)
    return Counter(
        tuple(
            speculative_generate(
                memo, proposer, torch.tensor(PROMPT), max_new_tokens=2, sampling=sampling
            ).tokens
        )
        for _ in range(RUNS)
    )


@pytest.mark.parametrize(
    ("proposer_kind", "draft", "temperature", "top_p"),
    [
        ("target-greedy", "greedy", 1.0, 1.0),
        ("dflash-drafter", "greedy", 1.0, 1.0),
        ("target-like", "sample", 1.0, 1.0),
        ("target-greedy", "greedy", 0.8, 0.9),
    ],
)
def test_the_first_speculated_token_is_distributed_as_the_targets_own_sampling(
    setup, proposer_kind, draft, temperature, top_p
):
    """2,000 decodes of two tokens at temperature 1.0 (and once with T 0.8, top-p 0.9) on the tiny target.

    The answer's first token comes from the prefill, with no drafter involved; the first token that
    speculation decides is the second one: the draft d_1 accepted, or a residual draw. So the pair (t1, t2)
    must follow the target's own law P(t1) P(t2 | t1), computed independently (no cache, transformers'
    top-p). Drafters: one drafting the target's own argmax (accepted about half the time), the untrained
    DFlash drafter (its drafts mostly rejected: the residual branch), and drafts sampled from a q near p
    (the p/q ratio)."""
    target, drafter, runner = setup
    sampling = Sampling(
        temperature=temperature, top_p=top_p, draft=draft, generator=torch.Generator().manual_seed(7)
    )
    law, logits_after = _target_law(target, sampling, _hf_warp(temperature, top_p))
    argmax_after = {t1: int(logits.argmax()) for t1, logits in logits_after.items()}
    proposer = {
        "target-greedy": lambda: TargetGreedyProposer(argmax_after),
        "dflash-drafter": lambda: MemoProposer(DrafterProposer(drafter)),
        "target-like": lambda: TargetLikeSampler(logits_after),
    }[proposer_kind]()
    seen = _first_two(runner, proposer, sampling)
    stat, df, p_value = chi_square(seen, law, RUNS)
    print(f"{proposer_kind}/{draft} T={temperature} top-p={top_p}: chi2 {stat:.1f}, df {df}, p {p_value:.3f}")
    assert df >= 5 and p_value > ALPHA, (stat, df, p_value)
    if proposer_kind == "target-greedy":  # both branches ran: the draft was accepted, and rejected, often
        accepted = sum(c for (t1, t2), c in seen.items() if argmax_after.get(t1) == t2)
        assert 0.2 * RUNS < accepted < 0.9 * RUNS, accepted


def test_a_sampler_that_is_not_lossless_fails_the_same_test(setup, monkeypatch):
    """Negative control: after a rejection, drawing from p instead of the residual over-represents the
    draft; the same 2,000 runs and chi-square test reject it (p-value far below 0.001)."""
    target, _, runner = setup
    sampling = Sampling(temperature=1.0, generator=torch.Generator().manual_seed(7))
    law, logits_after = _target_law(target, sampling, _hf_warp(1.0, 1.0))
    argmax_after = {t1: int(logits.argmax()) for t1, logits in logits_after.items()}
    real = drafter_module.verify_sampled

    def biased(target_logits, draft, draft_probs, sampling):
        accepted, token = real(target_logits, draft, draft_probs, sampling)
        if accepted < draft.shape[0]:  # the bug: a fresh draw from p, which may be the rejected draft again
            token = int(
                torch.multinomial(
                    warp_probs(target_logits[accepted], sampling), 1, generator=sampling.generator
                )
            )
        return accepted, token

    monkeypatch.setattr(drafter_module, "verify_sampled", biased)
    seen = _first_two(runner, TargetGreedyProposer(argmax_after), sampling)
    _, _, p_value = chi_square(seen, law, RUNS)
    assert p_value < 1e-6, p_value


def test_greedy_sampling_is_the_greedy_loop(setup):
    """temperature 0 (or below the public 1e-5 threshold) is the greedy loop: no draw at all."""
    _, drafter, runner = setup
    prompt = torch.tensor(PROMPT)
    greedy = speculative_generate(runner, DrafterProposer(drafter), prompt, max_new_tokens=12).tokens
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    tiny = speculative_generate(
        runner,
        DrafterProposer(drafter),
        prompt,
        max_new_tokens=12,
        sampling=Sampling(temperature=1e-6, generator=gen),
    ).tokens
    assert tiny == greedy and torch.equal(gen.get_state(), state)


def test_dflash_eval_samples_repeatably_and_reports_acceptance_per_position(tmp_path, tiny_target, capsys):
    """dflash-eval --temperature: the report says how it sampled and gives acceptance per block position;
    the same --seed gives the same outputs, another seed others; the baseline is not compared token by
    token (sampled outputs differ by chance)."""
    import json

    from dflash.common.drafter.hf_format import export_drafter
    from dflash.tools.demo.assets import demo_dataset_path
    from dflash.tools.eval.cli import main

    target = build_tiny_target()
    config = DrafterConfig.from_target_config(target.config, num_layers=1, block_size=4, mask_token_id=3)
    torch.manual_seed(0)
    export_drafter(DFlashDrafter(config).state_dict(), config, tmp_path / "export", dtype=torch.float32)
    argv = [
        "--target",
        str(tiny_target),
        "--drafter",
        str(tmp_path / "export"),
        "--dataset",
        str(demo_dataset_path()),
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "12",
        "--device",
        "cpu",
        "--temperature",
        "1.0",
        "--top-p",
        "0.9",
    ]
    reports = []
    for seed, baseline in (("0", ["--baseline"]), ("0", []), ("1", [])):
        path = tmp_path / f"eval-{seed}-{len(baseline)}.json"
        assert main([*argv, "--seed", seed, *baseline, "--json", str(path)]) == 0
        reports.append(json.loads(path.read_text()))
    table = capsys.readouterr().out
    assert (
        "temperature 1.0, top_p 0.9, draft greedy" in table and "prompts differing from greedy" not in table
    )
    first, again, other = reports
    assert first["sampling"] == {"temperature": 1.0, "top_p": 0.9, "draft": "greedy"}
    assert len(first["accept_rate"]) == 4 and first["accept_rate"][0] == 1.0
    assert first["outputs"] == again["outputs"] and first["outputs"] != other["outputs"]
    assert first["baseline"]["mismatched_prompts"] is None and first["baseline"]["tokens_per_s"] > 0
    with pytest.raises(SystemExit) as exc:
        main([*argv[:-4], "--top-p", "0.9"])  # top-p without a temperature
    assert exc.value.code == 2 and "--top-p needs --temperature" in capsys.readouterr().err
