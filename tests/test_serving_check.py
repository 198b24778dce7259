"""``dflash-export --check``: our exports pass for vLLM, SGLang and transformers; a folder with one field
removed or wrong fails with that field named and exit 2 (docs/export-and-eval.md, "What each loader reads")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.common.drafter.config import DrafterConfig
from dflash.common.drafter.hf_format import CODE_FILE, CONFIG_FILE, WEIGHTS_FILE, export_drafter
from dflash.common.drafter.model import DFlashDrafter
from dflash.common.drafter.serving_check import HF, SGLANG, VLLM, check_folder
from dflash.tools.demo.assets import build_tiny_target, tiny_target_dir
from dflash.tools.export.cli import main

SLIDING = ["sliding_attention", "full_attention"]


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """Our exports of a full-attention and a sliding-window drafter, with the target's tokenizer files."""
    target = build_tiny_target()
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for name, kw in (("full", {}), ("sliding", {"layer_types": SLIDING, "sliding_window": 32})):
        config = DrafterConfig.from_target_config(
            target.config, num_layers=2, block_size=8, mask_token_id=3, **kw
        )
        torch.manual_seed(0)
        out[name] = export_drafter(
            DFlashDrafter(config).state_dict(), config, root / name, tokenizer_dir=tiny_target_dir()
        )
    return out


def _copy(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / CONFIG_FILE).read_text())
    for key, value in config_changes.items():
        where, _, name = key.rpartition("__")
        holder = cfg[where] if where else cfg
        if value is _DROP:
            del holder[name]
        else:
            holder[name] = value
    (dst / CONFIG_FILE).write_text(json.dumps(cfg))
    return dst


_DROP = object()


def _check(capsys, folder: Path) -> tuple[int, str]:
    code = main(["--check", str(folder)])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("name", ["full", "sliding"])
def test_our_exports_pass_for_every_loader(exports, capsys, name):
    code, out = _check(capsys, exports[name])
    assert code == 0, out
    assert "error" not in out
    assert "vLLM: ok" in out and '"num_speculative_tokens": 7' in out
    assert "SGLang: ok" in out and "--speculative-num-draft-tokens 8" in out
    assert "transformers: ok" in out
    if name == "sliding":
        assert "VLLM_USE_V2_MODEL_RUNNER=1" in out  # a note on the mixed layout, not an error


@pytest.mark.parametrize(
    ("export", "change", "field", "loaders"),
    [
        ("full", {"dflash_config__mask_token_id": _DROP}, "dflash_config.mask_token_id", (VLLM, SGLANG, HF)),
        (
            "full",
            {"dflash_config__target_layer_ids": _DROP},
            "dflash_config.target_layer_ids",
            (VLLM, SGLANG, HF),
        ),
        ("full", {"block_size": _DROP, "dflash_config__block_size": _DROP}, "block_size", (VLLM, SGLANG, HF)),
        ("full", {"block_size": _DROP}, "block_size", (HF,)),
        ("full", {"block_size": 4}, "block_size", (VLLM, SGLANG, HF)),  # top level != dflash_config
        ("full", {"num_target_layers": _DROP}, "num_target_layers", (HF,)),
        ("full", {"hidden_size": _DROP}, "hidden_size", (VLLM, SGLANG, HF)),
        ("full", {"rope_theta": _DROP, "rope_parameters": _DROP}, "rope_theta", (VLLM, SGLANG, HF)),
        ("full", {"auto_map": _DROP}, "auto_map", (HF,)),
        ("full", {"architectures": ["Qwen3ForCausalLM"]}, "architectures", (VLLM, SGLANG)),
        ("full", {"is_causal": False}, "is_causal", (VLLM, SGLANG)),
        ("full", {"hidden_act": "gelu"}, "hidden_act", (VLLM, SGLANG)),
        ("full", {"dflash_config__mask_token_id": 4096}, "dflash_config.mask_token_id", (VLLM, SGLANG, HF)),
        ("sliding", {"sliding_window": _DROP}, "sliding_window", (VLLM, SGLANG, HF)),
        ("sliding", {"use_sliding_window": False}, "use_sliding_window", (VLLM, SGLANG, HF)),
        ("sliding", {"layer_types": ["sliding_attention"]}, "layer_types", (VLLM, SGLANG, HF)),
        ("sliding", {"dflash_config__swa_window_size": 64}, "dflash_config.swa_window_size", (VLLM, SGLANG)),
    ],
)
def test_a_missing_or_wrong_field_is_named(exports, tmp_path, capsys, export, change, field, loaders):
    folder = _copy(exports[export], tmp_path / "bad", **change)
    code, out = _check(capsys, folder)
    assert code == 2, out
    errors = [line for line in out.splitlines() if line.strip().startswith("error")]
    assert any(f"] {field}:" in line and all(ld in line for ld in loaders) for line in errors), out
    for loader in (VLLM, SGLANG, HF):
        verdict = next(line for line in out.splitlines() if line.startswith(f"{loader}: "))
        assert (field in verdict) == (loader in loaders), verdict  # each loader's verdict names it, or is ok
        assert verdict.endswith("ok") or "would miss" in verdict or "ok (" in verdict


