"""The compiled trunk (producer/trunk.py): its captures equal the eager capture's, nothing recompiles after
warm-up (and a recompile is counted and logged), a failed compile falls back to eager with one warning,
and static shapes pad every batch to its bucket's shape. CPU, ``aot_eager`` (dynamo and AOT autograd
trace as for inductor, without code generation), tiny models."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3Config

from dflash.common.contract.shard_reader import read_shard
from dflash.common.drafter.dflash import recompile_count
from dflash.common.target.capture import LayerCapture
from dflash.common.target.data import DataConfig
from dflash.common.target.kernels import linear_attention_kernels
from dflash.producer.buckets import BucketConfig, Bucketer, Sample, batches
from dflash.producer.compile_plan import CompileSpec, mixer_shapes, static_buckets, warmup_shapes
from dflash.producer.config import ProducerConfig, TrunkCompileConfig, Worker
from dflash.producer.loop import produce
from dflash.producer.tapped_trunk import TappedTrunk
from dflash.producer.trunk import Trunk, warm_trunk

_TINY = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)
_LINEAR = dict(
    linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=16, linear_value_head_dim=16
)
LAYERS = [0, 1, 2]  # the last layer is never run: the early stop / the cut is exercised


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles its own graphs (dynamo caches them per code object, across torch.compile calls)."""
    torch._dynamo.reset()


def _model(arch: str = "qwen3"):
    torch.manual_seed(0)
    types = ["linear_attention", "full_attention"] * 2
    cfg = (
        Qwen3Config(**_TINY) if arch == "qwen3" else Qwen3_5TextConfig(**_TINY, **_LINEAR, layer_types=types)
    )
    return AutoModelForCausalLM.from_config(cfg).eval()


def _batch(rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():  # as the producer builds its inputs
        ids = torch.randint(0, 128, (rows, length), generator=g)
    lens = torch.randint(1, length + 1, (rows,), generator=g)
    return ids, torch.arange(length)[None, :] < lens[:, None]


def _assert_same_as_eager(trunk: Trunk, arch: str, shapes) -> None:
    eager = LayerCapture(_model(arch), LAYERS, free_unused=True)
    for seed, (rows, length) in enumerate(shapes):
        ids, valid = _batch(rows, length, seed)
        with torch.inference_mode():
            got, want = trunk.run(ids, valid), eager.run(ids, valid)
        assert got.shape == (int(valid.sum()), len(LAYERS) * 32)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "scope,warm,shapes",
    [
        ("layers", [(4, 96), (1, 136)], [(3, 72), (2, 264), (1, 40), (5, 96)]),
        ("trunk", [(4, 96)], [(3, 72), (2, 264), (5, 96)]),  # one graph (the 1-row one: as layers)
    ],
)
@pytest.mark.pipeline  # a whole in-process run, tens of seconds on 2 cores: the full suite
def test_dynamic_compile_equals_eager_and_never_recompiles(scope, warm, shapes, caplog):
    """Warmed on a few shapes (1-row batches are their own graph: dynamo specializes sizes of 1), batches
    of other rows and lengths reuse those graphs."""
    model = _model()
    trunk = Trunk(LayerCapture(model, LAYERS, free_unused=True), CompileSpec("aot_eager", scope, "dynamic"))
    before = recompile_count()
    trunk.warm_up(warm, "cpu")
    assert trunk.compiled, trunk.fallback
    assert recompile_count() - before == len(warm)  # a graph per warmed shape (layers: all 3 share it)
    with caplog.at_level(logging.ERROR):
        _assert_same_as_eager(trunk, "qwen3", shapes)
    assert trunk.recompiles == 0 and "RECOMPILE" not in caplog.text
    if scope == "layers":  # the hooks (eager) stay on the layers; the compiled forwards are instance attrs
        assert sum("forward" in vars(m) for m in trunk.capture.layers) == len(LAYERS)


def test_static_shape_outside_the_warmed_set_is_a_counted_recompile(caplog):
    trunk = Trunk(
        LayerCapture(_model(), LAYERS, free_unused=True), CompileSpec("aot_eager", "layers", "static")
    )
    trunk.warm_up([(2, 64), (1, 128)], "cpu")
    _assert_same_as_eager(trunk, "qwen3", [(2, 64), (1, 128)])
    assert trunk.recompiles == 0
    with caplog.at_level(logging.ERROR):
        _assert_same_as_eager(trunk, "qwen3", [(3, 64)])
    assert trunk.recompiles == 1
    assert "RECOMPILE after warm-up" in caplog.text and "this is a bug" in caplog.text


