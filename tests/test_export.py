"""dflash-export: config fields and parameter names of the public DFlashDraftModel, bit-exact round trip of a
checkpoint through export -> load, the CLI's checkpoint-url forms and its one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dflash.common.checkpoints.load import load_checkpoint
from dflash.common.checkpoints.save import capture_rng_state, save_checkpoint
from dflash.common.contract.sample_set import SampleSet
from dflash.common.drafter.batch import build_draft_batch, pack_samples
from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.hf_format import (
    CODE_FILE,
    CONFIG_FILE,
    WEIGHTS_FILE,
    ExportError,
    drafter_config_from_export,
    export_config,
    export_drafter,
)
from dflash.common.drafter.model import DFlashDrafter
from dflash.common.target.attach import load_exported_drafter
from dflash.common.target.head import load_target_head
from dflash.tools.demo.assets import build_tiny_target
from dflash.tools.export.cli import main
from dflash.tools.export.run import parse_checkpoint_url


@pytest.fixture(scope="module")
def target():
    return build_tiny_target()


@pytest.fixture(scope="module")
def config(target) -> DrafterConfig:
    return DrafterConfig.from_target_config(target.config, num_layers=2, block_size=8, mask_token_id=3)


def _trained_like(config: DrafterConfig, target, seed: int = 0) -> DFlashDrafter:
    """A drafter whose weights are all different from the init (norms != 1), as after training."""
    torch.manual_seed(seed)
    model = DFlashDrafter(config, load_target_head(target, dtype=torch.float32))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _public_names(num_layers: int) -> set[str]:
    """The public DFlashDraftModel's state dict (z-lab/dflash dflash/model.py), written out independently."""
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    names = {f"layers.{i}.{n}" for i in range(num_layers) for n in per_layer}
    return names | {"fc.weight", "hidden_norm.weight", "norm.weight"}


def _batch(config: DrafterConfig, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    width = config.hidden_size * len(config.target_layer_ids)
    docs = [
        (
            torch.randint(0, config.vocab_size, (n,), generator=g),
            torch.ones(n, dtype=torch.bool),
            torch.randn(n, width, generator=g),
            i,
        )
        for i, n in enumerate((30, 21))
    ]
    packed = pack_samples(docs, context_tokens=64)
    return build_draft_batch(
        packed,
        block_size=config.block_size,
        num_anchors=10,
        max_anchors_per_doc=5,
        mask_token_id=config.mask_token_id,
        gamma=7.0,
        generator=g,
    )


def _save(
    tmp_path,
    model: DFlashDrafter,
    config: DrafterConfig,
    step: int = 7,
    run: str = "r1",
    target: str = "tiny-target",
) -> str:
    store = str(tmp_path / "ckpt")
    opt = torch.optim.AdamW(model.parameters())
    save_checkpoint(
        store,
        run,
        step,
        model_state={n: p for n, p in model.named_parameters()},
        optimizer_state=opt.state_dict(),
        scheduler_state={},
        rng_state=capture_rng_state(),
        trained=SampleSet(),
        config={"train": {"target": target}, "drafter": config.to_dict()},
    )
    return store


# ------------------------------------------------------------------------------------------------ format


def test_config_has_the_public_fields(tmp_path, config):
    from transformers import Qwen3Config

    cfg = export_config(config, torch.bfloat16)
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["num_hidden_layers"] == 2  # the DRAFT layers
    assert cfg["num_target_layers"] == 8
    assert cfg["block_size"] == 8
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 2, 3, 4, 5], "mask_token_id": 3, "block_size": 8}
    for key, want in [
        ("hidden_size", 256),
        ("num_attention_heads", 4),
        ("num_key_value_heads", 2),
        ("head_dim", 64),
        ("intermediate_size", 512),
        ("vocab_size", 4096),
        ("rms_norm_eps", 1e-6),
        ("max_position_embeddings", 4096),
        ("rope_theta", 1e6),
        ("dtype", "bfloat16"),
        ("tie_word_embeddings", False),
    ]:
        assert cfg[key] == want, key
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    (tmp_path / CONFIG_FILE).write_text(json.dumps(cfg))
    hf = Qwen3Config.from_pretrained(tmp_path)  # what the public DFlashDraftModel's config_class reads
    assert hf.num_hidden_layers == 2 and hf.head_dim == 64 and hf.rope_parameters["rope_theta"] == 1e6
    assert hf.dflash_config["target_layer_ids"] == [1, 2, 3, 4, 5]
    assert drafter_config_from_export(cfg) == config


def test_config_round_trips_rope_scaling(config):
    import dataclasses

    yarn = dataclasses.replace(
        config, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    )
    cfg = export_config(yarn, torch.bfloat16)
    assert cfg["rope_parameters"]["rope_type"] == "yarn" and cfg["rope_scaling"]["factor"] == 4.0
    assert drafter_config_from_export(cfg) == yarn


