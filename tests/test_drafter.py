"""DFlash drafter: layer choice, config derivation, parameter names, target head loading, forward parity with
a per-block inference-style reference built from transformers' Qwen3 pieces, and no recompiles."""

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from draft_reference import one_thread  # noqa: F401  (autouse fixture)
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from dflash.common.drafter.batch import build_draft_batch, pack_samples
from dflash.common.drafter.config import DrafterConfig, choose_mask_token_id
from dflash.common.drafter.layers import check_layer_ids, default_target_layer_ids
from dflash.common.drafter.model import DFlashDrafter, TargetHead
from dflash.common.target.data import DataConfig
from dflash.common.target.head import load_target_head
from dflash.consumer.config import TrainConfig
from dflash.producer.config import ProducerConfig

# eager flex_attention on CPU (the cross-check backend) warns that it is unfused; expected here
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def tiny_target_config(**kw) -> Qwen3Config:
    base = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # != hidden/heads: catches code that derives it
        intermediate_size=64,
        vocab_size=97,
        num_hidden_layers=8,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        rms_norm_eps=1e-6,
        pad_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return Qwen3Config(**base)


# ---------------------------------------------------------------------------------------------- layers


def test_default_target_layer_ids_match_public_rule():
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_target_layer_ids(52) == [1, 13, 25, 37, 49]  # the public dflash2 fixture's list
    assert default_target_layer_ids(28) == [1, 7, 13, 19, 25]
    assert default_target_layer_ids(8, 3) == [1, 3, 5]
    assert default_target_layer_ids(36, 1) == [18]
    ids = default_target_layer_ids(64, 5)
    assert ids[0] == 1 and ids[-1] == 61
    with pytest.raises(ValueError, match="num_target_layers"):
        default_target_layer_ids(0)
    with pytest.raises(ValueError, match="k must"):
        default_target_layer_ids(36, 0)


def test_default_target_layer_ids_are_distinct_on_small_targets():
    """Where the public rule would repeat a layer (L < K + 3), K distinct layers from 1 to L-1, from 0 when
    L == K, and every layer when the target has fewer than K; always sorted, distinct, in range."""
    assert default_target_layer_ids(6) == [1, 2, 3, 4, 5]  # the public rule: [1, 2, 2, 2, 3]
    assert default_target_layer_ids(7) == [1, 2, 4, 5, 6]
    assert default_target_layer_ids(5) == [0, 1, 2, 3, 4]
    assert default_target_layer_ids(3) == [0, 1, 2]
    assert default_target_layer_ids(8) == [1, 2, 3, 4, 5]  # L = K + 3: the public rule, already distinct
    for layers in range(1, 80):
        for k in range(1, 9):
            ids = default_target_layer_ids(layers, k)
            assert ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < layers, (layers, k, ids)
            assert len(ids) == (1 if k == 1 else min(k, layers)), (layers, k, ids)


@pytest.mark.parametrize(
    "ids,num_layers,match",
    [
        ([3, 1, 1], 8, r"--layer-ids \[3, 1, 1\]: layer ids must be sorted and distinct, e\.g\. \[1, 3\]$"),
        ([1, 2, 2], 8, r"sorted and distinct"),
        ([1, 8], 8, r"--layer-ids \[1, 8\]: outside 0\.\.7 \(the target has 8 layers\)$"),
        ([-1, 2], None, r">= 0"),
        ([], 8, r"at least one"),
    ],
)
def test_layer_ids_are_checked_in_one_line(ids, num_layers, match):
    with pytest.raises(ValueError, match=match) as err:
        check_layer_ids(ids, num_layers)
    assert "\n" not in str(err.value)
    assert check_layer_ids([1, 9, 17], 36) == [1, 9, 17]


def test_the_cli_configs_refuse_repeated_layer_ids():
    """Producer (--layer-ids) and consumer (--target-layer-ids) configs: one line each."""
    with pytest.raises(ValueError, match=r"--layer-ids \[3, 1, 1\]: layer ids must be sorted and distinct"):
        ProducerConfig(model="m", data=DataConfig(dataset="d"), layer_ids=[3, 1, 1])
    with pytest.raises(
        ValueError, match=r"--target-layer-ids \[2, 2\]: layer ids must be sorted and distinct"
    ):
        TrainConfig.from_flat(spool="s", target="t", target_layer_ids=[2, 2])


