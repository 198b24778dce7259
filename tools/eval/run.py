"""``dflash-eval --drafter DIR``: decode held-out prompts draft -> verify against the target and report τ,
acceptance per position and (with ``--baseline``) the speed-up over plain decoding.

The decoding itself is the drafter's one implementation (common/drafter/dflash.py: ``speculative_generate``,
the same loop as the exported ``spec_generate``); this module loads the target, the prompts and the
exported drafter, and prints the report.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash.common.cli.exits import fail
from dflash.common.cli.logs import log_to_console
from dflash.common.drafter.dflash import (
    DrafterProposer,
    Sampling,
    TargetRunner,
    check_decodable,
    greedy_generate,
    plain_generate,
    speculative_generate,
)
from dflash.common.drafter.hf_format import ExportError, read_export_config
from dflash.common.drafter.report import EvalReport, summarize
from dflash.common.target.attach import load_exported_drafter
from dflash.common.target.checks import check_target
from dflash.common.target.data import DataConfig, DataError, load_raw_dataset
from dflash.common.target.head import target_fingerprint
from dflash.tools.eval.config import PROG, EvalConfig

log = logging.getLogger(__name__)


def speedup_note(device: str) -> str:
    """What the wall-clock speed-up means on the device it was measured on (printed under it)."""
    if device.startswith("cuda"):
        return (
            "wall clock on this GPU, drafting and verifying included; tau is the part that carries over "
            "to a serving engine (vLLM, SGLang), whose kernels and batching set the rest"
        )
    return (
        "wall clock on the CPU: below 1x is expected here. Speculation pays when the target's forward is "
        "far costlier than the drafter's and costs about the same for 1 or B tokens (a large model on a "
        "GPU, memory-bound); on a CPU a verify of B tokens costs about B single steps and a small target "
        "costs little more than its drafter. tau (tokens per verify step) is the device-independent figure"
    )


def format_table(r: EvalReport, device: str = "cpu") -> str:
    rows = [
        ("prompts", f"{r.prompts}"),
        ("generated tokens", f"{r.generated_tokens}"),
        ("verify steps", f"{r.verify_steps}"),
        ("decoding", "greedy" if not r.sampling else ", ".join(f"{k} {v}" for k, v in r.sampling.items())),
        ("tau (tokens / verify step)", f"{r.tau:.3f}"),
        ("target forwards / token", f"{r.target_forwards_per_token:.3f}"),
        ("wall time [s]", f"{r.wall_s:.2f}"),
        ("tokens / s", f"{r.tokens_per_s:.1f}"),
    ]
    if r.baseline:
        rows += [
            ("baseline tokens / s", f"{r.baseline['tokens_per_s']:.1f}"),
            ("speedup", f"{r.baseline['speedup']:.2f}x"),
        ]
        if r.baseline["mismatched_prompts"] is not None:  # greedy only: sampled outputs differ by chance
            rows.append(("prompts differing from greedy", f"{r.baseline['mismatched_prompts']}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if r.baseline:
        lines.append(f"  (speedup: {speedup_note(device)})")
    lines.append("acceptance by block position (k: P[draft k accepted]):")
    lines.append("  " + "  ".join(f"{k}:{p:.2f}" for k, p in enumerate(r.accept_rate) if k > 0))
    return "\n".join(lines)


def _prompt_messages(row: dict) -> list[dict[str, str]] | None:
    """The conversation up to its first assistant turn: OpenAI `messages`, ShareGPT `conversations`, the
    public DFlash benchmark's `turns` (first turn) or a plain `prompt`/`text` string."""
    roles = {"human": "user", "gpt": "assistant", "chatgpt": "assistant"}
    # mixed-schema files fill absent columns with None
    turns = row.get("messages") or row.get("conversations")
    if isinstance(turns, list):
        msgs = []
        for t in turns:
            if not isinstance(t, dict):
                return None
            role = t.get("role") or t.get("from")
            role = roles.get(role, role)
            if role == "assistant":
                break
            content = t.get("content") if t.get("content") is not None else t.get("value")
            if role not in ("system", "user") or not isinstance(content, str):
                return None
            msgs.append({"role": role, "content": content})
        return msgs if any(m["role"] == "user" for m in msgs) else None
    if isinstance(row.get("turns"), list) and row["turns"] and isinstance(row["turns"][0], str):
        return [{"role": "user", "content": row["turns"][0]}]
    text = row.get("prompt") or row.get("text")
    return [{"role": "user", "content": text}] if isinstance(text, str) and text else None


def load_prompts(
    dataset: str, tokenizer: Any, *, num_prompts: int, max_prompt_tokens: int | None = None
) -> list[torch.Tensor]:
    """The first `num_prompts` usable rows as token ids (chat template + generation prompt). Rows without a
    user turn, or longer than `max_prompt_tokens`, are skipped (counted in the log)."""
    ds = load_raw_dataset(DataConfig(dataset=dataset))
    prompts, skipped = [], 0
    for row in ds:
        if len(prompts) >= num_prompts:
            break
        if "_raw_json" in row:  # rows of mixed types, stored as JSON text (producer.data)
            row = json.loads(row["_raw_json"])
        msgs = _prompt_messages(row)
        if msgs is None:
            skipped += 1
            continue
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                msgs, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        else:
            ids = tokenizer("\n".join(m["content"] for m in msgs))["input_ids"]
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        prompts.append(torch.tensor(ids, dtype=torch.long))
    if skipped:
        log.info("skipped %d rows (no user turn, or prompt too long)", skipped)
    if not prompts:
        raise ValueError(f"dataset {dataset}: no usable prompts")
    return prompts


