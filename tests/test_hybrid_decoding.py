"""Exact speculative decoding on a hybrid target (Gated DeltaNet linear attention + gated full attention, as
Qwen3.5/3.6 ship): a tiny multimodal checkpoint of that shape, a drafter trained a few steps on the target's
own continuations (so blocks are accepted in part: the rollback path runs), ``dflash-eval --baseline`` equal
to greedy on every prompt, the exported ``spec_generate`` equal to greedy, and the target's distribution at
every verify (greedy and sampled) equal to a no-cache forward of the committed tokens.

Why it needs its own rollback: a linear-attention layer's conv and recurrent states summarise every token
seen; cropping a verify block off them, as a KV cache is cropped, leaves the rejected drafts in the state
(a logit error ~1e-3 at these sizes, far above fp32 noise). ``TargetRunner`` restores the states from a
snapshot and re-runs the kept tokens instead (common/drafter/dflash.py)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoModel,
    AutoTokenizer,
    Lfm2Config,
    Lfm2ForCausalLM,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
)
from transformers.cache_utils import LinearAttentionAndFullAttentionLayer

from dflash.common.checkpoints.save import capture_rng_state, save_checkpoint
from dflash.common.contract.sample_set import SampleSet
from dflash.common.drafter.batch import build_draft_batch, pack_samples
from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.dflash import (
    DrafterProposer,
    Sampling,
    TargetRunner,
    greedy_generate,
    linear_state_layers,
    speculative_generate,
)
from dflash.common.drafter.loss import draft_loss
from dflash.common.drafter.model import DFlashDrafter
from dflash.common.target.head import load_target_head
from dflash.common.target.loading import load_target
from dflash.tools.demo.assets import demo_dataset_path, tiny_target_dir
from dflash.tools.eval.cli import main as eval_main
from dflash.tools.eval.run import load_prompts
from dflash.tools.export.cli import main as export_main
from tests.hybrid_helpers import tiny_hybrid_vlm_config

HIDDEN, LAYERS, BLOCK, NEW = 32, 6, 8, 64
PROMPTS = 8


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls on 2 shared cores: 1 torch thread is much faster than 2 spinning against each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config() -> Qwen3_5Config:
    """Qwen3.5's multimodal layout at tiny sizes: layers linear, linear, full, linear, linear, full. Linear
    head dims of 32: fla's kernels' smallest (the CUDA parametrization runs them)."""
    return tiny_hybrid_vlm_config(hidden=HIDDEN, layers=LAYERS, linear_head_dim=32, full_attention_interval=3)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> SimpleNamespace:
    """The checkpoint (multimodal, random weights: greedy continuations fall into loops a few-step drafter
    learns), its text model as dflash-eval loads it, the prompts, and a drafter trained on its continuations."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hybrid") / "qwen3_5-tiny"
    Qwen3_5ForConditionalGeneration(_config()).eval().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_target_dir() / name, path / name)
    # the project's loader: the CPU kernels also where fla is installed (a GPU box with the hybrid extra)
    target, _ = load_target(str(path), dtype=torch.float32, device="cpu")
    assert "linear_attention" in target.config.layer_types and "full_attention" in target.config.layer_types
    prompts = load_prompts(str(demo_dataset_path()), AutoTokenizer.from_pretrained(path), num_prompts=PROMPTS)
    config = DrafterConfig.from_target_config(target.config, num_layers=2, block_size=BLOCK, mask_token_id=3)
    runner = TargetRunner(target, config.target_layer_ids)
    docs = []
    for i, prompt in enumerate(prompts):
        cont = greedy_generate(runner, prompt, max_new_tokens=NEW).tokens
        ids = torch.cat([prompt, torch.tensor(cont)])
        runner.reset()
        _, feats = runner.forward(ids)
        docs.append((ids, torch.arange(ids.shape[0]) >= prompt.shape[0], feats, i))
    runner.close()
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, load_target_head(target, dtype=torch.float32))
    packed = pack_samples(docs, context_tokens=sum(d[0].shape[0] for d in docs))
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        batch = build_draft_batch(
            packed,
            block_size=BLOCK,
            num_anchors=48,
            max_anchors_per_doc=8,
            mask_token_id=3,
            gamma=7.0,
            generator=gen,
        )
        loss = draft_loss(drafter(batch), batch, drafter.target_head.lm_head_weight)
        opt.zero_grad()
        loss.loss().backward()
        opt.step()
    return SimpleNamespace(path=path, target=target, prompts=prompts, drafter=drafter.eval())