def test_drafter_config_uses_the_producers_layer_rule():
    """The drafter's default context layers are the producer's (one rule, dflash.common.drafter.layers)."""
    from transformers import Qwen3Config

    cfg = DrafterConfig.from_target_config(
        Qwen3Config(
            num_hidden_layers=28,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=100,
        ),
        mask_token_id=0,
    )
    assert cfg.target_layer_ids == default_target_layer_ids(28)


# ---------------------------------------------------------------------------------------------- config


def test_from_target_config_qwen3():
    cfg = DrafterConfig.from_target_config(tiny_target_config(), num_layers=2, block_size=8, mask_token_id=96)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 4, 2, 16)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == (64, 97, 256)
    assert cfg.rope_theta == 5000.0 and cfg.rope_scaling is None
    assert cfg.target_layer_ids == [1, 2, 3, 4, 5] and cfg.num_target_layers == 8
    assert (cfg.num_layers, cfg.block_size, cfg.mask_token_id) == (2, 8, 96)
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg


def test_from_target_config_llama_style_and_rope_scaling():
    # a transformers-4 style config without head_dim and with rope_theta + rope_scaling
    llama = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=None,
        intermediate_size=128,
        vocab_size=50,
        num_hidden_layers=12,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        pad_token_id=None,
        eos_token_id=[2, 3],
        bos_token_id=1,
    )
    cfg = DrafterConfig.from_target_config(llama, target_layer_ids=[2, 5])
    assert cfg.head_dim == 8 and cfg.num_key_value_heads == 8 and cfg.rope_theta == 500000.0
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.target_layer_ids == [2, 5]
    assert cfg.mask_token_id == 49  # no tokenizer, no distinct pad -> vocab_size - 1
    yarn = tiny_target_config(
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": 1e6,
            "original_max_position_embeddings": 64,
        }
    )
    cfg = DrafterConfig.from_target_config(yarn, mask_token_id=5)
    assert cfg.rope_parameters == {
        "rope_type": "yarn",
        "factor": 4.0,
        "rope_theta": 1e6,
        "original_max_position_embeddings": 64,
    }


@pytest.mark.parametrize(
    "change,match",
    [
        ({"num_key_value_heads": 3}, "multiple"),
        ({"head_dim": 15}, "even"),
        ({"block_size": 1}, "block_size"),
        ({"target_layer_ids": [1, 9]}, "outside"),
        ({"target_layer_ids": []}, "at least one"),
        ({"target_layer_ids": [3, 1]}, "sorted and distinct"),
        ({"mask_token_id": 97}, "mask_token_id"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"rope_scaling": {"factor": 2.0}}, "rope_type"),
    ],
)
def test_config_validation(change, match):
    cfg = DrafterConfig.from_target_config(tiny_target_config(), mask_token_id=5).to_dict()
    cfg.update(change)
    with pytest.raises(ValueError, match=match):
        DrafterConfig(**cfg)


class FakeTokenizer:
    def __init__(self, n, *, mask=None, pad=None, eos=1, bos=None, extra=None):
        self.n, self.mask_token_id, self.pad_token_id, self.eos_token_id, self.bos_token_id = (
            n,
            mask,
            pad,
            eos,
            bos,
        )
        self.vocab = {f"t{i}": i for i in range(n)} | (extra or {})

    def __len__(self):
        return self.n

    def get_vocab(self):
        return self.vocab


def test_choose_mask_token_id_rules():
    assert choose_mask_token_id(FakeTokenizer(90, mask=7, pad=3), vocab_size=97) == 7
    assert choose_mask_token_id(FakeTokenizer(90, pad=3, extra={"<|MASK|>": 88}), vocab_size=97) == 88
    assert choose_mask_token_id(FakeTokenizer(90, pad=3), vocab_size=97) == 90  # first unused embedding row
    assert choose_mask_token_id(FakeTokenizer(97, pad=3), vocab_size=97) == 3  # pad distinct from eos
    assert choose_mask_token_id(FakeTokenizer(97, pad=1, eos=1), vocab_size=97) == 96  # last resort
    cfg = DrafterConfig.from_target_config(tiny_target_config(), tokenizer=FakeTokenizer(90, pad=3))
    assert cfg.mask_token_id == 90
    # no tokenizer: a mask id the target config declares, else its distinct pad token
    assert DrafterConfig.from_target_config(tiny_target_config(mask_token_id=7)).mask_token_id == 7
    assert DrafterConfig.from_target_config(tiny_target_config()).mask_token_id == 0