def test_reads_a_public_transformers4_style_config(config):
    """The public Qwen3 drafters' config.json: block_size at the top level, rope_theta + rope_scaling=null,
    dflash_config without block_size."""
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "block_size": 8,
        "dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 2, 3, 4, 5]},
        "head_dim": 64,
        "hidden_size": 256,
        "intermediate_size": 512,
        "max_position_embeddings": 4096,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_target_layers": 8,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "vocab_size": 4096,
    }
    assert drafter_config_from_export(cfg) == config
    del cfg["num_target_layers"]
    with pytest.raises(ExportError, match="num_target_layers"):
        drafter_config_from_export(cfg)


def test_weights_have_the_public_names_and_no_target_tensors(tmp_path, config, target):
    model = _trained_like(config, target)
    out = export_drafter(model.state_dict(), config, tmp_path / "out")
    with safe_open(str(out / WEIGHTS_FILE), framework="pt") as f:
        names = set(f.keys())
        assert all(f.get_tensor(n).dtype == torch.bfloat16 for n in names)
    assert names == _public_names(2)
    assert sorted(p.name for p in out.iterdir()) == [CONFIG_FILE, CODE_FILE, WEIGHTS_FILE]  # + remote code
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_export_is_readable_by_others_whatever_the_umask(tmp_path, config, target):
    """Files 0644, folder 0755: a serving container or another user reads the export."""
    import os
    import stat

    old = os.umask(0o077)
    try:
        out = export_drafter(_trained_like(config, target).state_dict(), config, tmp_path / "out")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {
        CONFIG_FILE: 0o644,
        CODE_FILE: 0o644,
        WEIGHTS_FILE: 0o644,
    }


# ------------------------------------------------------------------------------------------- round trip