@pytest.fixture(scope="module")
def export(hybrid, tmp_path_factory):
    """The trained drafter through a checkpoint and dflash-export (what is served)."""
    tmp = tmp_path_factory.mktemp("export")
    save_checkpoint(
        str(tmp / "ckpt"),
        "hy",
        40,
        model_state=dict(hybrid.drafter.named_parameters()),
        optimizer_state={},
        scheduler_state={},
        rng_state=capture_rng_state(),
        trained=SampleSet(),
        config={"train": {"target": str(hybrid.path)}, "drafter": hybrid.drafter.config.to_dict()},
    )
    out = tmp / "export"
    assert export_main([f"{tmp / 'ckpt'}/hy", str(out), "--dtype", "float32"]) == 0
    return out


def _no_cache_logits(target, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return target(torch.tensor(ids)[None], use_cache=False).logits[0]


def _partial(steps) -> int:
    """Verify steps that accepted some drafts but not the whole block (the rollback re-runs tokens)."""
    return sum(1 for b, accepted, _ in steps if 0 < accepted < b - 1)


# ------------------------------------------------------------------------------------------- the runner


@pytest.mark.pipeline
def test_a_rolled_back_verify_leaves_the_state_of_the_kept_tokens(hybrid):
    """Prefill, verify 16 tokens, keep k of them: the next logits are a no-cache forward's (fp32 noise);
    keeping a part costs one re-run, keeping all or none costs nothing."""
    target = hybrid.target
    runner = TargetRunner(target, [0, 2])
    assert runner.state_layers == [0, 1, 3, 4]
    prompt = hybrid.prompts[0][:24]
    block = torch.randint(5, 4000, (16,), generator=torch.Generator().manual_seed(2))
    for keep, forwards in ((0, 0), (1, 1), (5, 1), (15, 1), (16, 0)):
        runner.reset()
        runner.forward(prompt)
        runner.forward(block)
        assert runner.crop(prompt.shape[0] + keep) == forwards
        assert runner.length == prompt.shape[0] + keep
        logits, _ = runner.forward(torch.tensor([7]))
        ref = _no_cache_logits(target, prompt.tolist() + block[:keep].tolist() + [7])[-1]
        assert (logits[-1] - ref).abs().max() < 1e-5, keep
    runner.reset()
    runner.forward(prompt)
    runner.forward(torch.tensor([7]))  # one token (plain decoding): no snapshot is taken
    with pytest.raises(ValueError, match="cannot roll the target's linear-attention state back"):
        runner.crop(prompt.shape[0])
    runner.close()


@pytest.mark.pipeline  # its fixtures train a drafter in-process (a minute on 2 cores)
def test_cache_families_that_cannot_be_rolled_back_are_refused_in_one_line(hybrid):
    """A conv-only (LFM2-style) layer and a layer mixing linear state with keys/values: one line each."""
    runner = TargetRunner(hybrid.target, [0])
    cfg = hybrid.target.config
    conv = SimpleNamespace(layer_types=["conv"] + list(cfg.layer_types[1:]))
    with pytest.raises(
        ValueError, match=r"layer 0 \(conv, cache LinearAttentionLayer\).*cannot roll back"
    ) as err:
        linear_state_layers(runner.cache, conv)
    assert "\n" not in str(err.value)
    mixed = SimpleNamespace(layers=[LinearAttentionAndFullAttentionLayer()])
    with pytest.raises(ValueError, match=r"layer 0 \(hybrid, cache LinearAttentionAndFullAttentionLayer\)"):
        linear_state_layers(mixed, SimpleNamespace(layer_types=["hybrid"]))
    runner.close()


class CheckedRunner(TargetRunner):
    """Records the committed tokens and, for every verify forward, its logits: the test compares them with a
    no-cache forward of the same tokens (what a lossless rule needs: the true target distribution)."""

    def reset(self) -> None:
        super().reset()
        self.tokens: list[int] = []
        self.verifies: list[tuple[list[int], torch.Tensor]] = []

    def crop(self, length: int) -> int:
        self.tokens = self.tokens[:length]
        return super().crop(length)

    def forward(self, ids, *, last_logits_only=False, capture=True):
        logits, feats = super().forward(ids, last_logits_only=last_logits_only, capture=capture)
        if capture:  # not the rollback's own re-run, which only re-advances the state
            self.tokens += ids.tolist()
            if self.length > ids.shape[0]:
                self.verifies.append((list(self.tokens), logits.clone()))
        return logits, feats


@pytest.mark.parametrize("temperature", [0.0, 0.005])
@pytest.mark.pipeline
def test_every_verify_sees_the_targets_true_distribution(hybrid, temperature):
    """Greedy and sampled (rejection sampling) alike: at every verify the logits of the whole block equal a
    no-cache forward over the committed tokens, so the rejection rule is applied to the true p (lossless by
    tests/test_sampling.py); blocks were accepted in part, so the restore path ran. T = 0.005: the random
    target's logits are flat (a few tenths apart), so at T = 1 a draft is almost never accepted; 0.005 makes p
    peaked and still runs the sampled path (rejection sampling, threshold 1e-5)."""
    runner = CheckedRunner(hybrid.target, hybrid.drafter.config.target_layer_ids)
    proposer = DrafterProposer(hybrid.drafter)
    sampling = Sampling(temperature=temperature, generator=torch.Generator().manual_seed(0))
    partial = 0
    for prompt in hybrid.prompts[:3]:
        gen = speculative_generate(runner, proposer, prompt, max_new_tokens=40, sampling=sampling)
        partial += _partial(gen.steps)
        rerun = sum(1 for b, accepted, _ in gen.steps if accepted < b - 1)  # kept part of the block: 1 re-run
        assert gen.target_forwards == 1 + len(gen.steps) + rerun
        for tokens, logits in runner.verifies:
            ref = _no_cache_logits(hybrid.target, tokens)[-logits.shape[0] :]
            assert (logits - ref).abs().max() < 1e-4
    runner.close()
    assert partial > 0


# ------------------------------------------------------------------------------------ the tools, end to end


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
    ],
)
@pytest.mark.pipeline
def test_dflash_eval_baseline_equals_greedy_on_the_hybrid_target(hybrid, export, tmp_path, capsys, device):
    """``dflash-eval --baseline`` (fp32, 8 prompts, 64 tokens): 0 prompts differ from greedy; τ > 1 with
    blocks accepted in part. On CUDA the linear-attention kernels are fla's / causal-conv1d's when installed."""
    out = tmp_path / "eval.json"
    argv = [
        "--target",
        str(hybrid.path),
        "--drafter",
        str(export),
        "--dataset",
        str(demo_dataset_path()),
        "--num-prompts",
        str(PROMPTS),
        "--max-new-tokens",
        str(NEW),
        "--ignore-eos",
        "--baseline",
        "--device",
        device,
        "--dtype",
        "float32",
        "--json",
        str(out),
    ]
    assert eval_main(argv) == 0
    report = json.loads(out.read_text())
    assert report["prompts"] == PROMPTS and report["generated_tokens"] == PROMPTS * NEW
    assert report["baseline"]["mismatched_prompts"] == 0
    hist = report["accept_length_hist"]  # steps that emitted n tokens = accepted n - 1 drafts
    assert sum(hist[2:BLOCK]) > 0, hist  # accepted > 0 and < block - 1 drafts: the state was restored
    assert report["tau"] > 1.3, report["tau"]
    assert "prompts differing from greedy  0" in capsys.readouterr().out
    with capsys.disabled():
        print(f"\nhybrid dflash-eval ({device}): tau {report['tau']:.2f}, accept_length_hist {hist}")