def test_rotary_matches_transformers_for_exported_config():
    """The drafter's rotary equals what the public inference code computes from the exported config."""
    for rope in (
        {"rope_type": "default", "rope_theta": 5000.0},
        {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "original_max_position_embeddings": 64},
    ):
        cfg = DrafterConfig.from_target_config(
            tiny_target_config(rope_parameters=rope), num_layers=1, mask_token_id=5
        )
        mine = DFlashDrafter(cfg).rotary_emb
        hf = Qwen3RotaryEmbedding(cfg.to_qwen3_config())
        pos = torch.tensor([0, 3, 17, 200])
        cos, sin = mine(pos, torch.float32)
        hf_cos, hf_sin = hf(torch.zeros(1), pos[None])
        torch.testing.assert_close(cos, hf_cos[0]), torch.testing.assert_close(sin, hf_sin[0])


def test_qwen3_config_for_export():
    cfg = DrafterConfig.from_target_config(
        tiny_target_config(), num_layers=3, block_size=16, mask_token_id=96
    )
    q = cfg.to_qwen3_config().to_dict()
    assert q["num_hidden_layers"] == 3 and q["num_target_layers"] == 8 and q["block_size"] == 16
    assert q["dflash_config"] == {"target_layer_ids": [1, 2, 3, 4, 5], "mask_token_id": 96}
    assert q["layer_types"] == ["full_attention"] * 3 and q["head_dim"] == 16
    assert json.loads(json.dumps(q))["rope_parameters"]["rope_theta"] == 5000.0


# ---------------------------------------------------------------------------------------------- names


def test_state_dict_names_match_public_model_and_exclude_target_head():
    cfg = DrafterConfig.from_target_config(tiny_target_config(), num_layers=2, mask_token_id=5)
    head = TargetHead(torch.randn(97, 32), torch.randn(97, 32))
    d = DFlashDrafter(cfg, head)
    per_layer = [
        "input_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    want = {f"layers.{i}.{n}" for i in range(2) for n in per_layer} | {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
    }
    assert set(d.state_dict()) == want
    assert {n for n, _ in d.named_parameters()} == want
    assert {n for n, _ in d.named_buffers()} == {"rotary_emb.inv_freq"}  # small, non-persistent
    assert d.fc.weight.shape == (32, 5 * 32)
    assert d.layers[0].self_attn.q_proj.weight.shape == (4 * 16, 32)
    assert d.layers[0].self_attn.k_proj.weight.shape == (2 * 16, 32)
    assert d.target_head is head
    with pytest.raises(RuntimeError, match="target head"):
        _ = DFlashDrafter(cfg).target_head


# ---------------------------------------------------------------------------------------------- target head