def _rewrite_weights(folder: Path, edit) -> None:
    state = load_file(str(folder / WEIGHTS_FILE))
    save_file(edit(state), str(folder / WEIGHTS_FILE))


@pytest.mark.parametrize(
    ("edit", "field", "says"),
    [
        (lambda s: {f"model.{k}": v for k, v in s.items()}, "tensor names", "model.model"),
        (lambda s: {k: v for k, v in s.items() if k != "layers.1.mlp.up_proj.weight"}, "tensors", "missing"),
        (lambda s: {**s, "layers.0.self_attn.q_proj.bias": torch.zeros(256)}, "tensors", "unexpected"),
        (lambda s: {**s, "fc.weight": torch.zeros(256, 256)}, "tensor shapes", "fc.weight"),
        (lambda s: {**s, "mask_hidden": torch.zeros(256)}, "mask_hidden", "asserts"),
    ],
)
def test_wrong_tensors_are_named(exports, tmp_path, capsys, edit, field, says):
    folder = _copy(exports["full"], tmp_path / "bad")
    _rewrite_weights(folder, edit)
    code, out = _check(capsys, folder)
    assert code == 2 and f"] {field}:" in out and says in out, out


def test_files_the_loaders_need(exports, tmp_path, capsys):
    no_code = _copy(exports["full"], tmp_path / "no-code")
    (no_code / CODE_FILE).unlink()
    code, out = _check(capsys, no_code)
    assert code == 2 and f"] {CODE_FILE}:" in out and "SGLang: ok" in out and "vLLM: ok" in out, out
    no_weights = _copy(exports["full"], tmp_path / "no-weights")
    (no_weights / WEIGHTS_FILE).unlink()
    code, out = _check(capsys, no_weights)
    assert code == 2 and f"] {WEIGHTS_FILE}:" in out, out
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out = _check(capsys, empty)
    assert code == 2 and f"] {CONFIG_FILE}: missing" in out


def test_a_tokenizer_whose_mask_token_has_another_id_fails_for_sglang(exports, tmp_path, capsys):
    """SGLang refuses a dflash_config.mask_token_id that differs from the tokenizer's '<|MASK|>' id."""
    folder = _copy(exports["full"], tmp_path / "tok")
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["added_tokens"].append(
        {
            "id": 17,
            "content": "<|MASK|>",
            "special": True,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
        }
    )
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    code, out = _check(capsys, folder)
    assert code == 2, out
    assert "SGLang: would miss 1: dflash_config.mask_token_id" in out and "vLLM: ok" in out


def test_a_public_style_folder_without_remote_code_fails_only_for_transformers(exports, tmp_path, capsys):
    """The layout of the public Qwen3 drafters' config.json (transformers-4 fields: rope_theta, top-level
    block_size only, no auto_map): served by vLLM and SGLang, not by AutoModel(trust_remote_code)."""
    folder = _copy(
        exports["full"],
        tmp_path / "public",
        auto_map=_DROP,
        rope_parameters=_DROP,
        dflash_config__block_size=_DROP,
        layer_types=_DROP,
        use_sliding_window=_DROP,
        sliding_window=_DROP,
    )
    (folder / CODE_FILE).unlink()
    report = check_folder(folder)
    assert report.missed_by(VLLM) == [] and report.missed_by(SGLANG) == []
    assert [f.field for f in report.missed_by(HF)] == ["auto_map"]
    assert main(["--check", str(folder)]) == 2
    capsys.readouterr()


def test_check_takes_no_checkpoint(exports, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--check", str(exports["full"]), "some/ckpt", "out"])
    assert exc.value.code == 2 and "takes no CHECKPOINT" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2 and "CHECKPOINT and OUT_DIR" in capsys.readouterr().err


def test_check_against_the_target(exports, tmp_path, capsys):
    """--target DIR: the folder is also compared with the target (width, layers, vocabulary) and the
    target's own tokenizer decides SGLang's mask-token check."""
    code = main(["--check", str(exports["full"]), "--target", str(tiny_target_dir())])
    out = capsys.readouterr().out
    assert code == 0, out
    other = tmp_path / "other-target"
    shutil.copytree(tiny_target_dir(), other)
    cfg = json.loads((other / CONFIG_FILE).read_text())
    cfg.update(hidden_size=512, num_hidden_layers=4)
    (other / CONFIG_FILE).write_text(json.dumps(cfg))
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["added_tokens"].append(
        {
            "id": 9,
            "content": "<|MASK|>",
            "special": True,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
        }
    )
    (other / "tokenizer.json").write_text(json.dumps(tok))
    assert main(["--check", str(exports["full"]), "--target", str(other)]) == 2
    out = capsys.readouterr().out
    for field in (
        "hidden_size",
        "num_target_layers",
        "dflash_config.target_layer_ids",
        "dflash_config.mask_token_id",
    ):
        assert f"] {field}:" in out, (field, out)
