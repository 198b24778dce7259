"""The FP8 target (common/target/fp8.py): a fine-grained FP8 checkpoint in the published format (written here
from the demo's tiny target: e4m3 ``weight`` + ``weight_scale_inv`` per 128 x 128 block, ``quantization_config``
quant_method fp8) loads through transformers' own path and produces; on the CPU, with no FP8 matmuls, the
FP8 numbers are emulated and said in one line, or refused (exit 2, one line) when asked; the FP8 linear's
matmul (``torch._scaled_mm``, rowwise) computes what its emulation does."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash.common.contract.shard_reader import read_shard
from dflash.common.target.capture import LayerCapture
from dflash.common.target.data import DataConfig
from dflash.common.target.fp8 import FP8_DTYPE, Fp8Linear, fp8_linears, fp8_rounded, quantize_rows
from dflash.common.target.fp8_checkpoint import dequantize_blocks, write_fp8_checkpoint
from dflash.common.target.loading import Fp8Unavailable, load_target
from dflash.producer.cli import main
from dflash.producer.config import ProducerConfig, Worker
from dflash.producer.worker import run_producer
from dflash.tools.demo.assets import demo_dataset_path, tiny_target_dir

LAYERS = [1, 3, 5]


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fp8") / "tiny-fp8"
    assert write_fp8_checkpoint(tiny_target_dir(), path) == 8 * 7  # q k v o gate up down per layer
    return path


def _states(model, ids: torch.Tensor) -> torch.Tensor:
    capture = LayerCapture(model, LAYERS)
    try:
        with torch.inference_mode():
            return capture.run(ids).float()
    finally:
        capture.close()


def test_the_checkpoint_is_in_the_published_format(fp8_checkpoint):
    tensors = load_file(fp8_checkpoint / "model.safetensors")
    w, s = (
        tensors["model.layers.0.mlp.up_proj.weight"],
        tensors["model.layers.0.mlp.up_proj.weight_scale_inv"],
    )
    assert w.dtype == FP8_DTYPE and w.shape == (512, 256)
    assert s.dtype == torch.float32 and s.shape == (4, 2)  # one per 128 x 128 block
    assert (
        tensors["model.embed_tokens.weight"].dtype != FP8_DTYPE and "lm_head.weight_scale_inv" not in tensors
    )


def test_an_fp8_checkpoint_loads_through_transformers_with_its_block_scales(fp8_checkpoint):
    """--target-precision bf16: transformers' fine-grained FP8 loader restores each block (weight x its
    scale_inv), and nothing is requantized."""
    model, info = load_target(str(fp8_checkpoint), dtype=torch.float32, device="cpu", precision="bf16")
    tensors = load_file(fp8_checkpoint / "model.safetensors")
    name = "model.layers.2.self_attn.q_proj"
    want = dequantize_blocks(tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"])
    got = model.get_submodule(name)
    assert type(got) is torch.nn.Linear and torch.equal(got.weight, want)
    assert not fp8_linears(model) and "FP8" not in info.line()


def test_an_fp8_checkpoint_runs_emulated_on_the_cpu_said_in_one_line(fp8_checkpoint, caplog):
    """auto: an FP8 checkpoint is an FP8 target; the CPU has no FP8 matmuls, so its linears hold the
    FP8-rounded weights and round their inputs per row (one warning line says so), the rest untouched."""
    with caplog.at_level(logging.WARNING):
        model, info = load_target(str(fp8_checkpoint), dtype=torch.float32, device="cpu")
    lines = [r.getMessage() for r in caplog.records if "FP8" in r.getMessage()]
    assert len(lines) == 1 and "the CPU has no FP8 matmuls" in lines[0] and "emulated" in lines[0]
    linears = fp8_linears(model)
    assert len(linears) == 56 and all(m.emulate for m in linears) and "emulated" in info.line()
    restored, _ = load_target(str(fp8_checkpoint), dtype=torch.float32, device="cpu", precision="bf16")
    name = "model.layers.2.mlp.down_proj"
    w = restored.get_submodule(name).weight
    assert torch.equal(model.get_submodule(name).weight, fp8_rounded(w))  # per output channel, once
    ids = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(0))
    fp8, ref = _states(model, ids), _states(restored, ids)
    err = float((fp8 - ref).norm() / ref.norm())
    assert 0 < err < 0.1  # the activations' rounding: present, small


def test_a_bf16_checkpoint_becomes_an_fp8_target_at_load():
    model, info = load_target(str(tiny_target_dir()), dtype=torch.float32, device="cpu", precision="fp8")
    assert len(fp8_linears(model)) == 56 and type(model.lm_head) is torch.nn.Linear
    plain, _ = load_target(str(tiny_target_dir()), dtype=torch.float32, device="cpu")
    assert not fp8_linears(plain)


def test_refused_where_fp8_matmuls_do_not_run_when_asked(fp8_checkpoint, tmp_path, capsys):
    with pytest.raises(Fp8Unavailable, match="the CPU has no FP8 matmuls"):
        load_target(str(fp8_checkpoint), dtype=torch.float32, device="cpu", fp8_fallback="refuse")
    with pytest.raises(SystemExit) as exc:  # the CLI: before any worker starts or the spool is bound
        main(
            [
                *(
                    "--gpus",
                    "cpu:1",
                    "--model",
                    str(tiny_target_dir()),
                    "--dataset",
                    str(demo_dataset_path()),
                ),
                *(
                    "--spool",
                    str(tmp_path / "spool"),
                    "--target-precision",
                    "fp8",
                    "--fp8-fallback",
                    "refuse",
                ),
            ]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1
    assert "FP8 target refused (--fp8-fallback refuse): the CPU has no FP8 matmuls" in err[0]
    assert not (tmp_path / "spool").exists()


@pytest.mark.parametrize("bias", [False, True])
def test_the_fp8_matmul_computes_what_its_emulation_does(bias):
    """torch._scaled_mm with rowwise scales (the GPU path; torch's CPU build has it too) against the
    emulation's fp32 matmul of the same FP8 values: equal to the bf16 output's rounding."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 128, bias=bias).to(torch.bfloat16)
    x = torch.randn(3, 7, 256, dtype=torch.bfloat16) * torch.logspace(-2, 1, 256).bfloat16()
    emulated = Fp8Linear(copy.deepcopy(linear).float(), emulate=True)(x.float())  # the CPU path
    want = torch.nn.functional.linear(
        fp8_rounded(x.reshape(-1, 256).float()),
        fp8_rounded(linear.weight.float()),
        None if linear.bias is None else linear.bias.float(),
    ).view(3, 7, 128)
    assert torch.equal(emulated, want)
    try:
        native = Fp8Linear(linear, emulate=False)(x)
    except (RuntimeError, NotImplementedError) as err:  # a torch build without the CPU kernel
        pytest.skip(f"torch._scaled_mm on the CPU: {err}")
    assert native.dtype == torch.bfloat16 and native.shape == (3, 7, 128)
    torch.testing.assert_close(native.float(), want, rtol=1e-2, atol=1e-2)
    q, scale = quantize_rows(x.reshape(-1, 256))
    assert q.dtype == FP8_DTYPE and scale.shape == (21, 1)


@pytest.mark.pipeline  # a whole in-process run: tens of seconds on 2 cores
def test_the_producer_runs_an_fp8_checkpoint_and_captures_in_its_dtype(fp8_checkpoint, tmp_path, caplog):
    """dflash-produce's worker on the FP8 checkpoint (CPU: emulated): shards of the FP8 target's hidden
    states, in the target's dtype before the codec, the start line naming the precision."""
    cfg = ProducerConfig(
        model=str(fp8_checkpoint),
        layer_ids=LAYERS,
        codec="bf16",
        data=DataConfig(
            dataset=str(demo_dataset_path()), limit=6, max_length=128, cache_dir=str(tmp_path / "hf")
        ),
    )
    with caplog.at_level(logging.INFO):
        result = run_producer(cfg, Worker(producer_id="f0", spool=str(tmp_path / "spool")))
    assert result["done"] and result["samples"] > 0
    start = next(r.getMessage() for r in caplog.records if "epoch(s)" in r.getMessage())
    assert "FP8 e4m3 weights and activations on 56 linears emulated" in start
    shard = read_shard(next((tmp_path / "spool" / "ready").iterdir()))
    model, _ = load_target(str(fp8_checkpoint), dtype=torch.float32, device="cpu")
    a, b = shard.cu_seqlens[:2].tolist()
    want = _states(model, shard.input_ids[a:b].long()[None]).bfloat16()
    torch.testing.assert_close(shard.hidden[a:b].float(), want.float(), rtol=0.02, atol=0.02)