class RecordingSafeOpen:
    """Wraps safetensors.safe_open to record which tensors get read."""

    def __init__(self, real):
        self.real, self.read = real, []

    def __call__(self, *args, **kwargs):
        handle = self.real(*args, **kwargs)
        outer = self

        class Proxy:
            def __enter__(self):
                self.f = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_tensor(self, name):
                outer.read.append(name)
                return self.f.get_tensor(name)

        return Proxy()


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("sharded", [False, True])
def test_load_target_head_reads_only_embed_and_lm_head(tmp_path, monkeypatch, tied, sharded):
    import safetensors

    from dflash.common.target import head as head_mod

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_target_config(tie_word_embeddings=tied, num_hidden_layers=2))
    model.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    recorder = RecordingSafeOpen(safetensors.safe_open)
    monkeypatch.setattr(head_mod, "safe_open", recorder)  # the name head.py reads with
    head = load_target_head(tmp_path, dtype=torch.float32)
    assert head.tied == tied
    assert sorted(recorder.read) == sorted(
        ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
    )
    torch.testing.assert_close(head.embed_weight, model.model.embed_tokens.weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(head.lm_head_weight, model.lm_head.weight.detach(), rtol=0, atol=0)
    # in-memory model gives the same head
    mem = load_target_head(model, dtype=torch.float32)
    assert mem.tied == tied and torch.equal(mem.lm_head_weight, head.lm_head_weight)
    assert load_target_head(tmp_path).embed_weight.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------- forward


def reference_block(drafter: DFlashDrafter, context_hidden, block_ids, positions):
    """One block drafted the way inference does it (public DFlashDraftModel semantics): context = the target
    features of the document prefix before the anchor, full non-causal attention over [context, block], rotary
    from transformers' Qwen3RotaryEmbedding, norms and MLP from transformers' Qwen3 modules. A sliding layer
    (vLLM's and SGLang's semantics) keeps, for the query at position p, the keys at positions p-W+1..p."""
    cfg = drafter.config
    qcfg = cfg.to_qwen3_config()
    sd = drafter.state_dict()

    def norm(name, dim):
        n = Qwen3RMSNorm(dim, eps=cfg.rms_norm_eps)
        n.weight.data.copy_(sd[name])
        return n

    def lin(name):
        return lambda x: x @ sd[name].t()

    rot = Qwen3RotaryEmbedding(qcfg)
    ctx = norm("hidden_norm.weight", cfg.hidden_size)(lin("fc.weight")(context_hidden))
    x = F.embedding(block_ids, drafter.target_head.embed_weight)
    cos, sin = rot(x, positions[None])
    cos, sin = cos[0], sin[0]
    s, q_len, d = ctx.shape[0], x.shape[0], cfg.head_dim
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        h = norm(p + "input_layernorm.weight", cfg.hidden_size)(x)
        q = norm(p + "self_attn.q_norm.weight", d)(lin(p + "self_attn.q_proj.weight")(h).view(q_len, -1, d))
        kin, vin = torch.cat([ctx, h]), torch.cat([ctx, h])
        k = norm(p + "self_attn.k_norm.weight", d)(
            lin(p + "self_attn.k_proj.weight")(kin).view(s + q_len, -1, d)
        )
        v = lin(p + "self_attn.v_proj.weight")(vin).view(s + q_len, -1, d)
        q = q * cos[s:, None] + rotate_half(q) * sin[s:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
        if cfg.layer_types[i] == "sliding_attention":
            q_pos, k_pos = positions[s:, None], positions[None, :]
            scores = scores.masked_fill(
                ~((k_pos <= q_pos) & (q_pos - k_pos < cfg.sliding_window)), float("-inf")
            )
        att = torch.softmax(scores, dim=-1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(q_len, -1)
        x = x + lin(p + "self_attn.o_proj.weight")(o)
        mlp = Qwen3MLP(qcfg)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mlp, name).weight.data.copy_(sd[p + "mlp." + name + ".weight"])
        x = x + mlp(norm(p + "post_attention_layernorm.weight", cfg.hidden_size)(x))
    return norm("norm.weight", cfg.hidden_size)(x)


def make_drafter_and_batch(seed=0, block=4, num_layers=2, anchors=18, layer_types=None, sliding_window=None):
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_target_config(
        tiny_target_config(),
        num_layers=num_layers,
        block_size=block,
        mask_token_id=96,
        target_layer_ids=[1, 4],
        layer_types=layer_types,
        sliding_window=sliding_window,
    )
    head = TargetHead(torch.randn(97, 32), torch.randn(97, 32))
    drafter = DFlashDrafter(cfg, head, attention_backend="sdpa")
    for prm in drafter.parameters():  # non-trivial norms too
        prm.data.add_(torch.randn_like(prm) * 0.05)
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
    batch = build_draft_batch(
        packed,
        block_size=block,
        num_anchors=anchors,
        max_anchors_per_doc=4,
        mask_token_id=96,
        gamma=7.0,
        generator=g,
    )
    return drafter, batch


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_packed_forward_equals_per_block_inference_reference(backend):
    drafter, batch = make_drafter_and_batch()
    drafter.attention_backend = backend
    assert (~batch.anchor_valid).any()
    with torch.no_grad():
        out = drafter(batch)
        assert out.shape == (18, 4, 32) and torch.isfinite(out).all()
        for b in batch.anchor_valid.nonzero().squeeze(1).tolist():
            a = int(batch.anchors[b])
            start = a - int(batch.positions[a])  # document start in the packed stream
            positions = torch.cat([batch.positions[start:a], batch.block_positions[b]])
            ref = reference_block(drafter, batch.hidden[start:a], batch.block_input_ids[b], positions)
            torch.testing.assert_close(out[b], ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("window", [3, 6])
def test_sliding_layers_forward_equals_the_dense_reference(backend, window):
    """A sliding layer then a full one, documents (up to 17 tokens) longer than the window: every block
    equals the dense per-block reference with the window applied in the sliding layer; the window bites."""
    layout = ["sliding_attention", "full_attention"]
    drafter, batch = make_drafter_and_batch(layer_types=layout, sliding_window=window)
    drafter.attention_backend = backend
    assert [layer.layer_type for layer in drafter.layers] == layout
    full, _ = make_drafter_and_batch()  # same seed: the same weights, all layers full
    with torch.no_grad():
        out = drafter(batch)
        assert (out - full(batch)).abs().max() > 1e-3
        for b in batch.anchor_valid.nonzero().squeeze(1).tolist():
            a = int(batch.anchors[b])
            start = a - int(batch.positions[a])
            positions = torch.cat([batch.positions[start:a], batch.block_positions[b]])
            ref = reference_block(drafter, batch.hidden[start:a], batch.block_input_ids[b], positions)
            torch.testing.assert_close(out[b], ref, atol=2e-5, rtol=1e-4)


def test_forward_is_independent_of_other_documents():
    """Changing another document's tokens/features must not change a block's output (no cross-doc leak), and
    changing the anchor's own target feature must not either (kv < anchor strictly)."""
    drafter, batch = make_drafter_and_batch(seed=1)
    with torch.no_grad():
        out = drafter(batch)
        b = int(batch.anchor_valid.nonzero()[0])
        a = int(batch.anchors[b])
        same_doc = batch.doc_ids == batch.doc_ids[a]
        hidden = batch.hidden.clone()
        hidden[~same_doc] += 3.0
        hidden[a:] += 1.0  # the anchor's own feature and everything after it
        batch.hidden = hidden
        out2 = drafter(batch)
    torch.testing.assert_close(out2[b], out[b], atol=1e-6, rtol=0)


def test_compiled_forward_and_loss_do_not_recompile():
    """A compiled training step (forward + chunked loss + backward) over several steps of the same shapes
    compiles once, with no graph break (fullgraph) and no recompile."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    from dflash.common.drafter.loss import draft_loss

    torch._dynamo.reset()
    drafter, _ = make_drafter_and_batch(seed=2)
    counter = CompileCounterWithBackend("aot_eager")

    def step(batch):
        out = drafter(batch)
        return draft_loss(out, batch, drafter.lm_head_weight, chunk_tokens=16).loss_sum

    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=False)
    for seed in range(3):
        _, batch = make_drafter_and_batch(seed=seed + 10)
        loss = compiled(batch)
        loss.backward()
        want = step(batch)
        torch.testing.assert_close(loss, want, atol=1e-4, rtol=1e-5)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times"


def test_empty_step_gives_zero_loss_and_finite_zero_grads():
    """A rank without data runs an all-padding step: same shapes, zero loss, zero (not NaN) gradients."""
    from dflash.common.drafter.batch import empty_packed
    from dflash.common.drafter.loss import draft_loss

    drafter, _ = make_drafter_and_batch()
    batch = build_draft_batch(
        empty_packed(48, 64, dtype=torch.float32),
        block_size=4,
        num_anchors=18,
        max_anchors_per_doc=4,
        mask_token_id=96,
        gamma=7.0,
        generator=torch.Generator(),
    )
    assert not batch.anchor_valid.any() and batch.sample_index == []
    out = draft_loss(drafter(batch), batch, drafter.lm_head_weight)
    out.loss_sum.backward()
    assert out.loss_sum.item() == 0 and out.weight_sum.item() == 0 and out.num_blocks.item() == 0
    for name, p in drafter.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and (p.grad == 0).all(), name


def test_moving_the_drafter_moves_the_head_but_keeps_its_dtype():
    drafter, batch = make_drafter_and_batch()
    head = drafter.target_head
    drafter.to(torch.float64)
    assert drafter.fc.weight.dtype == torch.float64 and head.embed_weight.dtype == torch.float32
    assert drafter.lm_head_weight is head.lm_head_weight
    drafter.to("meta")
    assert head.embed_weight.is_meta and head.lm_head_weight.is_meta
    moved = batch.to("cpu", hidden_dtype=torch.bfloat16)
    assert moved.hidden.dtype == torch.bfloat16 and moved.labels.dtype == torch.int64 and moved is not batch


def test_autocast_forward_matches_fp32():
    """The trainer runs fp32 master weights under bf16 autocast: q/k/v must meet in one dtype."""
    from dflash.common.drafter.loss import draft_loss

    drafter, batch = make_drafter_and_batch()
    with torch.no_grad():
        ref = drafter(batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = drafter(batch)
            loss = draft_loss(out, batch, drafter.lm_head_weight)
    assert torch.isfinite(out).all() and torch.isfinite(loss.loss_sum)
    assert (out.float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_recompile_count_sees_compiles():
    import torch._dynamo

    from dflash.common.drafter.dflash import recompile_count

    before = recompile_count()
    f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    f(torch.ones(3))
    assert recompile_count() > before


# ------------------------------------------------------------------------------ sliding-window layers


def hybrid_target_config():
    """A Qwen3.5-style hybrid target (Gated DeltaNet 'linear_attention' layers + full attention), small."""
    from transformers import Qwen3_5Config

    return Qwen3_5Config(
        text_config=dict(
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            vocab_size=97,
            num_hidden_layers=8,
        )
    )


def test_layer_type_names_are_the_modules():
    """layers.py repeats the two names (it must import without torch): they equal the drafter module's."""
    from dflash.common.drafter import dflash, layers

    assert (layers.FULL, layers.SLIDING) == (dflash.FULL, dflash.SLIDING)
    assert set(layers.LAYER_TYPE_NAMES.values()) == set(dflash.LAYER_TYPES)


def test_auto_layout_is_the_public_hybrid_drafters():
    """--draft-layer-types auto: a hybrid target gets 4 sliding + 1 full with window 2048 (z-lab
    Qwen3.6-27B-DFlash); any other target all full layers."""
    hybrid = DrafterConfig.from_target_config(hybrid_target_config(), mask_token_id=5)
    assert (
        hybrid.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and hybrid.sliding_window == 2048
    )
    assert hybrid.rope_scaling is None  # the target's partial rotary is its own, not the drafter's
    three = DrafterConfig.from_target_config(
        hybrid_target_config(), num_layers=3, sliding_window=512, mask_token_id=5
    )
    assert (
        three.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
        and three.sliding_window == 512
    )
    plain = DrafterConfig.from_target_config(tiny_target_config(), mask_token_id=5)
    assert plain.layer_types == ["full_attention"] * 5 and plain.sliding_window is None
    explicit = DrafterConfig.from_target_config(
        tiny_target_config(),
        num_layers=2,
        layer_types=["full_attention", "sliding_attention"],
        mask_token_id=5,
    )
    assert explicit.sliding_window == 2048 and explicit.layer_types == ["full_attention", "sliding_attention"]
    q = explicit.to_qwen3_config()
    assert q.layer_types == explicit.layer_types and q.sliding_window == 2048 and q.use_sliding_window
    with pytest.raises(ValueError, match="no draft layer slides"):
        DrafterConfig.from_target_config(tiny_target_config(), sliding_window=64, mask_token_id=5)
    with pytest.raises(ValueError, match="names 2 layers"):
        DrafterConfig.from_target_config(
            tiny_target_config(), layer_types=["full_attention"] * 2, mask_token_id=5
        )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"layer_types": ["sliding_attention"] * 5}, "window is needed"),
        ({"sliding_window": 8}, "window is needed"),
        ({"layer_types": ["linear_attention"] * 5, "sliding_window": 8}, "layer_types"),
        ({"layer_types": ["sliding_attention"] * 5, "sliding_window": 0}, ">= 1"),
    ],
)
def test_layout_validation(change, match):
    cfg = DrafterConfig.from_target_config(tiny_target_config(), mask_token_id=5).to_dict()
    cfg.update(change)
    with pytest.raises(ValueError, match=match):
        DrafterConfig(**cfg)


