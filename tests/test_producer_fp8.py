"""The producer with an FP8 codec: features quantized before the hand-off (on the CPU path as on the GPU's,
before the D2H copy), half the host bytes, host buffers of e4m3 + scales, NaN refused naming the sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

import dflash.producer.loop as loop
from dflash.common.contract import hidden_fp8
from dflash.common.contract.shard_reader import read_shard
from dflash.common.target.capture import LayerCapture
from dflash.common.target.data import DataConfig
from dflash.producer.buckets import BucketConfig, Sample
from dflash.producer.config import ProducerConfig, Worker
from dflash.producer.loop import produce
from dflash.producer.writers import HostBuffer

LAYERS = [0, 1, 2]
HIDDEN = 32


def _model():
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    return AutoModelForCausalLM.from_config(cfg).eval()


def _samples(n: int = 12) -> list[Sample]:
    rng = np.random.default_rng(0)
    return [
        Sample(i, rng.integers(0, 128, int(k), dtype=np.int32), rng.random(int(k)) < 0.7)
        for i, k in enumerate(rng.integers(10, 120, n))
    ]


def _produce(tmp_path, codec: str, samples: list[Sample]) -> dict:
    cfg = ProducerConfig(
        model="tiny",
        data=DataConfig(dataset="x", max_length=256),
        codec=codec,
        buckets=BucketConfig(batch_tokens=512, pool_batches=1),
    )
    worker = Worker(producer_id="c0", spool=str(tmp_path / codec / "spool"))
    return produce(cfg, worker, LayerCapture(_model(), LAYERS, free_unused=True), samples)


def test_the_cpu_path_quantizes_before_the_hand_off_and_hands_over_half_the_bytes(tmp_path):
    samples = _samples()
    results = {codec: _produce(tmp_path, codec, samples) for codec in ("bf16", "fp8")}
    tokens = sum(len(s) for s in samples)
    width = len(LAYERS) * HIDDEN
    assert results["bf16"]["host_bytes"] == tokens * width * 2
    assert results["fp8"]["host_bytes"] == tokens * (width + 2 * len(LAYERS))  # e4m3 + bf16 scales
    assert results["fp8"]["codec"] == "fp8:zstd:3" and results["fp8"]["pinned_bytes"] == 0  # no CUDA
    bf16 = {
        idx: shard.hidden[a:b]
        for shard in map(read_shard, (tmp_path / "bf16" / "spool" / "ready").iterdir())
        for idx, a, b in zip(
            shard.sample_index.tolist(),
            shard.cu_seqlens[:-1].tolist(),
            shard.cu_seqlens[1:].tolist(),
            strict=True,
        )
    }
    for path in (tmp_path / "fp8" / "spool" / "ready").iterdir():
        shard = read_shard(path)
        assert shard.hidden.dtype == hidden_fp8.FP8_DTYPE and shard.hidden_scales is not None
        cu = shard.cu_seqlens.tolist()
        for n, idx in enumerate(shard.sample_index.tolist()):
            values, scales = hidden_fp8.quantize(bf16.pop(idx), len(LAYERS))  # the same batches, forwards
            assert torch.equal(shard.hidden[cu[n] : cu[n + 1]].view(torch.uint8), values.view(torch.uint8))
            assert torch.equal(shard.hidden_scales[cu[n] : cu[n + 1]], scales)
    assert not bf16


def test_a_nan_in_a_hidden_state_stops_the_producer_naming_the_sample(tmp_path, monkeypatch):
    forward = loop.forward_batch

    def poisoned(capture, batch, device, pad_id):
        out = forward(capture, batch, device, pad_id)
        offset = 0
        for s in batch.samples:
            if s.sample_index == 7:
                out[offset + 3, HIDDEN + 1] = float("nan")  # sample 7, its token 3, layer 1
            offset += len(s)
        return out

    monkeypatch.setattr(loop, "forward_batch", poisoned)
    with pytest.raises(hidden_fp8.NonFiniteHiddenError, match=r"sample 7: .*token 3 of layer 1 is nan"):
        _produce(tmp_path, "fp8", _samples())
    assert not any((tmp_path / "fp8" / "spool" / "tmp").rglob("*.zarr"))


@pytest.mark.parametrize("fp8", [False, True])
def test_host_buffers_hold_e4m3_and_scales_and_receive_the_batch_exactly(fp8: bool):
    feature, layers = len(LAYERS) * HIDDEN, len(LAYERS)
    buf = HostBuffer.allocate(64, feature, layers, fp8=fp8, pin_memory=False)  # pinned on CUDA
    assert buf.nbytes == 64 * (feature + 2 * layers if fp8 else 2 * feature)
    hidden = torch.randn(40, feature).bfloat16()
    values, scales = hidden_fp8.quantize(hidden, layers) if fp8 else (hidden, None)
    host, host_scales = buf.fill(values, scales)
    assert host.data_ptr() == buf.hidden.data_ptr() and torch.equal(
        host.view(torch.uint8), values.view(torch.uint8)
    )
    assert (host_scales is None) == (not fp8) and (not fp8 or torch.equal(host_scales, scales))
    with pytest.raises(ValueError, match="does not fit a host buffer"):
        buf.fill(hidden if fp8 else values.float(), None)
