"""DFlash2 drafters (z-lab's DFlash2: a grouped dynamic causal convolution around each draft sublayer, a
candidate selector over the draft logits): a zero-initialised DFlash2 computes exactly what DFlash does,
the convolution stays inside each draft block, the selector's scores, walk and loss equal an independent
reference, the export carries the public DFlash2 config keys and tensor names and shapes, and decoding
with a DFlash2 drafter is lossless."""

import json
import re

import pytest
import torch
from draft_reference import one_thread  # noqa: F401  (autouse fixture)
from safetensors import safe_open
from test_drafter import tiny_target_config
from transformers import AutoModel, Qwen3ForCausalLM

from dflash.common.drafter.batch import build_draft_batch, pack_samples
from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.dflash import (
    CandidateSelector,
    DrafterProposer,
    GroupedDynamicCausalConv,
    Sampling,
    TargetRunner,
    greedy_generate,
    speculative_generate,
)
from dflash.common.drafter.hf_format import (
    drafter_config_from_export,
    expected_shapes,
    export_drafter,
    read_export_config,
)
from dflash.common.drafter.loss import SelectorTerm, draft_loss, selector_weight
from dflash.common.drafter.model import DFlashDrafter, TargetHead
from dflash.common.drafter.serving_check import check_folder
from dflash.consumer.config import TrainConfig

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

BLOCK = 4

# The public DFlash2 checkpoint format (z-lab/dflash tests/fixtures/dflash2-config.json and
# dflash2-safetensors-header.json): the extra dflash_config keys, and every tensor name with its shape for
# that 5-layer drafter (hidden 6656, 32 x 128 heads, 8 KV heads, FFN 19968, vocabulary 202048, 5 target
# layers). ``N`` stands for each layer index.
PUBLIC_DFLASH_CONFIG_KEYS = {
    "block_size",
    "conv_group_size",
    "conv_kernel_size",
    "final_logit_softcapping",
    "mask_token_id",
    "output_multiplier",
    "selector_rank",
    "selector_top_k",
    "target_layer_ids",
}
PUBLIC_SHAPES = {
    "candidate_selector.hidden_projection.weight": [256, 6656],
    "candidate_selector.predecessor_codebook": [202048, 256],
    "candidate_selector.successor_codebook": [202048, 256],
    "fc.weight": [6656, 33280],
    "hidden_norm.weight": [6656],
    "layers.N.attention_conv.base_kernel": [2, 2, 6656],
    "layers.N.attention_conv.kernel_projection.weight": [1664, 6656],
    "layers.N.input_layernorm.weight": [6656],
    "layers.N.mlp.down_proj.weight": [6656, 19968],
    "layers.N.mlp.gate_proj.weight": [19968, 6656],
    "layers.N.mlp.up_proj.weight": [19968, 6656],
    "layers.N.mlp_conv.base_kernel": [2, 2, 6656],
    "layers.N.mlp_conv.kernel_projection.weight": [1664, 6656],
    "layers.N.post_attention_layernorm.weight": [6656],
    "layers.N.self_attn.k_norm.weight": [128],
    "layers.N.self_attn.k_proj.weight": [1024, 6656],
    "layers.N.self_attn.o_proj.weight": [6656, 4096],
    "layers.N.self_attn.q_norm.weight": [128],
    "layers.N.self_attn.q_proj.weight": [4096, 6656],
    "layers.N.self_attn.v_proj.weight": [1024, 6656],
    "norm.weight": [6656],
}
PUBLIC_CONFIG = {  # the fixture config.json's fields that define the drafter
    "architectures": ["DFlash2DraftModel"],
    "dflash_config": {
        "block_size": 16,
        "conv_group_size": 16,
        "conv_kernel_size": 2,
        "final_logit_softcapping": 20.0,
        "mask_token_id": 201818,
        "output_multiplier": 0.19611613513818404,
        "selector_rank": 256,
        "selector_top_k": 16,
        "target_layer_ids": [1, 13, 25, 37, 49],
    },
    "head_dim": 128,
    "hidden_size": 6656,
    "intermediate_size": 19968,
    "layer_types": ["sliding_attention"] * 5,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 52,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "sliding_window": 2048,
    "use_sliding_window": True,
    "vocab_size": 202048,
}