def test_a_failed_compile_warns_once_and_runs_eagerly(caplog):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("no compiler here")

    trunk = Trunk(
        LayerCapture(_model(), LAYERS, free_unused=True), CompileSpec(broken_backend, "layers", "dynamic")
    )
    with caplog.at_level(logging.WARNING):
        trunk.warm_up([(2, 64)], "cpu")
        _assert_same_as_eager(trunk, "qwen3", [(2, 64), (3, 40)])
    lines = [r for r in caplog.records if "compiling the target failed" in r.getMessage()]
    assert len(lines) == 1 and "no compiler here" in lines[0].getMessage()
    assert "\n" not in lines[0].getMessage()
    assert not trunk.compiled and trunk.report()["compile"] == "eager (compile failed)"
    assert not any("forward" in vars(m) for m in trunk.capture.layers)  # back to the plain layers


@pytest.mark.pipeline  # a whole in-process run, tens of seconds on 2 cores: the full suite
def test_hybrid_linear_attention_mixers_run_outside_the_graphs():
    """A hybrid target: every layer is compiled, but each Gated DeltaNet token mixer runs eagerly between
    the graphs (fla's kernels are its work; the torch reference's loop over 64-token chunks would make one
    graph per chunk count), so lengths across chunk counts reuse the graphs: 0 recompiles."""
    model = _model("hybrid")
    kernels = linear_attention_kernels(model)
    assert kernels is not None and not kernels.fast
    trunk = Trunk(
        LayerCapture(model, LAYERS, free_unused=True), CompileSpec("aot_eager", "layers", "dynamic"), kernels
    )
    assert all("forward" in vars(trunk.capture.layers[i]) for i in LAYERS)  # every captured layer compiled
    assert [type(m).__name__ for m in trunk.eager_mixers] == ["Qwen3_5GatedDeltaNet"] * 2  # layers 0 and 2
    trunk.warm_up([(2, 96), (1, 160)], "cpu")
    _assert_same_as_eager(trunk, "hybrid", [(3, 40), (2, 200), (1, 300)])
    assert trunk.recompiles == 0 and trunk.report()["eager_mixers"] == 2
    trunk.close()
    assert not any("forward" in vars(m) for m in trunk.capture.text_model.modules())  # the model as it was


def test_a_compile_past_its_bound_is_abandoned_for_the_eager_path(caplog):
    """A warm-up still compiling at ``timeout_s`` (a backend that would take two minutes) is cut there:
    one warning line, the eager path, the same features."""

    def slow_backend(gm, example_inputs):
        time.sleep(120)
        return gm.forward

    spec = CompileSpec(slow_backend, "layers", "dynamic", timeout_s=1.0)
    trunk = Trunk(LayerCapture(_model(), LAYERS, free_unused=True), spec)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        trunk.warm_up([(2, 64)], "cpu")
    assert time.monotonic() - t0 < 100  # cut at the bound, not after the backend's two minutes
    lines = [r.getMessage() for r in caplog.records if "compiling the target failed" in r.getMessage()]
    assert len(lines) == 1 and "still compiling after 1 s" in lines[0] and "\n" not in lines[0]
    assert not trunk.compiled and trunk.report()["compile"] == "eager (compile failed)"
    _assert_same_as_eager(trunk, "qwen3", [(2, 64), (3, 40)])


