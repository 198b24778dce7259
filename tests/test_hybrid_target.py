"""Hybrid (Gated DeltaNet + attention) multimodal targets, as Qwen3.5/3.6 ship: a tiny checkpoint of that
shape (``Qwen3_5ForConditionalGeneration``, text model in a sub-config, a vision tower) saved with
save_pretrained loads as its text model only, its captures equal the VLM's ``output_hidden_states`` (whose
last entry is after the final norm), the producer runs on it end to end, and the linear-attention kernels
are reported (reference here; fla, when it imports, detected and switched off on the CPU)."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import transformers
from packaging.version import Version
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from dflash.common.contract.shard_reader import read_shard
from dflash.common.target.capture import LayerCapture
from dflash.common.target.data import DataConfig
from dflash.common.target.kernels import REFERENCE, force_reference_kernels, linear_attention_kernels
from dflash.common.target.loading import load_target, vision_parameters
from dflash.producer.config import ProducerConfig, TrunkCompileConfig, Worker
from dflash.producer.worker import run_producer
from dflash.tools.demo.assets import demo_dataset_path, tiny_target_dir
from tests.hybrid_helpers import tiny_hybrid_vlm_config

HIDDEN, LAYERS = 32, 4


def _vlm_config() -> Qwen3_5Config:
    return tiny_hybrid_vlm_config(hidden=HIDDEN, layers=LAYERS, linear_head_dim=8, full_attention_interval=2)


@pytest.fixture(scope="module")
def vlm_checkpoint(tmp_path_factory):
    """(path, the VLM in memory): a tiny multimodal hybrid checkpoint with the demo's tokenizer."""
    torch.manual_seed(0)
    vlm = Qwen3_5ForConditionalGeneration(_vlm_config()).eval()
    path = tmp_path_factory.mktemp("vlm") / "qwen3_5-tiny"
    vlm.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_target_dir() / name, path / name)
    assert vision_parameters(vlm) > 0
    return path, vlm


