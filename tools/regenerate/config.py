"""``dflash-regenerate``'s configuration (``RegenerateConfig``): which target answers (a model run here, or
an OpenAI-compatible server), which rows, the sampling settings, and how a long run is kept. The single
source of the command's flags (dflash.common.cli.flags); library code gets this, never an
``argparse.Namespace``. Standard library only: the CLI imports it before parsing."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dflash.common.cli.flags import check_choices, flag

PROG = "dflash-regenerate"
"""The program name every error line of this tool starts with."""

SETTINGS = (
    "dataset",
    "split",
    "format",
    "temperature",
    "top_p",
    "max_new_tokens",
    "thinking",
    "seed",
    "on_length",
)
"""Recorded with the output (``<out>.settings.json``): a re-run continues a file only under equal ones, so
one output never mixes answers made two ways, nor rows of two datasets under one row index. The engine is
recorded too but may change (greedy answers are the same text from either)."""

ChatFormat = Literal["auto", "openai", "sharegpt"]
Thinking = Literal["auto", "on", "off"]
Api = Literal["completions", "chat"]
OnLength = Literal["keep", "drop"]
Dtype = Literal["auto", "bfloat16", "float16", "float32"]


@dataclass(kw_only=True)
class RegenerateConfig:
    """One regeneration: the engine (``model`` here, or ``endpoint``), the dataset in and out, sampling."""

    model: str | None = field(default=None, metadata=flag(metavar="PATH"))
    """the target (folder or hub id), run here with transformers generate (or --endpoint)"""
    endpoint: str | None = field(default=None, metadata=flag(metavar="URL"))
    """an OpenAI-compatible server running the target (vLLM, SGLang, transformers serve): the base URL
    the API paths (/models, /completions) go under, used as given, e.g. http://127.0.0.1:8000/v1 or a
    gateway's https://host/openai/v2; a bare server address (http://127.0.0.1:8000) gets /v1 (or
    --model)"""
    dataset: str
    """chat rows in any format dflash-produce reads: hub name, .json/.jsonl/.parquet/.arrow file or folder,
    or save_to_disk folder"""
    out: str = field(metadata=flag(metavar="OUT.jsonl"))
    """the regenerated rows (JSONL, OpenAI messages; dflash-produce reads it as it is); a re-run of the same
    command continues it"""
    split: str = "train"
    """dataset split (hub datasets and save_to_disk DatasetDicts)"""
    format: ChatFormat = "auto"
    """conversation format: openai (messages [{role, content}]), sharegpt (conversations [{from, value}]),
    or auto"""
    limit: int | None = None
    """only the first N rows of the dataset (default: all rows)"""
    max_new_tokens: int = 4096
    """tokens the target may write per assistant turn (its reasoning included)"""
    temperature: float = 0.0
    """0: greedy; > 0: sampled"""
    top_p: float = 1.0
    """with --temperature: sample from the smallest set of tokens whose probability reaches top-p"""
    seed: int = 0
    """random seed of the sampling (sent to the server as ``seed``)"""
    thinking: Thinking = "auto"
    """the chat template's thinking switch (enable_thinking): on, off, or auto (the template's default)"""
    on_length: OnLength = "keep"
    """a row with a turn that hit --max-new-tokens: keep it (the cut answer, counted) or drop it (counted
    as skipped)"""
    gpus: str = "auto"
    """with --model: 0-3, 0,2,5 or cpu: one copy of the target per GPU (as dflash-produce --gpus); auto:
    every visible GPU, else the CPU"""
    batch_size: int = 32
    """with --model: prompts per generate call (sorted by length, so a batch pads little)"""
    dtype: Dtype = "auto"
    """with --model: auto = bfloat16 on GPUs, float32 on the CPU"""
    api: Api = "completions"
    """with --endpoint: completions (the prompt rendered here by the target's own chat template, the
    answer's reasoning and tool calls parsed here: the context the producer trains from, token for token)
    or chat (/v1/chat/completions: the server renders, its reasoning and tool parsers split the answer)"""
    tokenizer: str | None = field(default=None, metadata=flag(metavar="PATH"))
    """with --endpoint --api completions: the target's tokenizer (folder or hub id; default: the served
    model's name)"""
    served_model: str | None = field(default=None, metadata=flag(metavar="NAME"))
    """with --endpoint: the model name sent with each request (default: the server's first model)"""
    concurrency: int = 16
    """with --endpoint: requests in flight at once"""
    retries: int = 3
    """with --endpoint: tries after the first for a request that failed (connection error, timeout, HTTP
    429 or 5xx), with doubling waits"""
    retry_wait_s: float = 1.0
    """with --endpoint: the wait before the first retry (doubling after each)"""
    timeout_s: float = 600.0
    """with --endpoint: seconds one request may take"""
    max_connection_failures: int = field(default=32, metadata=flag(metavar="N"))
    """with --endpoint: stop the run (exit 1, one line naming the endpoint; the same command continues)
    after this many tries in a row got no answer from the server: connection refused, reset or cut
    short, no answer within --timeout-s, HTTP 502 or 504. A dead server stops the run within seconds, a
    hanging one within about ceil(N / --concurrency) x --timeout-s"""
    progress_s: float = 10.0
    """seconds between progress lines (kept while turns are out, however long they take)"""

    def __post_init__(self) -> None:
        check_choices(self)
        if (self.model is None) == (self.endpoint is None):
            raise ValueError("give exactly one of --model PATH or --endpoint URL")
        if not self.out:
            raise ValueError("--out must not be empty")
        for name in ("max_new_tokens", "batch_size", "concurrency", "max_connection_failures"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")
        if self.retries < 0:
            raise ValueError(f"--retries must be >= 0, got {self.retries}")
        for name in ("retry_wait_s", "timeout_s", "progress_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")

    @property
    def sampled(self) -> bool:
        """Sampling, not greedy (the threshold dflash-eval uses)."""
        return self.temperature >= 1e-5

    def template_kwargs(self) -> dict:
        """What the chat template is given besides the messages: the thinking switch, when set."""
        return {} if self.thinking == "auto" else {"enable_thinking": self.thinking == "on"}

    def settings(self) -> dict:
        """What made the answers: recorded with the output, compared on a re-run."""
        out = {name: getattr(self, name) for name in SETTINGS}
        local = Path(self.dataset).expanduser()
        if local.exists():  # the same file however it is named on the command line
            out["dataset"] = str(local.resolve())
        out["engine"] = f"model {self.model}" if self.model is not None else f"endpoint ({self.api})"
        return out