@pytest.mark.pipeline
def test_exported_spec_generate_equals_greedy_on_the_hybrid_target(hybrid, export, tmp_path, monkeypatch):
    """The export's own code (AutoModel + trust_remote_code) on the same prompts: token for token
    transformers' greedy ``generate`` of the target, with blocks accepted in part."""
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    draft = AutoModel.from_pretrained(export, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(draft).__module__.startswith("transformers_modules.")
    target, steps = hybrid.target, []
    for prompt in hybrid.prompts:
        ids = prompt[None]
        stats = draft.spec_generate(
            input_ids=ids,
            max_new_tokens=NEW,
            temperature=0.0,
            target=target,
            stop_token_ids=None,
            return_stats=True,
        )
        greedy = target.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
        assert stats.output_ids.tolist() == greedy.tolist()
        steps += stats.generation.steps
    assert _partial(steps) > 0
    print(f"hybrid spec_generate: tau {sum(n for *_, n in steps) / len(steps):.2f} over {len(steps)} steps")


@pytest.mark.pipeline  # its fixtures train a drafter in-process (a minute on 2 cores)
def test_dflash_eval_refuses_a_target_it_cannot_roll_back(export, tmp_path, capsys):
    """An LFM2-style target (short-conv layers: a state, but not Gated DeltaNet's) is refused in one line:
    dflash-eval exits 2 before decoding (``spec_generate`` raises the same ValueError from ``TargetRunner``:
    test_cache_families_that_cannot_be_rolled_back_are_refused_in_one_line)."""
    config = Lfm2Config(
        vocab_size=4096,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        layer_types=["conv", "full_attention"],
    )
    torch.manual_seed(0)
    model = Lfm2ForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "lfm2")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_target_dir() / name, tmp_path / "lfm2" / name)
    argv = [
        "--target",
        str(tmp_path / "lfm2"),
        "--drafter",
        str(export),
        "--dataset",
        str(demo_dataset_path()),
        "--num-prompts",
        "1",
        "--device",
        "cpu",
    ]
    with pytest.raises(SystemExit) as exc:
        eval_main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("dflash-eval: error: ")]
    assert exc.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert (
        "layer 0 (conv, cache LinearAttentionLayer) keeps a state that speculative decoding cannot roll back"
        in lines[0]
    )