def test_train_config_flags_for_the_layout():
    from dflash.consumer.config import TrainConfig

    base = {"spool": "s", "target": "t", "num_layers": 3}
    assert TrainConfig.from_flat(**base).drafter.layer_types is None  # auto
    cfg = TrainConfig.from_flat(**base, draft_layer_types="sliding, sliding,full", sliding_window=64)
    assert cfg.drafter.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert (
        TrainConfig.from_flat(
            **base, draft_layer_types="sliding_attention,full_attention,full"
        ).drafter.layer_types[0]
        == "sliding_attention"
    )
    for bad, match in (
        ("sliding,full", "names 2 layers"),
        ("sliding,causal,full", "sliding/full"),
        ("", "sliding/full"),
    ):
        with pytest.raises(ValueError, match=match):
            TrainConfig.from_flat(**base, draft_layer_types=bad)
    with pytest.raises(ValueError, match="sliding-window"):
        TrainConfig.from_flat(**base, sliding_window=0)


def test_draft_spec_names_what_a_config_lacks():
    from dflash.common.drafter.dflash import DraftSpec

    good = DrafterConfig.from_target_config(
        tiny_target_config(),
        num_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=9,
        mask_token_id=5,
    ).to_qwen3_config()
    spec = DraftSpec.from_config(good)
    assert spec.layer_types == ("sliding_attention", "full_attention") and spec.sliding_window == 9
    assert spec.window("full_attention") is None and spec.window("sliding_attention") == 9
    dropped = Qwen3Config(**{**good.to_dict(), "use_sliding_window": False})  # Qwen3Config drops the window
    with pytest.raises(ValueError, match="sliding_window"):
        DraftSpec.from_config(dropped)
    no_mask = Qwen3Config(**{**good.to_dict(), "dflash_config": {"target_layer_ids": [1]}})
    with pytest.raises(ValueError, match="mask_token_id"):
        DraftSpec.from_config(no_mask)