def _config(arch: str, top_k: int = 5, layout: dict | None = None) -> DrafterConfig:
    cfg = DrafterConfig.from_target_config(
        tiny_target_config(),
        **(layout or {}),
        num_layers=2,
        block_size=BLOCK,
        mask_token_id=96,
        target_layer_ids=[1, 4],
        arch=arch,
    )
    if arch == "dflash2":
        cfg.selector_rank, cfg.selector_top_k = 8, top_k
    return cfg


def _head(seed: int = 0) -> TargetHead:
    g = torch.Generator().manual_seed(seed)
    return TargetHead(torch.randn(97, 32, generator=g), torch.randn(97, 32, generator=g))


def _batch(seed: int = 0, anchors: int = 18):
    g = torch.Generator().manual_seed(seed)
    docs = [
        (
            torch.randint(0, 96, (n,), generator=g),
            torch.rand(n, generator=g) > 0.2,
            torch.randn(n, 64, generator=g),
            i,
        )
        for i, n in enumerate([11, 6, 17, 9])
    ]
    packed = pack_samples(docs, context_tokens=48)
    return build_draft_batch(
        packed,
        block_size=BLOCK,
        num_anchors=anchors,
        max_anchors_per_doc=4,
        mask_token_id=96,
        gamma=7.0,
        generator=g,
    )