def stop_tokens(tokenizer: Any, model: nn.Module) -> list[int]:
    ids = set()
    for value in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(model.generation_config, "eos_token_id", None),
    ):
        if value is not None:
            ids.update(value if isinstance(value, list) else [value])
    return sorted(int(i) for i in ids)


def evaluate(
    target: nn.Module,
    drafter: nn.Module,
    prompts: Sequence[torch.Tensor],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    block_size: int | None = None,
    baseline: bool = False,
    sampling: Sampling | None = None,
) -> EvalReport:
    """Decode every prompt with `drafter` (and, with `baseline`, without it) -> the report. `target` and
    `drafter` are ready on one device, in eval mode; prompts are token ids [P] each. `sampling` (None:
    greedy) applies to both decodes; its generator makes a sampled evaluation repeatable."""
    runner = TargetRunner(target, drafter.config.target_layer_ids)
    proposer = DrafterProposer(drafter)
    block = block_size or proposer.block_size
    try:
        # untimed warm-up: the first CUDA calls pay for kernel loading and cuBLAS/allocator setup (greedy:
        # it must not draw from the sampling generator)
        speculative_generate(
            runner, proposer, prompts[0], max_new_tokens=min(8, max_new_tokens), block_size=block
        )
        greedy_generate(runner, prompts[0], max_new_tokens=min(8, max_new_tokens))
        kw = {"max_new_tokens": max_new_tokens, "stop_token_ids": stop_token_ids, "sampling": sampling}
        gens = [speculative_generate(runner, proposer, p, block_size=block, **kw) for p in prompts]
        base = [plain_generate(runner, p, **kw) for p in prompts] if baseline else None
    finally:
        runner.close()
    return summarize(gens, block, base, sampling=sampling)


def resolve_device(cfg: EvalConfig) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) from --device / --dtype (auto: CUDA when there is one); ValueError, one line."""
    device = torch.device(
        cfg.device if cfg.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {cfg.device}: no CUDA device available")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(
        cfg.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    return device, dtype


def load_target(
    cfg: EvalConfig, device: torch.device, dtype: torch.dtype
) -> tuple[Any, nn.Module, list[torch.Tensor]]:
    """(tokenizer, target in eval mode on `device`, the held-out prompts as token ids)."""
    tokenizer = AutoTokenizer.from_pretrained(cfg.target)
    target = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=dtype).to(device).eval()
    check_decodable(target)  # a cache family whose state a verify cannot roll back: one line, exit 2
    prompts = load_prompts(
        cfg.dataset, tokenizer, num_prompts=cfg.num_prompts, max_prompt_tokens=cfg.max_prompt_tokens
    )
    return tokenizer, target, prompts


def evaluate_with(
    cfg: EvalConfig, target: nn.Module, tokenizer: Any, drafter: nn.Module, prompts: list
) -> EvalReport:
    """`evaluate` with the decoding settings: what every ``dflash-eval`` mode (one drafter, --watch) runs."""
    return evaluate(
        target,
        drafter,
        prompts,
        max_new_tokens=cfg.max_new_tokens,
        stop_token_ids=[] if cfg.ignore_eos else stop_tokens(tokenizer, target),
        block_size=cfg.block_size,
        baseline=cfg.baseline,
        sampling=sampling_of(cfg, drafter.fc.weight.device),
    )


def sampling_of(cfg: EvalConfig, device: torch.device) -> Sampling | None:
    """--temperature/--top-p/--draft-sampling/--seed as a Sampling (None: greedy), its generator seeded on
    the decode's device, fresh for every evaluation: the same flags give the same draws."""
    if not cfg.sampled:
        return None
    generator = torch.Generator(device).manual_seed(cfg.seed)
    return Sampling(
        temperature=cfg.temperature, top_p=cfg.top_p, draft=cfg.draft_sampling, generator=generator
    )


def check_same_target(cfg: EvalConfig, target: nn.Module, drafter_config) -> None:
    """The target's weights are those the drafter was trained with (the fingerprint of its embedding and
    lm_head recorded at training, common/target/head.py), else ExportError, or one warning with --force. A
    drafter with no recorded fingerprint (older checkpoints, public drafters) is not checked."""
    want = getattr(drafter_config, "target_fingerprint", None)
    if not want:
        return
    got = target_fingerprint(target)
    if got == want:
        return
    text = (
        f"--target {cfg.target}: its weights are not those the drafter was trained with (embedding/lm_head "
        f"fingerprint {got}, the drafter records {want}): another model of the same shape"
    )
    if not cfg.force:
        raise ExportError(text + "; evaluate the target it was trained on, or pass --force")
    log.warning("%s; evaluating anyway (--force): acceptance will be low", text)


def run(cfg: EvalConfig) -> int:
    """``dflash-eval --drafter DIR``: decode, print the table (and JSON); exit 2 on a user error."""
    log_to_console("eval")
    try:
        device, dtype = resolve_device(cfg)
        check_target(cfg.target, what="--target")
        read_export_config(cfg.drafter)  # a wrong folder fails before the target is loaded
        tokenizer, target, prompts = load_target(cfg, device, dtype)
        drafter = load_exported_drafter(cfg.drafter, target, device=device, dtype=dtype)
        check_same_target(cfg, target, drafter.config)
        report = evaluate_with(cfg, target, tokenizer, drafter, prompts)
    except (ExportError, DataError, ValueError, OSError) as err:
        fail(PROG, err)
    print(format_table(report, str(device)))
    if cfg.json:
        text = json.dumps(
            {
                **asdict(report),
                "target": cfg.target,
                "drafter": cfg.drafter,
                "device": str(device),
                "dtype": str(dtype).removeprefix("torch."),
                "max_new_tokens": cfg.max_new_tokens,
            },
            indent=2,
        )
        if cfg.json == "-":
            print(text)
        else:
            Path(cfg.json).write_text(text + "\n")
    return 0
