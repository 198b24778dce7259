"""``dflash-export --check FOLDER``: would vLLM, SGLang and transformers load this drafter folder as trained?

Each check below is one row of docs/export-and-eval.md "What each loader reads" (from the public loaders'
source: vLLM ``qwen3_dflash.py`` + ``spec_decode/dflash.py``, SGLang ``dflash_utils.py`` + ``models/dflash.py``
+ ``dflash_worker.py``, the z-lab reference ``DFlashDraftModel``). A finding names the field, what is wrong
and the loaders it breaks. Fatal findings are what a loader would refuse or, worse, read differently
from training without a word (a missing ``mask_token_id`` makes SGLang pick or add ``<|MASK|>``; a
missing ``rope_theta`` makes vLLM rotate with 1e6; a dropped ``sliding_window`` makes the z-lab reference
run every layer full); notes are what a user should know to serve it. Works on any folder, ours or anyone's:
it reads config.json, the tokenizer files and the safetensors headers, never the tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import safe_open

from dflash.common.drafter.hf_format import (
    AUTO_MAP,
    CLASS_NAMES,
    CODE_FILE,
    CONFIG_FILE,
    WEIGHTS_FILE,
    ExportError,
    drafter_config_from_export,
    expected_shapes,
)
from dflash.common.drafter.layers import FULL, SLIDING

VLLM, SGLANG, HF = "vLLM", "SGLang", "transformers"
LOADERS = (VLLM, SGLANG, HF)
SGLANG_DEFAULT_MASK_TOKEN = "<|MASK|>"
REQUIRED_SHAPE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
)
"""Read by every loader, with a Qwen3Config default when absent: a missing one is silently another model."""


@dataclass(frozen=True)
class Finding:
    loaders: tuple[str, ...]
    field: str
    problem: str
    fatal: bool = True

    def line(self) -> str:
        kind = "error" if self.fatal else "note"
        return f"{kind} [{', '.join(self.loaders)}] {self.field}: {self.problem}"


@dataclass
class CheckReport:
    folder: Path
    findings: list[Finding] = field(default_factory=list)
    block_size: int | None = None

    def add(self, loaders: tuple[str, ...] | str, name: str, problem: str, *, fatal: bool = True) -> None:
        self.findings.append(
            Finding((loaders,) if isinstance(loaders, str) else loaders, name, problem, fatal)
        )

    def missed_by(self, loader: str) -> list[Finding]:
        return [f for f in self.findings if f.fatal and loader in f.loaders]

    @property
    def ok(self) -> bool:
        return not any(f.fatal for f in self.findings)

    def render(self) -> str:
        """The report: one line per finding, then one verdict line per loader."""
        lines = [f"{self.folder}:"] + [f"  {f.line()}" for f in self.findings]
        serve = {
            VLLM: f'--speculative-config \'{{"method": "dflash", "model": "{self.folder}", '
            f'"num_speculative_tokens": {self.block_size - 1}}}\''
            if self.block_size
            else "",
            SGLANG: f"--speculative-algorithm DFLASH --speculative-draft-model-path {self.folder} "
            f"--speculative-num-draft-tokens {self.block_size}"
            if self.block_size
            else "",
            HF: "AutoModel.from_pretrained(FOLDER, trust_remote_code=True).spec_generate(...)",
        }
        for loader in LOADERS:
            missed = self.missed_by(loader)
            if missed:
                lines.append(
                    f"{loader}: would miss {len(missed)}: "
                    + ", ".join(dict.fromkeys(f.field for f in missed))
                )
            else:
                lines.append(f"{loader}: ok" + (f" ({serve[loader]})" if serve[loader] else ""))
        return "\n".join(lines)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_folder(path: str | Path, target: str | Path | None = None) -> CheckReport:
    """Every check of the serving contract on one folder (see the module docstring); with ``target`` (the
    target's folder) also against it: its width, layer count, vocabulary and tokenizer."""
    root = Path(path)
    report = CheckReport(folder=root)
    if not (root / CONFIG_FILE).is_file():
        report.add(LOADERS, CONFIG_FILE, "missing (not a drafter folder)")
        return report
    try:
        cfg = json.loads((root / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        report.add(LOADERS, CONFIG_FILE, f"invalid JSON ({err})")
        return report
    if not isinstance(cfg, dict):
        report.add(LOADERS, CONFIG_FILE, "not a JSON object")
        return report
    _check_identity(cfg, root, report)
    dflash = cfg.get("dflash_config")
    if not isinstance(dflash, dict):
        report.add(
            LOADERS, "dflash_config", "missing or not an object (mask token, target layers, block size)"
        )
        dflash = {}
    _check_shape_fields(cfg, report)
    _check_dflash_fields(cfg, dflash, report)
    _check_layout(cfg, dflash, report)
    has_tokenizer = target is not None and (Path(target) / "tokenizer.json").is_file()
    _check_mask_token(cfg, dflash, Path(target) if has_tokenizer else root, report)  # the target's decides
    if target is not None:
        _check_against_target(cfg, dflash, Path(target), report)
    _check_weights(cfg, root, report)
    return report


def _check_against_target(cfg: dict, dflash: dict, target: Path, report: CheckReport) -> None:
    """The drafter was trained for this target: same width (SGLang sizes fc from the draft's hidden size),
    a layer count that holds the captured layers, the same vocabulary and rope theta."""
    try:
        tcfg = json.loads((target / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        report.add(LOADERS, "target", f"{target / CONFIG_FILE} unreadable ({err}): not compared")
        return
    text = tcfg.get("text_config") if isinstance(tcfg.get("text_config"), dict) else tcfg
    for draft_key, target_key in (
        ("hidden_size", "hidden_size"),
        ("num_target_layers", "num_hidden_layers"),
        ("vocab_size", "vocab_size"),
    ):
        if (
            cfg.get(draft_key) is not None
            and text.get(target_key) is not None
            and cfg[draft_key] != text[target_key]
        ):
            report.add(
                LOADERS, draft_key, f"{cfg[draft_key]}, the target's {target_key} is {text[target_key]}"
            )
    ids, layers = dflash.get("target_layer_ids"), text.get("num_hidden_layers")
    if isinstance(ids, list) and _is_int(layers) and any(not (_is_int(i) and 0 <= i < layers) for i in ids):
        report.add((VLLM, SGLANG), "dflash_config.target_layer_ids", f"{ids}: the target has {layers} layers")
    params = text.get("rope_parameters") if isinstance(text.get("rope_parameters"), dict) else {}
    theta, mine = text.get("rope_theta", params.get("rope_theta")), cfg.get("rope_theta")
    if theta is not None and mine is not None and float(theta) != float(mine):
        report.add(LOADERS, "rope_theta", f"{mine}, the target's is {theta}", fatal=False)


def _check_identity(cfg: dict, root: Path, report: CheckReport) -> None:
    known = [[name] for name in CLASS_NAMES.values()]
    if cfg.get("architectures") not in known:
        report.add((VLLM, SGLANG), "architectures", f"{cfg.get('architectures')!r}, expected one of {known}")
    entry = (
        f"dflash.{cfg['architectures'][0]}" if cfg.get("architectures") in known else AUTO_MAP["AutoModel"]
    )
    if cfg.get("model_type") != "qwen3":
        report.add(
            LOADERS, "model_type", f"{cfg.get('model_type')!r}, expected 'qwen3' (loaded as a Qwen3Config)"
        )
    auto_map = cfg.get("auto_map")
    if auto_map is None:
        report.add(
            HF,
            "auto_map",
            "missing: AutoModel(trust_remote_code=True) gives a plain Qwen3Model, no spec_generate",
        )
    elif (auto_map or {}).get("AutoModel") != entry:
        report.add(HF, "auto_map", f"AutoModel is {auto_map.get('AutoModel')!r}, expected {entry!r}")
    elif not (root / CODE_FILE).is_file():
        report.add(HF, CODE_FILE, "missing: auto_map points at a file the folder does not hold")


def _check_shape_fields(cfg: dict, report: CheckReport) -> None:
    for name in REQUIRED_SHAPE_FIELDS:
        if not isinstance(cfg.get(name), int | float) or isinstance(cfg.get(name), bool):
            report.add(
                LOADERS,
                name,
                f"{cfg.get(name)!r}: missing or not a number (the Qwen3Config default would be used)",
            )
    if cfg.get("hidden_act", "silu") != "silu":
        report.add(
            (SGLANG, VLLM), "hidden_act", f"{cfg.get('hidden_act')!r}: SGLang refuses anything but 'silu'"
        )
    if cfg.get("attention_bias", False):
        report.add(
            LOADERS,
            "attention_bias",
            "true: the drafter has no bias tensors (vLLM/SGLang would build q/k/v/o biases)",
        )
    theta = cfg.get("rope_theta")
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    if theta is None and "rope_theta" not in params:
        report.add(
            LOADERS, "rope_theta", "missing (and no rope_parameters.rope_theta): vLLM would rotate with 1e6"
        )
    elif theta is not None and "rope_theta" in params and float(theta) != float(params["rope_theta"]):
        report.add(
            LOADERS,
            "rope_theta",
            f"{theta} != rope_parameters.rope_theta {params['rope_theta']}: readers disagree",
        )
    elif theta is None:
        report.add(
            HF,
            "rope_theta",
            "only in rope_parameters: transformers-4 era readers (z-lab MLX) need the top level",
            fatal=False,
        )


def _check_dflash_fields(cfg: dict, dflash: dict, report: CheckReport) -> None:
    ids = dflash.get("target_layer_ids")
    num_target = cfg.get("num_target_layers", dflash.get("num_target_layers"))
    if not (isinstance(ids, list) and ids and all(_is_int(i) for i in ids)):
        report.add(
            LOADERS, "dflash_config.target_layer_ids", f"{ids!r}: missing or not a non-empty list of ints"
        )
    elif _is_int(num_target) and not all(0 <= i < num_target for i in ids):
        report.add(
            LOADERS, "dflash_config.target_layer_ids", f"{ids} outside [0, num_target_layers={num_target})"
        )
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and isinstance(ids, list) and aux != [i + 1 for i in ids]:
        report.add(VLLM, "eagle_aux_hidden_state_layer_ids", f"{aux} != target_layer_ids + 1: vLLM raises")
    if not _is_int(cfg.get("num_target_layers")):
        report.add(
            HF, "num_target_layers", "missing at the top level: the z-lab DFlashDraftModel reads it at init"
        )
    top, nested = cfg.get("block_size"), dflash.get("block_size")
    if top is None and nested is None:
        report.add(LOADERS, "block_size", "missing (top level and dflash_config): SGLang would assume 16")
    elif top is not None and nested is not None and top != nested:
        report.add(
            LOADERS,
            "block_size",
            f"top level {top} != dflash_config.block_size {nested}: SGLang reads the nested one, transformers the top one",
        )
    else:
        if top is None:
            report.add(
                HF,
                "block_size",
                "missing at the top level: the z-lab DFlashDraftModel reads config.block_size",
            )
        if nested is None:
            report.add(
                SGLANG, "dflash_config.block_size", "missing: SGLang falls back to the top level", fatal=False
            )
        size = nested if nested is not None else top
        if not _is_int(size) or size < 2:
            report.add(LOADERS, "block_size", f"{size!r}: must be an int >= 2")
        else:
            report.block_size = size
    for name, where in (("is_causal", cfg), ("causal", dflash), ("use_swa", dflash)):
        if name in where:
            label = name if where is cfg else f"dflash_config.{name}"
            report.add(
                (VLLM, SGLANG),
                label,
                "present: it overrides the per-layer rule (sliding causal, full non-causal) the drafter was trained with",
            )


def _check_layout(cfg: dict, dflash: dict, report: CheckReport) -> None:
    num_layers = cfg.get("num_hidden_layers")
    types = cfg.get("layer_types")
    if types is None:
        report.add(
            LOADERS, "layer_types", "absent: every loader assumes full attention in every layer", fatal=False
        )
        return
    if not isinstance(types, list) or len(types) != num_layers or set(types) - {FULL, SLIDING}:
        report.add(
            LOADERS, "layer_types", f"{types!r}: must be num_hidden_layers={num_layers} of {FULL}/{SLIDING}"
        )
        return
    window, swa = cfg.get("sliding_window"), dflash.get("swa_window_size")
    if SLIDING not in types:
        if window is not None and cfg.get("use_sliding_window"):
            report.add(LOADERS, "sliding_window", f"{window} with no sliding layer (unused)", fatal=False)
        return
    if not (_is_int(window) and window >= 1):
        report.add(
            LOADERS,
            "sliding_window",
            f"{window!r}: layers slide, so a positive int is needed (vLLM and SGLang raise)",
        )
    elif cfg.get("use_sliding_window") is not True:
        report.add(
            LOADERS,
            "use_sliding_window",
            "not true: transformers' Qwen3Config then drops sliding_window (vLLM and SGLang raise, the z-lab reference runs full attention)",
        )
    if swa is not None and swa != window:
        report.add(
            (VLLM, SGLANG),
            "dflash_config.swa_window_size",
            f"{swa} != sliding_window {window}: it overrides it",
        )
    if FULL in types:
        report.add(
            VLLM,
            "layer_types",
            "mixed sliding/full layers need vLLM's V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1)",
            fatal=False,
        )
    report.add(
        HF,
        "layer_types",
        "z-lab's own DFlashDraftModel runs sliding layers as a symmetric, non-causal window: "
        "load with trust_remote_code=True so that this folder's dflash.py runs them as trained",
        fatal=False,
    )


def _tokenizer_vocab(root: Path) -> dict[str, int] | None:
    """token -> id from the folder's tokenizer.json (model vocab and added tokens), None without one."""
    path = root / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    vocab = (
        dict(data.get("model", {}).get("vocab") or {})
        if isinstance(data.get("model", {}).get("vocab"), dict)
        else {}
    )
    for tok in data.get("added_tokens") or []:
        vocab[tok["content"]] = int(tok["id"])
    return vocab


def _check_mask_token(cfg: dict, dflash: dict, root: Path, report: CheckReport) -> None:
    """``root``: the folder whose tokenizer.json is checked (the target's when given, else the export's)."""
    mask = dflash.get("mask_token_id")
    vocab_size = cfg.get("vocab_size")
    if mask is None:
        report.add(
            LOADERS,
            "dflash_config.mask_token_id",
            "missing: vLLM raises, SGLang takes or adds '<|MASK|>' (not the trained token)",
        )
        return
    if not _is_int(mask) or mask < 0:
        report.add(LOADERS, "dflash_config.mask_token_id", f"{mask!r}: must be a non-negative int")
        return
    if _is_int(vocab_size) and mask >= vocab_size:
        report.add(LOADERS, "dflash_config.mask_token_id", f"{mask} >= vocab_size {vocab_size}")
    try:
        vocab = _tokenizer_vocab(root)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as err:
        report.add(
            SGLANG, "tokenizer.json", f"unreadable ({err}): the mask-token check was skipped", fatal=False
        )
        return
    name = dflash.get("mask_token", SGLANG_DEFAULT_MASK_TOKEN)
    if vocab is None:
        report.add(
            SGLANG,
            "tokenizer",
            f"no tokenizer.json (pass --target DIR): SGLang refuses if the target's tokenizer has {name!r} with an id other than {mask}",
            fatal=False,
        )
    elif name in vocab and vocab[name] != mask:
        report.add(
            SGLANG,
            "dflash_config.mask_token_id",
            f"{mask}, but the tokenizer has {name!r} = {vocab[name]}: SGLang refuses",
        )


def _weight_names_and_shapes(root: Path) -> dict[str, list[int]]:
    index = root / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else [WEIGHTS_FILE]
    )
    out = {}
    for name in files:
        with safe_open(str(root / name), framework="pt") as f:
            for key in f.keys():
                out[key] = list(f.get_slice(key).get_shape())
    return out


def _shape_config(cfg: dict) -> dict:
    """``cfg`` with what tensor shapes do not depend on filled in (mask token, block size, layer layout,
    a num_target_layers that holds the ids): a missing one is reported by its own check, and the shapes
    are still checked."""
    out = {k: v for k, v in cfg.items() if k not in ("layer_types", "sliding_window", "use_sliding_window")}
    dflash = dict(cfg["dflash_config"]) if isinstance(cfg.get("dflash_config"), dict) else {}
    ids = dflash.get("target_layer_ids")
    if isinstance(ids, list) and ids and all(_is_int(i) and i >= 0 for i in ids):
        known = out.get("num_target_layers")
        out["num_target_layers"] = max(known if _is_int(known) else 0, max(ids) + 1)
    out["dflash_config"] = {**dflash, "mask_token_id": 0, "block_size": 2}
    return out


def _check_weights(cfg: dict, root: Path, report: CheckReport) -> None:
    if not (root / WEIGHTS_FILE).is_file() and not (root / "model.safetensors.index.json").is_file():
        report.add(LOADERS, WEIGHTS_FILE, "missing (no model.safetensors or model.safetensors.index.json)")
        return
    try:
        have = _weight_names_and_shapes(root)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as err:
        report.add(LOADERS, WEIGHTS_FILE, f"unreadable ({err})")
        return
    prefixed = sorted(k for k in have if k.startswith("model."))
    if prefixed:
        report.add(
            (VLLM, HF),
            "tensor names",
            f"{len(prefixed)} start with 'model.' (e.g. {prefixed[0]}): vLLM would look for model.model.*",
        )
        have = {k.removeprefix("model."): v for k, v in have.items()}
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name in have:
            report.add(
                (VLLM, SGLANG),
                name,
                "present: SGLang ignores it (the target's is used), vLLM uses it unless equal to the target's",
                fatal=False,
            )
    if "mask_hidden" in " ".join(have):
        report.add(VLLM, "mask_hidden", "present: vLLM asserts there is none")
    try:
        want = expected_shapes(drafter_config_from_export(_shape_config(cfg)))
    except (ExportError, ValueError, TypeError, KeyError) as err:
        report.add(
            LOADERS, "tensors", f"not checked: the config does not describe a drafter ({err})", fatal=False
        )
        return
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want) - {"embed_tokens.weight", "lm_head.weight"})
    if missing:
        report.add(LOADERS, "tensors", f"{len(missing)} missing, e.g. {missing[:3]}")
    if extra:
        report.add(
            LOADERS,
            "tensors",
            f"{len(extra)} unexpected, e.g. {extra[:3]} (vLLM refuses, SGLang and transformers drop them)",
        )
    wrong = [
        f"{n} {have[n]} (config: {list(want[n])})"
        for n in sorted(set(want) & set(have))
        if have[n] != list(want[n])
    ]
    if wrong:
        report.add(LOADERS, "tensor shapes", f"{len(wrong)} differ from the config, e.g. {wrong[0]}")