def _vlm_states(vlm, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.inference_mode():
        return vlm(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states


def test_multimodal_checkpoint_loads_the_text_model_only(vlm_checkpoint):
    path, vlm = vlm_checkpoint
    model, info = load_target(str(path), dtype=torch.float32, device="cpu")
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and info.multimodal
    assert vision_parameters(model) == 0 and info.vision_params == 0
    assert not any("visual" in n for n, _ in model.named_parameters())
    assert "no vision tower" in info.line() and "2 linear-attention layers" in info.line()
    text = dict(vlm.model.language_model.named_parameters())  # the weights are the checkpoint's, renamed
    for name, p in model.model.named_parameters():
        assert torch.equal(p, text[name]), name
    # every layer, the last included: HF takes hidden_states[L] after the final norm, and so does the capture
    ids = torch.randint(0, 4000, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = LayerCapture(model, list(range(LAYERS))).run(ids)
    ref = _vlm_states(vlm, ids)
    assert len(ref) == LAYERS + 1
    for k in range(LAYERS):
        torch.testing.assert_close(got[:, k * HIDDEN : (k + 1) * HIDDEN], ref[k + 1].reshape(-1, HIDDEN))
    raw = []  # the trap: the last layer's own output is not hidden_states[L] (that is after the norm)
    model.model.layers[-1].register_forward_hook(
        lambda m, a, out: raw.append(out[0] if isinstance(out, tuple) else out)
    )
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False)
    assert not torch.allclose(raw[0], ref[LAYERS])


@pytest.mark.parametrize("backend", ["auto", "aot_eager"])
@pytest.mark.pipeline  # a whole in-process run, tens of seconds on 2 cores: the full suite
def test_producer_runs_on_the_multimodal_hybrid_checkpoint(vlm_checkpoint, tmp_path, caplog, backend):
    """The worker end to end: text model only, kernels on its start line; eager by default on the CPU, and
    compiled (every layer; the linear-attention mixers run outside the graphs) when asked, 0 recompiles."""
    path, vlm = vlm_checkpoint
    cfg = ProducerConfig(
        model=str(path),
        layer_ids=[0, 1, 2],
        compile_options=TrunkCompileConfig(compile_backend=backend),
        codec="bf16",  # the capture is checked to bf16 rounding; FP8 is tests/test_producer_fp8.py's
        data=DataConfig(
            dataset=str(demo_dataset_path()), limit=6, max_length=128, cache_dir=str(tmp_path / "hf")
        ),
    )
    with caplog.at_level(logging.INFO):
        result = run_producer(cfg, Worker(producer_id="h0", spool=str(tmp_path / "spool")))
    assert result["done"] and result["samples"] > 0 and result["recompiles"] == 0
    if backend == "auto":
        assert result["compile"] == "eager"
    else:
        assert (
            result["compile"].startswith("compiled (aot_eager, layers, dynamic")
            and result["eager_mixers"] == 2
        )
        assert result["compile_s"] > 0
    start = next(r.getMessage() for r in caplog.records if "epoch(s)" in r.getMessage())
    assert "Qwen3_5ForCausalLM (text model of a multimodal checkpoint, no vision tower)" in start
    assert f"chunk_gated_delta_rule on {REFERENCE}" in start
    assert not any("falling back" in r.getMessage() for r in caplog.records)  # said once, by us
    shard = read_shard(next((tmp_path / "spool" / "ready").iterdir()))
    a, b = shard.cu_seqlens[:2].tolist()
    ref = _vlm_states(vlm, shard.input_ids[a:b].long()[None])
    want = torch.cat([ref[i + 1][0] for i in (0, 1, 2)], dim=-1).bfloat16()
    torch.testing.assert_close(shard.hidden[a:b].float(), want.float(), rtol=0.02, atol=0.02)


def test_reference_kernels_are_reported_and_forcing_them_is_undone(vlm_checkpoint):
    path, _ = vlm_checkpoint
    model, info = load_target(str(path), dtype=torch.float32, device="cpu")
    report = linear_attention_kernels(model)
    assert report.layers == 2 and set(report.kernels) == {"chunk_gated_delta_rule", "causal_conv1d"}
    assert not report.fast and "dflash-spool[hybrid]" in report.warning() and "\n" not in report.warning()
    module = sys.modules[type(model.model.layers[0].linear_attn).__module__]
    before = dict(vars(module))
    undo = force_reference_kernels(model)
    assert not linear_attention_kernels(model).fast
    undo()
    assert all(vars(module)[k] is v for k, v in before.items() if callable(v))


FAKE_FLA = """
def chunk_gated_delta_rule(*args, **kwargs):
    raise AssertionError("the fake fla kernel ran")

def fused_recurrent_gated_delta_rule(*args, **kwargs):
    raise AssertionError("the fake fla kernel ran")
"""


@pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.15"), reason="5.15+ resolves fla at import"
)
@pytest.mark.pipeline
def test_fla_is_detected_and_a_cpu_target_runs_the_reference_while_cuda_inputs_keep_fla(
    vlm_checkpoint, tmp_path
):
    """A stand-in ``fla`` package (whose kernels raise) on the path before transformers: the report names
    it; a CPU target runs the reference, so its forward never calls it (a CPU eval on a GPU box with the
    hybrid extra); and the process-wide kernel globals still hand a CUDA input to fla, so a CUDA target of
    the same process is not silently put on the slow path."""
    path, _ = vlm_checkpoint
    pkg = tmp_path / "fakefla" / "fla" / "ops" / "gated_delta_rule"
    pkg.mkdir(parents=True)
    for d in (pkg.parent.parent, pkg.parent):
        (d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text(FAKE_FLA)
    script = textwrap.dedent(f"""
        import json, sys, torch
        from types import SimpleNamespace
        sys.path.insert(0, {str(tmp_path / "fakefla")!r})
        from transformers import AutoModelForCausalLM
        from dflash.common.target.kernels import linear_attention_kernels, prepare_kernels
        model = AutoModelForCausalLM.from_pretrained({str(path)!r}).eval()
        fast = linear_attention_kernels(model)
        cpu = prepare_kernels(model, "cpu")
        with torch.inference_mode():
            model(input_ids=torch.ones(1, 70, dtype=torch.long), use_cache=False)
        module = sys.modules[type(model.model.layers[0].linear_attn).__module__]
        cuda_input = SimpleNamespace(is_cuda=True, device=torch.device("cuda"))
        try:
            module.torch_chunk_gated_delta_rule(cuda_input, cuda_input, cuda_input, g=None, beta=None)
            routed = "reference"
        except AssertionError as err:
            routed = str(err)
        print(json.dumps({{"fast": fast.kernels, "cpu": cpu.kernels, "cuda_input": routed}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["fast"]["chunk_gated_delta_rule"].startswith("fla.ops")
    assert got["cpu"]["chunk_gated_delta_rule"] == REFERENCE
    assert got["cuda_input"] == "the fake fla kernel ran"


def test_text_only_config_is_not_multimodal(tmp_path):
    """A plain text target (the demo's Qwen3) is reported without kernels or a multimodal note."""
    model, info = load_target(str(tiny_target_dir()), dtype=torch.float32, device="cpu")
    assert not info.multimodal and info.kernels is None and info.line() == "Qwen3ForCausalLM"
    assert np.isclose(vision_parameters(model), 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_multimodal_hybrid_checkpoint_on_cuda_loads_text_only_and_produces_compiled(tmp_path, caplog):
    """On CUDA, as on the CPU: the multimodal hybrid checkpoint loads as its text model (no vision tower, on
    the GPU), and the producer with default flags (compiled; fla's kernels when installed, warmed before
    the first batch) produces every sample with 0 recompiles. Head dims of 32: fla's kernels' smallest."""
    cfg = _vlm_config()
    cfg.text_config.update(dict(linear_key_head_dim=32, linear_value_head_dim=32, head_dim=32))
    torch.manual_seed(0)
    path = tmp_path / "qwen3_5-tiny-cuda"
    Qwen3_5ForConditionalGeneration(cfg).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_target_dir() / name, path / name)
    model, info = load_target(str(path), dtype=torch.bfloat16, device="cuda:0")
    assert info.multimodal and vision_parameters(model) == 0
    assert all(p.is_cuda for p in model.parameters())
    del model
    cfg = ProducerConfig(
        model=str(path),
        layer_ids=[0, 1, 2],
        data=DataConfig(
            dataset=str(demo_dataset_path()), limit=24, max_length=256, cache_dir=str(tmp_path / "hf")
        ),
    )
    with caplog.at_level(logging.INFO):
        result = run_producer(cfg, Worker(producer_id="g0", spool=str(tmp_path / "spool"), device="cuda:0"))
    assert result["done"] and result["samples"] > 0 and result["recompiles"] == 0
    assert result["compile"].startswith("compiled (inductor, layers") and result["eager_mixers"] == 2
    start = next(r.getMessage() for r in caplog.records if "epoch(s)" in r.getMessage())
    assert "no vision tower" in start and "linear-attention layers" in start
    assert (
        sum(read_shard(p).num_samples for p in (tmp_path / "spool" / "ready").iterdir()) == result["samples"]
    )