def _trained_like(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter moved off its init (DFlash2's convolutions and selector included)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _pair(seed: int = 0, top_k: int = 5, layout: dict | None = None) -> tuple[DFlashDrafter, DFlashDrafter]:
    """A DFlash drafter with trained-like weights and a new DFlash2 drafter holding the same weights."""
    torch.manual_seed(seed)
    v1 = _trained_like(
        DFlashDrafter(_config("dflash", layout=layout), _head(), attention_backend="sdpa"), seed
    )
    v2 = DFlashDrafter(_config("dflash2", top_k, layout), _head(), attention_backend="sdpa")
    missing, unexpected = v2.load_state_dict(v1.state_dict(), strict=False)
    assert not unexpected and missing and all("conv" in k or "candidate_selector" in k for k in missing)
    return v1, v2


# ------------------------------------------------------------------------------------ the exact start


def test_a_new_dflash2_drafter_of_a_seed_has_the_dflash_weights_of_that_seed():
    torch.manual_seed(3)
    v1 = DFlashDrafter(_config("dflash"))
    torch.manual_seed(3)
    v2 = DFlashDrafter(_config("dflash2"))
    s1, s2 = v1.state_dict(), v2.state_dict()
    assert set(s1) < set(s2)
    for name, tensor in s1.items():
        assert torch.equal(tensor, s2[name]), name
    conv = v2.layers[0].attention_conv
    assert torch.equal(conv.base_kernel[:, 0], torch.ones_like(conv.base_kernel[:, 0]))
    assert not conv.base_kernel[:, 1:].any() and not conv.kernel_projection.weight.any()
    assert not v2.candidate_selector.successor_codebook.any()
    assert v2.candidate_selector.predecessor_codebook.std() > 0


def test_a_zero_initialised_dflash2_equals_dflash_on_the_same_batch():
    """Identity convolutions and a zero successor codebook: the same hidden states and logits, the same
    draft loss (selector weight 0) with the same gradients, and the selector's greedy path is the argmax."""
    v1, v2 = _pair()
    batch = _batch()
    out1, out2 = v1(batch), v2(batch)
    assert torch.equal(out1, out2)
    r1 = draft_loss(out1, batch, v1.lm_head_weight, chunk_tokens=16)
    r2 = draft_loss(
        out2,
        batch,
        v2.lm_head_weight,
        chunk_tokens=16,
        selector=SelectorTerm(selector=v2.candidate_selector, alpha=0.0),
    )
    assert torch.equal(r1.loss_sum, r2.loss_sum) and torch.equal(r1.correct, r2.correct)
    r1.loss_sum.backward()
    r2.loss_sum.backward()
    grads2 = dict(v2.named_parameters())
    for name, p in v1.named_parameters():
        torch.testing.assert_close(p.grad, grads2[name].grad, atol=1e-7, rtol=1e-6, msg=name)
    # the selector stays in the graph during its warm-up (DDP sees every parameter used)
    assert v2.candidate_selector.successor_codebook.grad is not None
    logits = v2.logits(out2[:, 1:])
    hidden = out2[:, 1:]
    for b in range(3):
        anchor = int(batch.block_input_ids[b, 0])
        path, _ = v2.candidate_selector.walk(hidden[b], logits[b], anchor, None)
        assert torch.equal(path, logits[b].argmax(-1))


# ----------------------------------------------------------------------------------- the convolution


def _conv_reference(
    conv: GroupedDynamicCausalConv, x: torch.Tensor, dyn: torch.Tensor, which: int
) -> torch.Tensor:
    """out[a, t, c] = sum_j (base[which, j, c] + dyn[a, t, which, j, c // group]) * x[a, t - j, c], with
    x[a, t - j] = 0 when t - j < 0 (before the block's first position): written one element at a time."""
    a, b, h = x.shape
    out = torch.zeros_like(x)
    for i in range(a):
        for t in range(b):
            for c in range(h):
                for j in range(conv.kernel_size):
                    if t - j >= 0:
                        w = conv.base_kernel[which, j, c] + dyn[i, t, which, j, c // conv.group_size]
                        out[i, t, c] += w * x[i, t - j, c]
    return out


def test_the_convolution_equals_its_definition_within_each_block():
    torch.manual_seed(0)
    conv = _trained_like(GroupedDynamicCausalConv(32, 2, 16), 1)
    x, y = torch.randn(3, BLOCK, 32), torch.randn(3, BLOCK, 32)
    with torch.no_grad():
        before, dyn = conv.prepare(x)
        after = conv.finish(y, dyn)
        want_dyn = conv.kernel_projection(x).view(3, BLOCK, 2, 2, 2)
        torch.testing.assert_close(dyn, want_dyn)
        torch.testing.assert_close(before, _conv_reference(conv, x, dyn, 0), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(after, _conv_reference(conv, y, dyn, 1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize(
    "layout", [None, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3}]
)
def test_the_packed_training_forward_never_reads_across_a_block_boundary(backend, layout):
    """A trained-like DFlash2 drafter (all full layers, or a sliding one first): each block of the packed
    training step (N blocks laid end to end) equals the same block run alone in the inference form over
    its own context. A convolution that read the previous block's last position into a block's first
    position would differ here."""
    _, v2 = _pair(1, layout=layout)
    _trained_like(v2, 2)
    v2.attention_backend = backend
    batch = _batch(1)
    with torch.no_grad():
        out = v2(batch)
        checked = 0
        for b in batch.anchor_valid.nonzero().squeeze(1).tolist():
            a = int(batch.anchors[b])
            start = a - int(batch.positions[a])
            keys, values = v2.context_keys_values(batch.hidden[start:a], batch.positions[start:a])
            alone = v2.draft_hidden(
                batch.block_input_ids[b][None],
                batch.block_positions[b, :1],
                [k[None] for k in keys] if a > start else None,
                [v[None] for v in values] if a > start else None,
            )[0]
            torch.testing.assert_close(out[b], alone, atol=2e-5, rtol=1e-4)
            checked += 1
        assert checked > 5


def test_is_causal_false_lets_sliding_layers_see_the_whole_block(tmp_path):
    """The public DFlash2 config's ``is_causal: false``: its sliding layers see every key of the block (the
    window still cuts the context). Read from the config, kept by the export, and the packed training form
    still equals the per-block inference form; the flag changes the output."""
    from dflash.common.drafter.dflash import visible

    assert drafter_config_from_export({**PUBLIC_CONFIG, "is_causal": False}).block_causal is False
    assert drafter_config_from_export(PUBLIC_CONFIG).block_causal is True
    a, window = torch.tensor(10), 3
    q, k_block, k_old = torch.tensor(10), torch.tensor(13), torch.tensor(6)  # anchor's own position, offset 3
    yes, no = torch.tensor(True), torch.tensor(False)
    assert not visible(q, k_block, a, yes, window) and visible(q, k_block, a, yes, window, block_causal=False)
    assert not visible(q, k_old, a, no, window, block_causal=False)  # outside the window: still hidden
    layout = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3}
    _, causal = _pair(1, layout=layout)
    _trained_like(causal, 2)
    cfg = _config("dflash2", layout=layout)
    cfg.block_causal = False
    open_block = DFlashDrafter(cfg, _head(), attention_backend="sdpa")
    open_block.load_state_dict(causal.state_dict())
    assert open_block.spec.block_causal is False
    batch = _batch(1)
    with torch.no_grad():
        out = open_block(batch)
        assert (out - causal(batch)).abs().max() > 1e-3
        b = int(batch.anchor_valid.nonzero()[-1])
        a = int(batch.anchors[b])
        start = a - int(batch.positions[a])
        keys, values = open_block.context_keys_values(batch.hidden[start:a], batch.positions[start:a])
        alone = open_block.draft_hidden(
            batch.block_input_ids[b][None],
            batch.block_positions[b, :1],
            [k[None] for k in keys],
            [v[None] for v in values],
        )[0]
        torch.testing.assert_close(out[b], alone, atol=2e-5, rtol=1e-4)
    exported = export_drafter(open_block.state_dict(), cfg, tmp_path / "x")
    assert json.loads((exported / "config.json").read_text())["is_causal"] is False
    assert read_export_config(exported).block_causal is False


# -------------------------------------------------------------------------------------- the selector


def _selector(seed: int = 0) -> CandidateSelector:
    torch.manual_seed(seed)
    sel = CandidateSelector(97, 32, rank=8, top_k=5)
    sel.reset_parameters()
    return _trained_like(sel, seed + 1)


def test_selector_scores_walk_and_loss_equal_a_dense_reference():
    """S_t(a, b) = U_t(b) + <P[a] * W h_t, S[b]> over each position's top-k; greedy walks from the anchor
    on the token it picked; the loss is CE over the strict top-k with the true predecessor (rows whose
    label is not a candidate contribute nothing). Swapping the codebooks or the predecessor breaks each."""
    sel = _selector()
    head = _head().lm_head_weight
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(12, 32, generator=g)
    logits = hidden @ head.t()
    P, S, W = sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight

    def dense(h, a):  # score of every vocabulary token after a
        return h @ head.t() + ((P[a] * (W @ h)) * S).sum(-1)

    with torch.no_grad():
        path, probs = sel.walk(hidden[:6], logits[:6], anchor=7, sampling=None)
        prev = 7
        for t in range(6):
            cand = logits[t].topk(5).indices
            want = cand[dense(hidden[t], prev)[cand].argmax()]
            assert int(path[t]) == int(want)
            prev = int(want)
        assert probs is None

    labels = logits.topk(5, dim=-1).indices[:, 2].clone()
    labels[3] = logits[3].argmin()  # not a candidate: no selector loss from this row
    preds = torch.randint(0, 97, (12,), generator=g)
    weights = torch.rand(12, generator=g)
    from dflash.common.drafter.loss import selector_loss

    got = selector_loss(hidden, head, labels, preds, weights, sel, chunk_tokens=5)
    want = torch.zeros(())
    for m in range(12):
        cand = logits[m].topk(5).indices
        if m == 3:
            assert labels[m] not in cand
            continue
        s = dense(hidden[m], int(preds[m]))[cand]
        want = want + weights[m] * (torch.logsumexp(s, 0) - s[(cand == labels[m]).nonzero()[0, 0]])
    torch.testing.assert_close(got.loss_sum, want, atol=1e-5, rtol=1e-5)
    assert int(got.covered) == 11 and int(got.valid) == 12


def test_the_draft_losss_lm_head_pass_gives_the_candidates():
    """One chunked lm_head pass: with top_k the same loss, gradient and argmax as without, plus each row's
    top-k ids (what the selector would otherwise recompute in a second pass)."""
    from dflash.common.drafter.loss import chunked_linear_cross_entropy, top_k_ids

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 32, generator=g, requires_grad=True)
    head, labels, weights = (
        _head().lm_head_weight,
        torch.randint(0, 97, (13,), generator=g),
        torch.rand(13, generator=g),
    )
    loss, preds, top = chunked_linear_cross_entropy(hidden, head, labels, weights, chunk_tokens=4, top_k=5)
    (grad,) = torch.autograd.grad(loss, hidden)
    loss0, preds0 = chunked_linear_cross_entropy(hidden, head, labels, weights, chunk_tokens=4)
    (grad0,) = torch.autograd.grad(loss0, hidden)
    assert torch.equal(loss, loss0) and torch.equal(preds, preds0) and torch.equal(grad, grad0)
    assert torch.equal(top, (hidden @ head.t()).topk(5, dim=-1).indices)
    assert torch.equal(top, top_k_ids(hidden.detach(), head, 5, chunk_tokens=3))


def test_a_sampled_walk_returns_the_distribution_it_drew_from():
    sel = _selector(2)
    head = _head().lm_head_weight
    hidden = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    logits = hidden @ head.t()
    sampling = Sampling(temperature=0.8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        path, probs = sel.walk(hidden, logits, anchor=3, sampling=sampling)
    assert probs.shape == (5, 97)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))
    for t in range(5):
        support = set(probs[t].nonzero().squeeze(1).tolist())
        assert support <= set(logits[t].topk(5).indices.tolist()) and int(path[t]) in support


def test_the_selector_weight_waits_then_ramps():
    w = [selector_weight(s, 1000, 2.0, 0.1, 0.2) for s in (0, 99, 100, 200, 300, 999)]
    assert w == [0.0, 0.0, 0.0, 1.0, 2.0, 2.0]
    assert selector_weight(0, 1000, 1.0, 0.0, 0.0) == 1.0


def test_a_dflash2_selector_loss_trains_the_selector_and_the_draft():
    v1, v2 = _pair(4, top_k=97)  # every label a candidate: every row's predecessor counts
    _trained_like(v2.candidate_selector, 9)  # the predecessor now matters; the draft is still v1's
    batch = _batch(4)
    r = draft_loss(
        v2(batch), batch, v2.lm_head_weight, selector=SelectorTerm(selector=v2.candidate_selector, alpha=1.0)
    )
    base = draft_loss(v1(batch), batch, v1.lm_head_weight)
    assert r.selector is not None and 0 < int(r.selector.covered) <= int(r.selector.valid)
    torch.testing.assert_close(r.loss_sum, base.loss_sum + r.selector.loss_sum, atol=1e-5, rtol=1e-6)
    # teacher forcing: block position 1 follows the anchor, position k the label of position k - 1
    from dflash.common.drafter.loss import selector_loss

    n, b = batch.labels.shape
    preds = torch.tensor(
        [
            [int(batch.block_input_ids[i, 0]) if k == 1 else int(batch.labels[i, k - 1]) for k in range(1, b)]
            for i in range(n)
        ]
    )
    with torch.no_grad():
        out = v2(batch)[:, 1:].reshape(-1, 32)
        want = selector_loss(
            out,
            v2.lm_head_weight,
            batch.labels[:, 1:].reshape(-1),
            preds.reshape(-1),
            batch.label_weights[:, 1:].reshape(-1),
            v2.candidate_selector,
        )
    torch.testing.assert_close(r.selector.loss_sum.detach(), want.loss_sum, atol=1e-5, rtol=1e-6)
    r.loss_sum.backward()
    assert v2.candidate_selector.successor_codebook.grad.abs().sum() > 0
    assert v2.layers[0].attention_conv.kernel_projection.weight.grad.abs().sum() > 0


def test_a_compiled_dflash2_step_compiles_once_in_one_graph():
    """Forward, draft loss with the selector term and backward, compiled fullgraph over steps of the same
    shapes: one compile, no graph break, no recompile; equal to eager."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    _, v2 = _pair(11)
    _trained_like(v2, 12)
    counter = CompileCounterWithBackend("aot_eager")
    term = SelectorTerm(selector=v2.candidate_selector, alpha=0.5)

    def step(batch):
        return draft_loss(v2(batch), batch, v2.lm_head_weight, chunk_tokens=16, selector=term).loss_sum

    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=False)
    for seed in range(2):
        batch = _batch(seed + 20)
        loss = compiled(batch)
        loss.backward()
        torch.testing.assert_close(loss, step(batch), atol=1e-4, rtol=1e-5)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times"


# ----------------------------------------------------------------------------------- config and export


def test_train_config_takes_the_architecture_and_its_recipe_defaults():
    v2 = TrainConfig.from_flat(spool="s", target="t", drafter_arch="dflash2")
    assert (v2.drafter.block_size, v2.step.num_anchors) == (8, 512)
    v1 = TrainConfig.from_flat(spool="s", target="t")
    assert (v1.drafter.drafter_arch, v1.drafter.block_size, v1.step.num_anchors) == ("dflash", 16, 256)
    given = TrainConfig.from_flat(
        spool="s", target="t", drafter_arch="dflash2", block_size=16, num_anchors=64
    )
    assert (given.drafter.block_size, given.step.num_anchors) == (16, 64)
    with pytest.raises(ValueError, match="drafter_arch"):
        TrainConfig.from_flat(spool="s", target="t", drafter_arch="dflash3")


def test_the_public_dflash2_config_builds_its_tensors_names_and_shapes():
    """The public fixture's config.json read as a DFlash2 drafter (on the meta device) has exactly the
    public checkpoint's tensor names and shapes."""
    cfg = drafter_config_from_export(PUBLIC_CONFIG)
    assert cfg.arch == "dflash2" and cfg.final_logit_softcapping == 20.0 and cfg.block_size == 16
    shapes = {}
    for name, shape in expected_shapes(cfg).items():
        shapes.setdefault(re.sub(r"^layers\.\d+\.", "layers.N.", name), list(shape))
    assert shapes == PUBLIC_SHAPES


def test_dflash2_export_writes_the_public_format_and_loads_back(tmp_path, monkeypatch):
    _, v2 = _pair(6)
    _trained_like(v2, 7)
    v2.config.output_multiplier, v2.config.final_logit_softcapping = 0.5, 20.0
    out = export_drafter(v2.state_dict(), v2.config, tmp_path / "export", dtype=torch.float32)
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert raw["auto_map"] == {"AutoModel": "dflash.DFlash2DraftModel"}
    assert set(raw["dflash_config"]) == PUBLIC_DFLASH_CONFIG_KEYS
    assert "is_causal" not in raw  # it would override the per-layer rule (sliding causal in the block)
    report = check_folder(out)
    assert report.ok, report.render()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = {re.sub(r"^layers\.\d+\.", "layers.N.", k) for k in f.keys()}
    assert names == set(PUBLIC_SHAPES)
    assert read_export_config(out) == v2.config
    # AutoModel(trust_remote_code) builds the export's own DFlash2DraftModel with the same weights, whose
    # spec_generate (the public call) decodes the target's greedy tokens
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    served = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(served).__name__ == "DFlash2DraftModel"
    state = served.state_dict()
    assert set(state) == set(v2.state_dict()) and all(
        torch.equal(state[k], t) for k, t in v2.state_dict().items()
    )
    target = _tiny_target()
    prompt = torch.tensor([[5, 17, 33, 60]])
    ids = served.spec_generate(
        target=target, input_ids=prompt, max_new_tokens=12, stop_token_ids=None, temperature=0.0
    )
    want = target.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert ids.tolist() == want.tolist()
    served.set_target_head(v2.target_head)
    batch = _batch(2)
    with torch.no_grad():
        assert torch.equal(served(batch), v2(batch))
        hidden = torch.randn(3, 32)
        raw = hidden @ v2.lm_head_weight.t()
        torch.testing.assert_close(served.logits(hidden), 20.0 * torch.tanh(0.5 * raw / 20.0))


def test_a_wrong_dflash2_weight_name_is_refused(tmp_path):
    from dflash.common.drafter.hf_format import ExportError

    _, v2 = _pair(8)
    state = v2.state_dict()
    state["layers.0.attn_conv.base_kernel"] = state.pop("layers.0.attention_conv.base_kernel")
    with pytest.raises(ExportError, match="attention_conv.base_kernel"):
        export_drafter(state, v2.config, tmp_path / "x")


# ------------------------------------------------------------------------------------------ decoding


def _tiny_target() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(tiny_target_config()).eval()


@pytest.mark.parametrize("seed", [0, 1])
def test_dflash2_greedy_decoding_equals_the_targets_greedy(seed):
    """A trained-like DFlash2 drafter (its selector re-ranks): speculative greedy decoding emits exactly
    the target's greedy tokens."""
    target = _tiny_target()
    _, v2 = _pair(seed)
    _trained_like(v2, seed + 20)
    v2.attach_target(target)
    v2.eval()
    runner = TargetRunner(target, v2.spec.target_layer_ids)
    prompt = torch.tensor([5, 17, 33, 60, 2, 71])
    try:
        want = greedy_generate(runner, prompt, max_new_tokens=24).tokens
        got = speculative_generate(runner, DrafterProposer(v2), prompt, max_new_tokens=24)
    finally:
        runner.close()
    assert got.tokens == want and len(got.steps) > 1


def test_dflash2_sampling_decodes_with_the_selectors_distribution():
    target = _tiny_target()
    _, v2 = _pair(3)
    _trained_like(v2, 30)
    v2.attach_target(target)
    runner = TargetRunner(target, v2.spec.target_layer_ids)
    try:
        for draft in ("greedy", "sample"):
            sampling = Sampling(temperature=0.7, draft=draft, generator=torch.Generator().manual_seed(0))
            gen = speculative_generate(
                runner, DrafterProposer(v2), torch.tensor([5, 17, 33]), max_new_tokens=16, sampling=sampling
            )
            assert len(gen.tokens) == 16 and all(0 <= t < 97 for t in gen.tokens)
    finally:
        runner.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_dflash2_drafter_trains_alike_on_compiled_flex_and_sdpa_on_cuda():
    """The DFlash2 training step on CUDA (a sliding + a full layer): compiled layers with flex_attention
    (what dflash-consume runs) equal eager SDPA in fp32, outputs and every gradient (selector loss on)."""
    from dflash.consumer.step import compile_drafter

    layout = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}
    results = {}
    for backend in ("sdpa", "flex"):
        _, drafter = _pair(5, layout=layout)
        _trained_like(drafter, 6)
        drafter.attention_backend = backend
        drafter = drafter.cuda()
        if backend == "flex":
            compile_drafter(drafter, "inductor")
        batch = _batch(5).to("cuda")
        out = drafter(batch, drafter.build_mask(batch))
        term = SelectorTerm(selector=drafter.candidate_selector, alpha=1.0)
        draft_loss(out, batch, drafter.lm_head_weight, selector=term).loss_sum.backward()
        results[backend] = [out.detach()] + [p.grad.detach() for p in drafter.parameters()]
    for got, want in zip(results["flex"], results["sdpa"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------- the whole path, CLIs


@pytest.mark.pipeline
def test_dflash_consume_trains_a_dflash2_drafter_that_exports_and_decodes_losslessly(tmp_path, tiny_target):
    """dflash-consume --drafter-arch dflash2 on a synthetic spool (its defaults: block 8), the selector's
    metrics in the log records; dflash-export writes a DFlash2DraftModel that dflash-export --check
    passes; dflash-eval --baseline decodes with it, every prompt equal to the target's greedy output."""
    from pipeline_helpers import BIN, consume_cmd, run, write_synthetic_spool

    from dflash.common.metrics import read_metrics
    from dflash.tools.demo.assets import demo_dataset_path

    spool = write_synthetic_spool(
        tmp_path / "spool",
        hidden_size=256,
        layer_ids=[1, 2, 3, 4, 5],
        num_shards=3,
        samples_per_shard=8,
        tokens_per_sample=32,
        vocab=4096,
        seed=0,
    )
    ckpt, run_dir = tmp_path / "ckpt", tmp_path / "run"
    cmd = consume_cmd(
        spool.root, tiny_target, "--drafter-arch", "dflash2", "--max-steps", "3", "--log-every", "1"
    )
    cmd += ["--context-tokens", "256", "--checkpoint", str(ckpt), "--run", "d2", "--run-dir", str(run_dir)]
    done = run(cmd, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    recs = [r for r in read_metrics(run_dir / "metrics" / "consumer-0.jsonl") if "selector_coverage" in r]
    assert recs and all(0.0 <= r["selector_coverage"] <= 1.0 for r in recs)
    assert len(recs[-1]["acc_per_pos"]) == 8  # dflash2's default block
    out = tmp_path / "export"
    done = run([str(BIN / "dflash-export"), str(ckpt), str(out), "--run", "d2"], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "DFlash2DraftModel" in done.stderr
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    done = run([str(BIN / "dflash-export"), "--check", str(out)], timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    done = run(
        [
            str(BIN / "dflash-eval"),
            *("--target", str(tiny_target), "--drafter", str(out), "--dataset", str(demo_dataset_path())),
            *("--num-prompts", "1", "--max-new-tokens", "24", "--baseline", "--device", "cpu"),
        ],
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"prompts differing from greedy\s+0\b", done.stdout), done.stdout
