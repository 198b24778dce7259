"""The consumer's configuration: one validated dataclass, the single source of ``dflash-consume``'s flags."""

from __future__ import annotations

import typing
from dataclasses import asdict, dataclass, field
from typing import Literal

from dflash.common.cli.flags import flag
from dflash.common.drafter.layers import check_layer_ids, parse_layer_types

PRECISIONS = ("auto", "mixed", "amp", "bf16", "fp32")
LossImpl = Literal["auto", "chunked", "liger"]
GcMode = Literal["python", "freeze", "interval"]


POSITIVE_INTS = (
    "save_every", "keep_last", "outage_saves", "num_layers", "block_size", "context_tokens", "num_anchors",
    "max_anchors_per_doc", "loss_chunk_tokens", "log_every", "pool_streams", "prefetch_steps",
)  # fmt: skip
AT_LEAST_ONE_WHEN_GIVEN = ("max_steps", "total_steps", "sliding_window", "decode_threads", "cpu_threads")
NON_NEGATIVE = ("eval_every", "fill_wait_s", "min_split_tokens")
POSITIVE = ("outage_minutes", "lr", "gamma")


def _flag(name: str) -> str:
    """A field's flag name as the errors say it: save_every -> save-every."""
    return name.replace("_", "-")


@dataclass(kw_only=True)
class TrainConfig:
    """Everything one consumer process needs; each field is also its ``dflash-consume`` flag
    (``--field-name``, help = the docstring below it: dflash.common.cli.flags). Defaults follow the public
    DFlash recipe (docs/architecture.md, "The drafter")."""

    spool: str
    """spool directory the producers write into"""
    target: str
    """target model folder or hub id: the drafter is sized from its config and borrows its frozen
    embedding and lm_head (read alone from the safetensors, never the whole model)"""
    run: str = "default"
    """run name: the checkpoint folder under the store and the trained-sample set's key (on the command
    line, default: the spool's run, else 'default')"""
    run_dir: str | None = None
    """folder for metrics JSONL, plots and logs (default: none written)"""
    device: str = field(default="cpu", metadata=flag(cli=False))
    """'cpu', 'cuda' or 'cuda:N' (the command line's --gpu)"""
    checkpoint: str | None = None
    """checkpoint store: s3://bucket/prefix or a local folder (default: no checkpoints)"""
    resume: str = field(default="auto", metadata=flag(choices=("auto", "none")))
    """auto: resume from the latest good checkpoint of the run (falling back past a corrupt one); none:
    start from scratch"""
    save_every: int = 500
    """checkpoint every N steps (and at the end, and on SIGTERM)"""
    keep_last: int = 3
    """checkpoints to keep in the store (older ones are deleted)"""
    outage_saves: int = 3
    """stop after this many checkpoint saves in a row failed (the store down, a credential expired): the
    state goes to --fallback-dir and the same command resumes from it once the store takes writes; at most
    (outage-saves + 1) x save-every steps are ever in no checkpoint (docs/reliability.md)"""
    outage_minutes: float = 30.0
    """stop as --outage-saves does once the first of the failed saves in a row is this many minutes old"""
    fallback_dir: str | None = None
    """local folder for the state when the store refuses it (default: <run-dir>/fallback-checkpoint, else
    ./dflash-fallback-checkpoint); every rank must see it"""
    max_steps: int | None = None
    """stop after N optimizer steps, counting resumed ones (default: when the spool is drained)"""
    total_steps: int | None = None
    """cosine schedule length (default: max-steps, else the campaign's length from the data, else 10000)"""
    num_layers: int = 5
    """draft decoder layers"""
    draft_layer_types: str = "auto"
    """attention of each draft layer, one per --num-layers, e.g. sliding,sliding,sliding,sliding,full; auto:
    for a hybrid target (linear-attention layers: Qwen3.5/3.6) the public drafters' layout, every layer but
    the last sliding, else all full (docs/training.md, "Sliding-window layers")"""
    sliding_window: int | None = None
    """window W of the sliding draft layers: a query sees the W positions up to its own (default when a
    layer slides: 2048, the public Qwen3.6-27B drafter's)"""
    block_size: int = 16
    """tokens per draft block: the anchor token plus block-size - 1 predicted positions"""
    context_tokens: int = 4096
    """packed context tokens per step (fixed: the step's shapes never change)"""
    num_anchors: int = 256
    """anchor blocks per step (fixed shape)"""
    max_anchors_per_doc: int = 256
    """at most this many of a step's anchor blocks from one document (so long documents do not dominate)"""
    gamma: float = 7.0
    """loss weight decay over block positions: exp(-(k-1)/gamma)"""
    lr: float = 6e-4
    """peak AdamW learning rate (after warmup, then cosine decay)"""
    warmup_ratio: float = 0.04
    """fraction of the schedule's steps spent in linear learning-rate warmup, in [0, 1)"""
    eval_every: int = 500
    """steps between decode-order acceptance-length evaluations on the held-out shards the producers
    spool with --eval-samples (also before the first step and after the last; 0: never)"""
    eval_budget: float = 0.03
    """largest share of the run's time periodic evaluations may take; one that would exceed it is
    skipped and said in the log (the first and the last always run)"""
    weight_decay: float = field(default=0.0, metadata=flag(cli=False))
    """AdamW weight decay (the public recipe: none)"""
    grad_clip: float = 1.0
    """clip the gradient's global L2 norm to this"""
    loss_impl: LossImpl = "auto"
    """lm_head + cross-entropy, both loss_chunk_tokens query rows at a time, neither keeping logits for the
    backward: chunked (torch ops, fp32 softmax passes), liger (liger-kernel's Triton cross-entropy kernel:
    loss, gradient and argmax in one pass over the bf16 logits; CUDA only, needs the liger-kernel package);
    auto = liger on CUDA when liger-kernel is installed (measured faster), else chunked (common/drafter/loss.py)"""
    loss_chunk_tokens: int = 2048
    """query tokens per lm_head + cross-entropy chunk of the chunked loss (logits memory: chunk x vocab)"""
    mask_token_id: int | None = None
    """token id of the draft mask (default: chosen from the tokenizer, docs/training.md)"""
    target_layer_ids: list[int] | None = None
    """target layers the producers captured, sorted and distinct, e.g. 1,9,17,25,33 (default: K=5 from 1 to
    L-3)"""
    seed: int = 0
    """random seed of the drafter init and anchor sampling (each rank offsets it by its rank)"""
    log_every: int = 10
    """console/metrics line every N steps"""
    wandb_project: str | None = None
    """log to this wandb project (offline unless WANDB_API_KEY is set; default: no wandb)"""
    bucket: str | None = "random"
    """claim policy: random (mixes lengths in training order), oldest (lowest name first), fullest, or a
    bucket number; steps have fixed shapes whatever the policy"""
    heartbeat_timeout_s: float = field(default=60.0, metadata=flag(name="--heartbeat-timeout"))
    """seconds before a silent consumer's claims are recovered"""
    pool_streams: int = 4
    """samples held for packing, in streams' worth of tokens (host memory: pool-streams x context-tokens
    x K*H x 2 bytes, ~0.8 GB at 32B-class width): more choice, fuller streams"""
    min_split_tokens: int = 32
    """fill a stream with at least this many empty slots with the head of a longer document, its tail
    going into a later stream; 0 = never split (32, two blocks: 99 % of slots filled at 1024 and 4096
    tokens in ops/bench/fill_sim.py, against 88-98 % at 256)"""
    fill_wait_s: float = 30.0
    """seconds a stream short of samples waits for more while producers still produce (a short stream
    is packed at once when none can give more soon: done, gone, blocked on the spool budget)"""
    prefetch_steps: int = 2
    """steps packed and copied to the GPU ahead of the one training"""
    precision: str = field(default="auto", metadata=flag(choices=PRECISIONS))
    """parameters and Adam state: mixed (bf16 weights; fp32 master and moments in the optimizer, one fused
    update pass), amp (fp32 + bf16 autocast), bf16 (bf16 weights and moments: measured to learn worse),
    fp32; auto = amp on CUDA, fp32 on the CPU (docs/training.md, consumer/optim.py)"""
    compile: bool = field(
        default=True, metadata=flag(negate=True, help="debug only: run the draft layers uncompiled")
    )
    """torch.compile each draft decoder layer (with flex_attention inside on CUDA) once per process"""
    compile_backend: str = field(
        default="auto", metadata=flag(choices=("auto", "inductor", "aot_eager", "eager"))
    )
    """torch.compile backend: auto = inductor on CUDA, eager on the CPU (measured at the demo's shapes: the
    same ms/step, and inductor's C++ build costs 33 s to minutes on a cold cache); aot_eager traces like
    inductor without code generation (tests)"""
    cpu_threads: int | None = None
    """torch threads per CPU consumer (default: torch's own choice; several CPU processes share the cores)"""
    gc_mode: GcMode = "interval"
    """Python's garbage collector in the training loop: python (automatic, as Python does it), freeze (after
    the warm-up steps, everything alive is frozen out of later collections: the model, compiled graphs,
    modules), interval (freeze, then no automatic collection: one at each log line, timed in gc_ms). A
    full collection walks every tracked object while holding the GIL, so it stalls the kernel launches;
    docs/training.md, "Where a step's time goes" """
    expandable_segments: bool = field(
        default=True,
        metadata=flag(negate=True, help="CUDA: the caching allocator without expandable segments"),
    )
    """CUDA: the caching allocator maps memory in growable segments (PYTORCH_CUDA_ALLOC_CONF
    expandable_segments), so freed blocks are not stranded in fixed segments; left alone when
    PYTORCH_CUDA_ALLOC_CONF is set"""
    decode_threads: int | None = None
    """zarr's threads decoding a shard's chunks in this process (default: zarr's own choice); each shares the
    GIL with the thread launching the kernels"""
    profile_steps: str | None = None
    """FIRST:COUNT, e.g. 40:5: record steps FIRST..FIRST+COUNT-1 with torch.profiler and write their kernel
    table to run-dir/profile-r<rank>.txt (default: no profile)"""

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_choices()
        self._check_layers()
        if self.profile_steps is not None:
            self.profile_window  # noqa: B018  raises ValueError on a malformed FIRST:COUNT
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    def _check_numbers(self) -> None:
        """Every count and rate in its range: one line naming the flag and the value."""
        for name in POSITIVE_INTS:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{_flag(name)} must be a positive integer, got {value!r}")
        for name in AT_LEAST_ONE_WHEN_GIVEN:
            if (value := getattr(self, name)) is not None and value < 1:
                raise ValueError(f"{_flag(name)} must be >= 1, got {value}")
        for name in NON_NEGATIVE:
            if (value := getattr(self, name)) < 0:
                raise ValueError(f"{_flag(name)} must be >= 0, got {value}")
        for name in POSITIVE:
            if not (value := getattr(self, name)) > 0:
                raise ValueError(f"{_flag(name)} must be > 0, got {value}")
        if not 0.0 < self.eval_budget <= 1.0:
            raise ValueError(f"eval-budget must be in (0, 1], got {self.eval_budget}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup-ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.block_size < 2:
            raise ValueError(f"block-size must be >= 2, got {self.block_size}")

    def _check_choices(self) -> None:
        if self.resume not in ("auto", "none"):
            raise ValueError(f"resume must be 'auto' or 'none', got {self.resume!r}")
        if self.bucket not in (None, "fullest", "random", "oldest") and not str(self.bucket).isdigit():
            raise ValueError(
                f"bucket must be random, oldest, fullest or a bucket number, got {self.bucket!r}"
            )
        if self.compile_backend not in ("auto", "inductor", "aot_eager", "eager"):
            raise ValueError(
                f"compile-backend must be auto, inductor, aot_eager or eager, got {self.compile_backend!r}"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        for name, kind in (("loss_impl", LossImpl), ("gc_mode", GcMode)):
            if getattr(self, name) not in typing.get_args(kind):
                choices = ", ".join(typing.get_args(kind))
                raise ValueError(f"{_flag(name)} must be one of {choices}, got {getattr(self, name)!r}")

    def _check_layers(self) -> None:
        if self.target_layer_ids is not None:
            self.target_layer_ids = check_layer_ids(self.target_layer_ids, what="--target-layer-ids")
        layer_types = parse_layer_types(self.draft_layer_types)
        if layer_types is not None and len(layer_types) != self.num_layers:
            raise ValueError(
                f"draft-layer-types names {len(layer_types)} layers, num-layers is {self.num_layers}"
            )

    @property
    def schedule_steps(self) -> int:
        return self.total_steps or self.max_steps or 10_000

    def feed_settings(self) -> dict:
        """``ShardFeed``'s settings of this run (consumer/feed.py)."""
        return dict(
            context_tokens=self.context_tokens,
            bucket=self.claim_bucket,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            pool_streams=self.pool_streams,
            min_split_tokens=self.min_split_tokens or None,
            fill_wait_s=self.fill_wait_s,
        )

    @property
    def claim_bucket(self) -> int | str | None:
        if self.bucket in (None, "oldest"):
            return None
        if self.bucket in ("fullest", "random"):
            return self.bucket
        return int(self.bucket)

    def resolved_compile_backend(self, device_type: str) -> str:
        """``compile_backend`` on this device: auto = inductor on CUDA, eager on the CPU."""
        if self.compile_backend != "auto":
            return self.compile_backend
        return "inductor" if device_type == "cuda" else "eager"

    def resolved_precision(self, device_type: str) -> str:
        """``precision`` on this device: auto = amp on CUDA (the fastest measured that learns as fp32 does;
        mixed is not yet measured faster, docs/training.md), fp32 on the CPU (bf16 matmuls are 4-5x slower)."""
        if self.precision != "auto":
            return self.precision
        return "amp" if device_type == "cuda" else "fp32"

    def resolved_loss_impl(self, device_type: str) -> str:
        """``loss_impl`` on this device: auto = liger on CUDA when liger-kernel is installed (measured 1.12x
        the reference step against the chunked loss's 1.07x, same call, docs/benchmarks.md), else chunked."""
        if self.loss_impl != "auto":
            return self.loss_impl
        import importlib.util  # not at the top: the CLI imports this config before parsing its flags

        return "liger" if device_type == "cuda" and importlib.util.find_spec("liger_kernel") else "chunked"

    def param_dtype(self, device_type: str):
        """The drafter's parameter dtype for ``precision`` on this device: bf16 for mixed and bf16 (mixed
        keeps fp32 masters in its optimizer), fp32 for amp (bf16 autocast) and fp32."""
        import torch  # not at the top: the CLI imports this config before parsing its flags

        return torch.bfloat16 if self.resolved_precision(device_type) in ("mixed", "bf16") else torch.float32

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """--profile-steps as (first step, count), None without it."""
        if self.profile_steps is None:
            return None
        first, sep, count = self.profile_steps.partition(":")
        if not (sep and first.isdigit() and count.isdigit() and int(first) >= 1 and int(count) >= 1):
            raise ValueError(
                f"profile-steps must be FIRST:COUNT, both >= 1 (e.g. 40:5), got {self.profile_steps!r}"
            )
        return int(first), int(count)

    @property
    def layer_types(self) -> list[str] | None:
        """--draft-layer-types in the HF names; None for auto (resolved against the target's config)."""
        return parse_layer_types(self.draft_layer_types)

    def to_dict(self) -> dict:
        return asdict(self)
