"""``dflash-eval``'s configuration: what one evaluation decodes (``EvalConfig``) and, with ``--watch``, which
checkpoint store it follows (``WatchConfig``). The single source of the command's flags
(dflash.common.cli.flags); library code gets these, never an ``argparse.Namespace``. Standard library only:
the CLI imports this before parsing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dflash.common.cli.flags import check_choices, flag

SETTINGS = ("target", "dataset", "num_prompts", "max_new_tokens", "max_prompt_tokens", "block_size")
"""The fields that change τ: watch records are compared (and reused) only under equal settings."""
SAMPLING_SETTINGS = ("temperature", "top_p", "draft_sampling", "seed")
"""Also change τ, but only when sampling: a greedy record keeps the settings it always had."""


PROG = "dflash-eval"
"""The program name every error line of this tool starts with."""


@dataclass(kw_only=True)
class EvalConfig:
    """One evaluation: the target, the drafter and the decoding settings."""

    target: str
    """target model folder or hub id (with tokenizer)"""
    drafter: str | None = None
    """dflash-export folder (or --watch a checkpoint store)"""
    dataset: str
    """prompts: .jsonl/.json/.parquet file or folder, or hub name"""
    num_prompts: int = 16
    """evaluate the first K usable rows"""
    max_new_tokens: int = 256
    """tokens to generate per prompt at most"""
    max_prompt_tokens: int = 4096
    """skip longer prompts"""
    block_size: int | None = None
    """draft block size (default: the drafter's)"""
    device: str = "auto"
    """cpu, cuda, cuda:N; auto: cuda when a CUDA device is available, else cpu"""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """auto: bfloat16 on CUDA, float32 on CPU"""
    ignore_eos: bool = False
    """always generate --max-new-tokens tokens"""
    baseline: bool = False
    """also run plain decoding (greedy, or sampled with --temperature): speedup; greedy: the lossless check"""
    temperature: float = 0.0
    """0: greedy; > 0: sample softmax(logits / T), drafts verified by lossless speculative rejection
    sampling"""
    top_p: float = 1.0
    """with --temperature: sample from the smallest set of tokens whose probability reaches top-p"""
    draft_sampling: Literal["greedy", "sample"] = "greedy"
    """with --temperature: drafts are the drafter's argmax (greedy: vLLM's and SGLang's default) or sampled
    from its distribution (sample)"""
    seed: int = 0
    """random seed of the sampling (--temperature > 0)"""
    json: str | None = field(default=None, metadata=flag(metavar="PATH"))
    """write the report as JSON ('-' = stdout; default: none)"""
    force: bool = False
    """evaluate even when the target's weights are not those the drafter was trained with (its recorded
    fingerprint differs): one warning line instead of the error"""

    def __post_init__(self) -> None:
        check_choices(self)
        for name in ("num_prompts", "max_new_tokens", "max_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"--block-size must be >= 2, got {self.block_size}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_p < 1 and not self.sampled:
            raise ValueError("--top-p needs --temperature > 0 (greedy decoding ignores it)")

    @property
    def sampled(self) -> bool:
        """Sampling, not greedy: the public code's threshold (dflash.common.drafter.dflash.Sampling.greedy)."""
        return self.temperature >= 1e-5

    def settings(self, dtype_name: str) -> dict:
        """What makes two evaluations comparable (dflash-eval --watch reuses records only under equal ones)."""
        out = {
            **{name: getattr(self, name) for name in SETTINGS},
            "ignore_eos": bool(self.ignore_eos),
            "dtype": dtype_name,
        }
        if self.sampled:
            out.update({name: getattr(self, name) for name in SAMPLING_SETTINGS})
        return out


@dataclass(kw_only=True)
class WatchConfig:
    """``--watch``: evaluate every checkpoint of a training run as it lands (tools/eval/watch.py)."""

    watch: str | None = field(default=None, metadata=flag(metavar="STORE"))
    """checkpoint store (folder or s3://) to watch"""
    run: str | None = None
    """run name in the store (required with --watch)"""
    poll_s: float = 30.0
    """seconds between looks for new checkpoints"""
    once: bool = False
    """evaluate the checkpoints there now, then exit"""
    run_dir: str | None = None
    """append one line per evaluation to RUN_DIR/metrics/eval.jsonl"""
