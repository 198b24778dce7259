"""Layer capture: hooks == output_hidden_states, early stop runs no later layer, right padding is exact."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3_5TextConfig, Qwen3NextConfig

from dflash.common.target.capture import LayerCapture, find_decoder
from dflash.tools.demo.assets import build_tiny_target

_SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
_LINEAR = dict(
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16
)


def _model(arch: str):
    if arch == "qwen3":
        return build_tiny_target(seed=0)
    torch.manual_seed(0)
    cfg = {
        "llama": lambda: LlamaConfig(**_SMALL),
        "qwen3_5_text": lambda: Qwen3_5TextConfig(**_SMALL, **_LINEAR),
        "qwen3_next": lambda: Qwen3NextConfig(
            **_SMALL,
            **_LINEAR,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
    }[arch]()
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.fixture(scope="module")
def qwen3():
    return build_tiny_target(seed=0)


def _reference(model, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """[B*S, K*H] from HF's output_hidden_states (hidden_states[i + 1] for layer i)."""
    with torch.inference_mode():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1].reshape(-1, hs[0].shape[-1]) for i in layer_ids], dim=-1)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5_text", "qwen3_next"])
def test_hooks_equal_output_hidden_states(arch):
    model = _model(arch)
    num_layers = len(find_decoder(model)[1])
    layer_ids = [1, 3, 5]
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    cap = LayerCapture(model, layer_ids)
    with torch.inference_mode():
        got = cap.run(ids)
    assert got.shape == (2 * 24, len(layer_ids) * cap.hidden_size)
    assert torch.equal(got, _reference(model, ids, layer_ids))
    assert num_layers == 8


def test_last_layer_uses_final_norm_semantics_and_duplicates(qwen3):
    """Layer L-1 is hidden_states[L], which HF takes after the final norm; repeated ids fill every slot."""
    ids = torch.randint(0, 4096, (1, 17), generator=torch.Generator().manual_seed(2))
    layer_ids = [0, 2, 2, 7]
    cap = LayerCapture(qwen3, layer_ids)
    with torch.inference_mode():
        got = cap.run(ids)
    cap.close()
    assert torch.equal(got, _reference(qwen3, ids, layer_ids))


def test_early_stop_runs_no_later_layer_and_matches_full_forward(qwen3):
    layers = find_decoder(qwen3)[1]
    calls: dict[str, int] = {}
    handles = []
    for name, mod in [
        *((f"layer{i}", m) for i, m in enumerate(layers)),
        ("norm", qwen3.model.norm),
        ("lm_head", qwen3.lm_head),
    ]:
        handles.append(
            mod.register_forward_pre_hook(
                lambda m, a, name=name: calls.__setitem__(name, calls.get(name, 0) + 1)
            )
        )
    ids = torch.randint(0, 4096, (3, 20), generator=torch.Generator().manual_seed(3))
    layer_ids = [1, 2, 3, 4, 5]
    full = LayerCapture(qwen3, layer_ids, stop_early=False)
    with torch.inference_mode():
        ref = full.run(ids)
    full.close()
    assert calls == {**{f"layer{i}": 1 for i in range(8)}, "norm": 1}  # run() never calls the lm_head
    calls.clear()
    early = LayerCapture(qwen3, layer_ids)
    with torch.inference_mode():
        got = early.run(ids)
        again = early.run(ids)  # the model is reusable after a stopped forward
    early.close()
    for h in handles:
        h.remove()
    assert calls == {f"layer{i}": 2 for i in range(6)}
    assert torch.equal(got, ref) and torch.equal(again, ref)


def test_free_unused_drops_later_layers():
    model = build_tiny_target(seed=0)
    ids = torch.randint(0, 4096, (2, 12), generator=torch.Generator().manual_seed(4))
    ref = _reference(model, ids, [1, 4])
    layers = find_decoder(model)[1]
    freed = sum(p.numel() for m in [*layers[5:], model.lm_head, model.model.norm] for p in m.parameters())
    n_before = sum(p.numel() for p in model.parameters())
    cap = LayerCapture(model, [1, 4], free_unused=True)
    assert sum(p.numel() for p in model.parameters()) == n_before - freed
    with torch.inference_mode():
        assert torch.equal(cap.run(ids), ref)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text"])
def test_right_padded_batch_equals_unpadded_forwards(arch):
    """No attention mask needed: causal (and recurrent) layers never let padding reach real tokens."""
    model = _model(arch)
    cap = LayerCapture(model, [1, 3, 5])
    g = torch.Generator().manual_seed(5)
    lengths = [19, 7, 24]
    seqs = [torch.randint(1, 256, (n,), generator=g) for n in lengths]
    ids = torch.zeros(3, 24, dtype=torch.long)
    valid = torch.zeros(3, 24, dtype=torch.bool)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = s
        valid[r, : len(s)] = True
    with torch.inference_mode():
        packed = cap.run(ids, valid)
        singles = torch.cat([cap.run(s[None]) for s in seqs])
    assert packed.shape == (sum(lengths), 3 * cap.hidden_size)
    torch.testing.assert_close(packed, singles, rtol=1e-5, atol=1e-5)


def test_bad_layer_ids(qwen3):
    with pytest.raises(ValueError, match="layer_ids"):
        LayerCapture(qwen3, [1, 8])
    with pytest.raises(ValueError, match="layer_ids"):
        LayerCapture(qwen3, [])
