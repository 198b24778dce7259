"""The local engine: the target run here with transformers ``generate``, one copy per GPU of ``--gpus``
(as the producers would use them), prompts sorted by length and cut into batches, so a batch pads little.

Why a thread per GPU rather than a process: a regeneration is bound by the GPU's decoding, and the
copies share the tokenizer, the prompts and the one output file; each thread owns its copy and device.
A turn ends at the target's end-of-turn token ("stop") or at --max-new-tokens ("length"); its text is the
decode of the tokens before the end token (special tokens left out, as a server's decode does).
"""

from __future__ import annotations

import logging
import queue
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig

from dflash.common.target.checks import check_target
from dflash.common.target.loading import load_target
from dflash.producer.launch import parse_gpus
from dflash.tools.regenerate.config import RegenerateConfig
from dflash.tools.regenerate.engine import BatchEngine, EngineError
from dflash.tools.regenerate.reply import Reply, Request, TemplateError, opens_think, render_prompt

log = logging.getLogger(__name__)


def devices_of(spec: str) -> list[str]:
    """--gpus as torch devices: 'auto' = every visible GPU, else the CPU; 'cpu' (any cpu:N) = one CPU copy."""
    if spec == "auto":
        n = torch.cuda.device_count()
        return [f"cuda:{i}" for i in range(n)] or ["cpu"]
    try:
        devices = parse_gpus(spec)
    except ValueError as err:
        raise EngineError(str(err)) from None
    if devices[0][0] == "cpu":
        return ["cpu"]
    missing = [i for _, i in devices if i is None or i >= torch.cuda.device_count()]
    if missing:
        raise EngineError(
            f"--gpus {spec}: GPU {missing[0]} does not exist ({torch.cuda.device_count()} visible)"
        )
    return [f"cuda:{i}" for _, i in devices]


class LocalEngine(BatchEngine):
    """``complete(requests) -> replies`` on the target loaded here (module docstring), on a thread of its
    own (BatchEngine): the turns due while a batch generates make the next one."""

    def __init__(self, cfg: RegenerateConfig):
        self.cfg = cfg
        try:
            check_target(cfg.model)
        except ValueError as err:
            raise EngineError(str(err)) from None
        self.devices = devices_of(cfg.gpus)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        if not getattr(self.tokenizer, "chat_template", None):
            raise EngineError(f"target {cfg.model}: its tokenizer has no chat template")
        on_gpu = self.devices[0].startswith("cuda")
        dtype = (
            getattr(torch, cfg.dtype)
            if cfg.dtype != "auto"
            else (torch.bfloat16 if on_gpu else torch.float32)
        )
        self.replicas: queue.SimpleQueue = queue.SimpleQueue()
        for device in self.devices:
            model, info = load_target(cfg.model, dtype=dtype, device=device)
            self.replicas.put((model, device))
            log.info("target %s on %s (%s)", cfg.model, device, info.line())
        self.eos = _eos_ids(model, self.tokenizer)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos)
        self.generation = GenerationConfig(
            max_new_tokens=cfg.max_new_tokens,
            do_sample=cfg.sampled,
            temperature=cfg.temperature if cfg.sampled else None,
            top_p=cfg.top_p if cfg.sampled else None,
            top_k=0 if cfg.sampled else None,  # temperature and top-p only: transformers' default top-k is 50
            eos_token_id=sorted(self.eos),
            pad_token_id=self.pad,
        )
        torch.manual_seed(cfg.seed)
        self.window = cfg.batch_size * len(self.devices) * 4
        """Rows worked on at once: enough prompts per turn to fill every GPU's batches, sorted by length."""

    def complete(self, requests: list[Request]) -> list[Reply]:
        replies: list[Reply | None] = [None] * len(requests)
        prompts: dict[int, list[int]] = {}
        opened: dict[int, bool] = {}
        for i, req in enumerate(requests):
            try:
                text = render_prompt(self.tokenizer, req, self.cfg.template_kwargs())
            except TemplateError as err:
                replies[i] = Reply(skip=str(err))
                continue
            prompts[i] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            opened[i] = opens_think(text)
        order = sorted(prompts, key=lambda i: len(prompts[i]))
        size = self.cfg.batch_size
        batches = [order[k : k + size] for k in range(0, len(order), size)]
        with ThreadPoolExecutor(max_workers=len(self.devices), thread_name_prefix="generate") as pool:
            for batch, outs in zip(
                batches, pool.map(lambda b: self._generate([prompts[i] for i in b]), batches), strict=True
            ):
                for i, (ids, finish) in zip(batch, outs, strict=True):
                    text = self.tokenizer.decode(ids, skip_special_tokens=True)
                    replies[i] = Reply(
                        text=text, opened_think=opened[i], finish=finish, tokens=len(ids), ids=ids
                    )
        return [r if r is not None else Reply(error="no answer") for r in replies]

    def _generate(self, prompts: list[list[int]]) -> list[tuple[list[int], str]]:
        """Greedy or sampled continuations of ``prompts`` (left-padded into one batch) on a free copy of the
        target: per prompt, the tokens before its end token and how it ended."""
        model, device = self.replicas.get()
        try:
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=self.generation)
            rows = out[:, width:].tolist()
        finally:
            self.replicas.put((model, device))
        results = []
        for row in rows:
            end = next((k for k, t in enumerate(row) if t in self.eos), None)
            results.append((row, "length") if end is None else (row[:end], "stop"))
        return results


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The tokens that end the target's turn: its generation config's, else the tokenizer's eos."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise EngineError("the target has no end-of-sequence token (generation_config.json or tokenizer)")
    return ids