def test_round_rows_makes_only_the_row_counts_warm_up_runs():
    """fla compiles and autotunes per batch row count: with ``round_rows`` every batch's row count is a
    power of two (a partial batch padded with empty rows), and `mixer_shapes` warms each of them, at a
    length divisible by 16 and at one that is not."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 700, 900)
    cfg = BucketConfig(batch_tokens=2048, round_rows=True)
    seen = set()
    for b in batches(
        [Sample(i, np.zeros(int(n), np.int32), np.ones(int(n), bool)) for i, n in enumerate(lengths)], cfg
    ):
        assert b.num_rows >= len(b.samples) and b.pad_len >= max(len(s) for s in b.samples)
        assert b.num_rows & (b.num_rows - 1) == 0 and b.num_padded_tokens <= 2048 + b.pad_len
        seen.add(b.num_rows)
    warm = mixer_shapes(cfg, lengths)
    assert seen <= {r for r, _ in warm} and len(seen) > 3
    assert {n for r, n in warm if r == 1} == {64, 72}
    plain = BucketConfig(batch_tokens=2048)
    assert {b.num_rows for b in batches([Sample(0, np.zeros(5, np.int32), np.ones(5, bool))], plain)} == {1}


def test_tapped_trunk_matches_the_capture_including_the_last_layer():
    """The trunk scope's taps (uncompiled here) give LayerCapture's values, the last layer included (taken
    after the final norm, as HF's hidden_states[L]); repeated ids fill several slots."""
    ids, valid = _batch(3, 50, 0)
    for layer_ids in ([0, 2], [1, 3, 3]):
        trunk = Trunk(LayerCapture(_model(), layer_ids, free_unused=True), CompileSpec(scope="trunk"))
        trunk._tapped = TappedTrunk(trunk.capture)  # the uncompiled module the trunk scope compiles
        with torch.inference_mode():
            got, want = trunk.run(ids, valid), LayerCapture(_model(), layer_ids).run(ids, valid)
        torch.testing.assert_close(got, want)


def test_warmup_shapes():
    cfg = BucketConfig(batch_tokens=1024)
    lengths = [50, 70, 300, 600, 2000]
    static = warmup_shapes(static_buckets(cfg), CompileSpec("inductor", shapes="static"), lengths)
    bk = Bucketer(static_buckets(cfg))
    assert static == [bk.shape_of(b) for b in sorted({bk.bucket_of(n) for n in lengths})]
    assert all(r * b <= 1024 or r == 1 for r, b in static)
    dynamic = warmup_shapes(cfg, CompileSpec("inductor"), lengths)
    bk = Bucketer(cfg)  # full batches of the longest and the shortest multi-row bucket, then a 1-row one
    assert dynamic[:2] == [
        bk.shape_of(bk.bucket_of(300)),
        bk.shape_of(bk.bucket_of(50)),
    ]  # 600: 1 row of 1024
    assert len(dynamic) == 3 and dynamic[2][0] == 1
    assert warmup_shapes(cfg, CompileSpec(), lengths) == []  # eager: nothing to warm


def test_fixed_shapes_pad_every_batch_to_its_bucket():
    cfg = static_buckets(BucketConfig(batch_tokens=2048, pool_batches=1))
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.5, 0.8, 400).astype(int), 8, 1500)
    bk = Bucketer(cfg)
    seen = []
    for b in batches(
        [Sample(i, np.zeros(n, np.int32), np.ones(n, bool)) for i, n in enumerate(lengths)], cfg, bk
    ):
        assert (b.num_rows, b.pad_len) == bk.shape_of(b.bucket) and len(b.samples) <= b.num_rows
        seen += [s.sample_index for s in b.samples]
    assert sorted(seen) == list(range(len(lengths)))
    assert len({bk.bucket_of(int(n)) for n in lengths}) <= 16  # 4 per octave from 64: a few graphs


@pytest.mark.pipeline  # a whole in-process run, tens of seconds on 2 cores: the full suite
def test_produce_with_static_shapes_stores_the_eager_states(tmp_path):
    """The whole producer loop, compiled with static shapes: padding rows and lengths never reach a shard,
    every sample's states equal an eager forward of it alone, 0 recompiles."""
    rng = np.random.default_rng(1)
    samples = [
        Sample(i, rng.integers(0, 128, n, dtype=np.int32), rng.random(n) < 0.7)
        for i, n in enumerate(rng.integers(10, 200, 24))
    ]
    cfg = ProducerConfig(
        model="tiny",
        data=DataConfig(dataset="x", max_length=256),
        buckets=BucketConfig(batch_tokens=512, pool_batches=1),
        compile_options=TrunkCompileConfig(compile_backend="aot_eager", compile_shapes="static"),
        codec="bf16",
    )
    worker = Worker(producer_id="c0", spool=str(tmp_path / "spool"))
    trunk = warm_trunk(
        cfg, worker, LayerCapture(_model(), LAYERS, free_unused=True), None, [len(s) for s in samples]
    )
    result = produce(cfg, worker, trunk, samples)
    assert result["done"] and result["samples"] == 24 and result["recompiles"] == 0
    assert result["compile"].startswith("compiled (aot_eager, layers, static")
    assert result["padded_tokens"] > result["fwd_tokens"]  # rows and lengths padded to the bucket shapes
    eager = LayerCapture(_model(), LAYERS)
    by_index = {s.sample_index: s for s in samples}
    for path in (tmp_path / "spool" / "ready").iterdir():
        shard = read_shard(path)
        cu = shard.cu_seqlens.tolist()
        for n, idx in enumerate(shard.sample_index.tolist()):
            with torch.inference_mode():
                want = eager.run(torch.from_numpy(by_index[idx].input_ids).long()[None])
            torch.testing.assert_close(shard.hidden[cu[n] : cu[n + 1]].float(), want.bfloat16().float())
            by_index.pop(idx)
    assert not by_index