def test_checkpoint_export_load_is_bit_exact(tmp_path, config, target, capsys):
    model = _trained_like(config, target)
    store = _save(tmp_path, model, config)
    out = tmp_path / "export"
    assert main([f"{store}/r1", str(out), "--dtype", "float32"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    with safe_open(str(out / WEIGHTS_FILE), framework="pt") as f:
        assert f.metadata()["dflash_step"] == "7" and f.metadata()["dflash_target"] == "tiny-target"

    ckpt = load_checkpoint(store, "r1")
    from_ckpt = DFlashDrafter(config, load_target_head(target, dtype=torch.float32))
    from_ckpt.load_state_dict(ckpt.model_state)
    exported = load_exported_drafter(out, target)
    assert exported.config == config and not exported.training
    batch = _batch(config)
    with torch.no_grad():
        want = from_ckpt.eval()(batch) @ from_ckpt.target_head.lm_head_weight.t()
        got = exported(batch) @ exported.target_head.lm_head_weight.t()
    assert torch.equal(got, want)
    with torch.no_grad():  # and the checkpoint holds what was trained
        assert torch.equal(model(batch), from_ckpt(batch))


def test_bf16_export_keeps_rotary_in_fp32(tmp_path, config, target):
    model = _trained_like(config, target)
    out = export_drafter(model.state_dict(), config, tmp_path / "bf16")
    loaded = load_exported_drafter(out, target)
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert loaded.target_head.embed_weight.dtype == torch.bfloat16
    assert loaded.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(loaded.rotary_emb.inv_freq, model.rotary_emb.inv_freq)
    assert torch.equal(loaded.layers[1].mlp.up_proj.weight, model.layers[1].mlp.up_proj.weight.bfloat16())


def test_step_directory_and_run_flag_forms(tmp_path, config, target):
    model = _trained_like(config, target)
    store = _save(tmp_path, model, config, step=3)
    _save(tmp_path, _trained_like(config, target, seed=1), config, step=9)  # latest
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert main([f"{store}/r1/step-00000003", str(a), "--dtype", "float32"]) == 0
    assert main([store, str(b), "--run", "r1", "--step", "3", "--dtype", "float32"]) == 0
    assert main([store, str(c), "--run", "r1", "--dtype", "float32"]) == 0
    step3 = [load_exported_drafter(p, target).fc.weight for p in (a, b)]
    assert torch.equal(step3[0], model.fc.weight) and torch.equal(step3[1], model.fc.weight)
    assert not torch.equal(load_exported_drafter(c, target).fc.weight, model.fc.weight)


@pytest.mark.parametrize(
    ("url", "run", "step", "want"),
    [
        ("s3://b/p/myrun", None, None, ("s3://b/p", "myrun", None)),
        ("s3://b/myrun/", None, 5, ("s3://b", "myrun", 5)),
        ("s3://b/p/myrun/step-00000100", None, None, ("s3://b/p", "myrun", 100)),
        ("/ckpt/myrun/step-00000100", None, 100, ("/ckpt", "myrun", 100)),
        ("s3://b/p", "myrun", 3, ("s3://b/p", "myrun", 3)),
    ],
)
def test_parse_checkpoint_url(url, run, step, want):
    assert parse_checkpoint_url(url, run=run, step=step) == want


@pytest.mark.parametrize(
    ("url", "step", "match"),
    [
        ("s3://bucket", None, "expected <store>/<run>"),
        ("s3://run/step-00000001", None, "needs <store>/<run>/step-<n>"),
        ("/c/r/step-00000002", 3, "contradicts"),
    ],
)
def test_parse_checkpoint_url_errors(url, step, match):
    with pytest.raises(ExportError, match=match):
        parse_checkpoint_url(url, run=None, step=step)


# ------------------------------------------------------------------------------------------------ errors


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    msg = err.strip()
    assert exc.value.code == 2 and msg.startswith("dflash-export: error: ") and "\n" not in msg, msg
    assert "Traceback" not in err
    return msg


def test_cli_errors_are_one_line(tmp_path, config, target, capsys):
    assert "no checkpoint" in _error(capsys, [str(tmp_path / "nothing" / "r1"), str(tmp_path / "o")])
    store = _save(tmp_path, _trained_like(config, target), config)
    assert "step-00000099" in _error(capsys, [store, str(tmp_path / "o"), "--run", "r1", "--step", "99"])
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    assert "--overwrite" in _error(capsys, [f"{store}/r1", str(tmp_path / "busy")])
    assert main([f"{store}/r1", str(tmp_path / "busy"), "--overwrite"]) == 0
    assert not (tmp_path / "busy" / "x").exists()


def test_weights_that_do_not_fit_the_config_are_refused(tmp_path, config, target):
    state = _trained_like(config, target).state_dict()
    with pytest.raises(ExportError, match="missing"):
        export_drafter({k: v for k, v in state.items() if k != "norm.weight"}, config, tmp_path / "a")
    bad = dict(state, **{"fc.weight": torch.zeros(256, 256)})
    with pytest.raises(ExportError, match="fc.weight: shape"):
        export_drafter(bad, config, tmp_path / "b")
    compiled = {f"_orig_mod.{k}": v for k, v in state.items()}  # torch.compile's prefix is dropped
    export_drafter(compiled, config, tmp_path / "c")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ------------------------------------------------------------------------------------- serving


def test_the_export_ships_the_drafter_module_as_remote_code(tmp_path, config, target):
    """dflash.py is the project's drafter module byte for byte, and auto_map points at its model class."""
    from pathlib import Path

    from dflash.common.drafter import dflash as drafter_module

    out = export_drafter(_trained_like(config, target).state_dict(), config, tmp_path / "out")
    assert (out / CODE_FILE).read_bytes() == Path(drafter_module.__file__).read_bytes()
    cfg = json.loads((out / CONFIG_FILE).read_text())
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert "is_causal" not in cfg and cfg["use_sliding_window"] is False and cfg["sliding_window"] is None
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["max_window_layers"] == 2


def test_sliding_layers_round_trip_through_the_exported_config(tmp_path, config):
    import dataclasses

    from transformers import Qwen3Config

    sliding = dataclasses.replace(
        config, layer_types=["sliding_attention", "full_attention"], sliding_window=48
    )
    cfg = export_config(sliding, torch.bfloat16)
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert cfg["sliding_window"] == 48 and cfg["use_sliding_window"] is True
    assert drafter_config_from_export(cfg) == sliding
    (tmp_path / CONFIG_FILE).write_text(json.dumps(cfg))
    hf = Qwen3Config.from_pretrained(tmp_path)  # what vLLM and SGLang load it through: the window survives
    assert hf.sliding_window == 48 and hf.layer_types == cfg["layer_types"]
    # a config that drops use_sliding_window (as Qwen3Config then drops the window) is not a sliding drafter
    with pytest.raises(ExportError, match="sliding_window"):
        drafter_config_from_export({**cfg, "use_sliding_window": False})


def test_tokenizer_files_come_from_the_target(tmp_path, config, target, caplog):
    """The recorded target folder's tokenizer files are copied; a target that is not a folder here is said
    in one line and the export goes on without them; --target names the folder instead."""
    import logging

    from dflash.tools.demo.assets import tiny_target_dir

    model = _trained_like(config, target)
    store = _save(tmp_path / "a", model, config, target=str(tiny_target_dir()))
    assert main([f"{store}/r1", str(tmp_path / "with")]) == 0
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= {
        p.name for p in (tmp_path / "with").iterdir()
    }
    assert (tmp_path / "with" / "tokenizer.json").read_bytes() == (
        tiny_target_dir() / "tokenizer.json"
    ).read_bytes()

    store = _save(tmp_path / "b", model, config, target="Org/hub-only-target")
    with caplog.at_level(logging.WARNING):
        assert main([f"{store}/r1", str(tmp_path / "without")]) == 0
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "Org/hub-only-target" in said[0] and "tokenizer files not copied" in said[0]
    assert sorted(p.name for p in (tmp_path / "without").iterdir()) == [CONFIG_FILE, CODE_FILE, WEIGHTS_FILE]
    assert main([f"{store}/r1", str(tmp_path / "flag"), "--target", str(tiny_target_dir())]) == 0
    assert (tmp_path / "flag" / "tokenizer.json").is_file()