def test_a_mixed_layout_compiles_in_the_first_step_only():
    """The trainer's compile (each layer compiled on its own, masks built outside) with a sliding and a
    full layer: whatever the first step compiles, nothing compiles again in later steps of the same shapes."""
    import torch._dynamo

    from dflash.common.drafter.dflash import recompile_count
    from dflash.common.drafter.loss import draft_loss
    from dflash.consumer.step import compile_drafter

    layout = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5}
    torch._dynamo.reset()
    drafter, _ = make_drafter_and_batch(seed=2, **layout)
    compile_drafter(drafter, "aot_eager")
    before, counts = recompile_count(), []
    for seed in range(3):
        _, batch = make_drafter_and_batch(seed=seed + 10, **layout)
        draft_loss(
            drafter(batch, drafter.build_mask(batch)), batch, drafter.lm_head_weight
        ).loss_sum.backward()
        counts.append(recompile_count())
    assert counts[0] > before and counts[0] == counts[1] == counts[2], (before, counts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_sliding_drafter_trains_alike_on_compiled_flex_and_sdpa_on_cuda():
    """The training step of a sliding + full drafter on CUDA: compiled layers with flex_attention (what
    dflash-consume runs) equal eager SDPA in fp32 (outputs and every gradient, atol 1e-4)."""
    from dflash.common.drafter.loss import draft_loss
    from dflash.consumer.step import compile_drafter

    layout = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}
    results = {}
    for backend in ("sdpa", "flex"):
        drafter, batch = make_drafter_and_batch(seed=3, **layout)
        drafter.attention_backend = backend
        drafter = drafter.cuda()
        if backend == "flex":
            compile_drafter(drafter, "inductor")
        batch = batch.to("cuda")
        out = drafter(batch, drafter.build_mask(batch))
        draft_loss(out, batch, drafter.lm_head_weight).loss_sum.backward()
        results[backend] = [out.detach()] + [p.grad.detach() for p in drafter.parameters()]
    for got, want in zip(results["flex"], results["sdpa"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
