"""The consumer's configuration: ``ConsumeConfig``, everything ``dflash-consume`` was told, built once from
the flags and validated before anything is touched.

``ConsumeConfig`` = ``ProcessConfig`` (what this process is: its GPU, its log level, its summary, how long
it waits for the spool) + ``TrainConfig`` (what it trains). ``TrainConfig`` holds the run's identity at the
top and one section per part of the trainer, each handed only its own section: ``CheckpointConfig`` (the
checkpointer), ``FeedConfig`` (the shard feed), ``DrafterShapeConfig`` (the drafter's build), ``StepConfig``
(a step's fixed shapes and its loss), ``OptimConfig`` (optimizer and schedule), ``LogConfig`` (log lines,
evaluations, a profile), ``HostConfig`` (threads, allocator, garbage collector) and the ``CompileConfig``
the producer shares (common/compile.py).

Every field is a flag (``--field-name``, help = the docstring below it: dflash.common.cli.flags); the flags
are flat on the command line, each name once over all sections. A choice is a ``Literal`` type, checked by
``check_choices`` in ``__post_init__``: the list is written once. What the process decides at run time (its
device, the run name the spool records) is not here: consumer/launch.py decides it. Standard library only
at import: the CLI imports this module before parsing its flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from dflash.common.cli.flags import add_flags, check_choices, flag, from_args
from dflash.common.compile import CompileConfig
from dflash.common.drafter.layers import DrafterArch, check_layer_ids, parse_layer_types

PROG = "dflash-consume"
"""The program name every line of the consumer CLI and its launch starts with."""

Resume = Literal["auto", "none"]
Precision = Literal["auto", "mixed", "bf16sr", "amp", "bf16", "fp32"]
MomentDtype = Literal["auto", "bfloat16", "float32"]
LossImpl = Literal["auto", "chunked", "liger"]
GcMode = Literal["python", "freeze", "interval"]
ARCH_DEFAULTS: dict[str, dict[str, int]] = {
    "dflash": {"block_size": 16, "num_anchors": 256},
    "dflash2": {"block_size": 8, "num_anchors": 512},
}
"""Per --drafter-arch, the defaults of --block-size and --num-anchors: the public recipes (DFlash: block 16,
256 anchors; DFlash2: block 8, 512 anchors, SpecForge's Qwen3.6-27B DFlash2 recipe; docs/training.md)."""
RESUME_CHANGES = ("block-size", "mask-token-id", "target-layer-ids", "target", "draft-layer-types")
"""What ``--resume-changes`` may name: the settings whose change leaves the checkpoint's weights loadable
(consumer/checkpointing/resume.py compares them all)."""
BUCKET_POLICIES = ("random", "oldest", "fullest")
"""The claim policies ``--bucket`` names; it also takes a bucket number, so it is no ``Literal``."""


def _name(field_name: str) -> str:
    """A field's flag name as the errors say it: save_every -> save-every."""
    return field_name.replace("_", "-")


def require_positive_ints(cfg: Any, *names: str) -> None:
    """Each named field of ``cfg`` is an int >= 1, else ValueError naming the flag and the value."""
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{_name(name)} must be a positive integer, got {value!r}")


def require_at_least_one_when_given(cfg: Any, *names: str) -> None:
    for name in names:
        if (value := getattr(cfg, name)) is not None and value < 1:
            raise ValueError(f"{_name(name)} must be >= 1, got {value}")


def require_non_negative(cfg: Any, *names: str) -> None:
    for name in names:
        if (value := getattr(cfg, name)) < 0:
            raise ValueError(f"{_name(name)} must be >= 0, got {value}")


def require_positive(cfg: Any, *names: str) -> None:
    for name in names:
        if not (value := getattr(cfg, name)) > 0:
            raise ValueError(f"{_name(name)} must be > 0, got {value}")


@dataclass(kw_only=True)
class ProcessConfig:
    """What this process is, beyond what it trains."""

    gpu: str
    """GPU index (e.g. 5), or 'cpu'"""
    log_level: str = "INFO"
    """logging level (DEBUG adds tracebacks to errors)"""
    summary_json: str | None = None
    """write a JSON summary of the run here at the end ({rank} is replaced by the rank; default: none)"""
    spool_wait_s: float = 600.0
    """seconds to wait for the spool (and, without --run, its run record) to appear when the consumer
    starts before its producers; past it, exit 2 (0: do not wait)"""

    def __post_init__(self) -> None:
        if not (self.gpu == "cpu" or self.gpu.isdigit()):
            raise ValueError(f"--gpu must be a GPU index or 'cpu', got {self.gpu!r}")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where and when the run's state is saved, and what a store that refuses saves may cost."""

    store: str | None = field(default=None, metadata=flag(name="--checkpoint"))
    """checkpoint store: s3://bucket/prefix or a local folder (default: no checkpoints)"""
    resume: Resume = "auto"
    """auto: resume from the latest good checkpoint of the run (falling back past a corrupt one); none:
    start from scratch"""
    resume_changes: str | None = None
    """settings this resume is meant to change from the checkpoint's, comma-separated, among
    block-size, mask-token-id, target-layer-ids, target (another target of the same shape: a fine-tune onto
    it), draft-layer-types; any other difference from the checkpoint's drafter or target is refused (exit
    2, one line naming it), and a shape its weights cannot load into is always refused (default: none)"""
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

    def __post_init__(self) -> None:
        check_choices(self)
        require_positive_ints(self, "save_every", "keep_last", "outage_saves")
        require_positive(self, "outage_minutes")
        if unknown := sorted(self.meant_changes - set(RESUME_CHANGES)):
            raise ValueError(
                f"resume-changes {self.resume_changes!r}: {', '.join(unknown)} is not one of "
                f"{', '.join(RESUME_CHANGES)}"
            )

    @property
    def meant_changes(self) -> frozenset[str]:
        """``--resume-changes`` as a set of setting names."""
        return frozenset(x.strip() for x in (self.resume_changes or "").split(",") if x.strip())


@dataclass(kw_only=True)
class FeedConfig:
    """How the shard feed claims, decodes and packs (consumer/feed.py)."""

    bucket: str | None = "random"
    """claim policy: random (mixes lengths in training order), oldest (lowest name first), fullest, or a
    bucket number; steps have fixed shapes whatever the policy"""
    heartbeat_timeout_s: float = field(default=60.0, metadata=flag(name="--heartbeat-timeout"))
    """seconds before a silent consumer's claims are recovered"""
    pool_streams: int = 4
    """samples held for packing, in streams' worth of tokens (host memory: pool-streams x context-tokens
    x K*H bytes for FP8 shards, x 2 for bf16: ~0.4 / 0.8 GB at 32B-class width): more choice, fuller
    streams"""
    min_split_tokens: int = 32
    """fill a stream with at least this many empty slots with the head of a longer document, its tail
    going into a later stream; 0 = never split (32, two blocks: 99 % of slots filled at 1024 and 4096
    tokens in ops/bench/fill_sim.py, against 88-98 % at 256)"""
    fill_wait_s: float = 30.0
    """seconds a stream short of samples waits for more while producers still produce (a short stream
    is packed at once when none can give more soon: done, gone, blocked on the spool budget)"""
    prefetch_steps: int = 2
    """steps packed and copied to the GPU ahead of the one training"""

    def __post_init__(self) -> None:
        require_positive_ints(self, "pool_streams", "prefetch_steps")
        require_non_negative(self, "fill_wait_s", "min_split_tokens")
        if self.bucket not in (None, *BUCKET_POLICIES) and not str(self.bucket).isdigit():
            raise ValueError(
                f"bucket must be {', '.join(BUCKET_POLICIES)} or a bucket number, got {self.bucket!r}"
            )

    @property
    def claim_bucket(self) -> int | str | None:
        """``--bucket`` as ``Spool.claim`` takes it: None for oldest, a policy name, or a bucket number."""
        if self.bucket in (None, "oldest"):
            return None
        if self.bucket in BUCKET_POLICIES:
            return self.bucket
        return int(self.bucket)


@dataclass(kw_only=True)
class DrafterShapeConfig:
    """The drafter's shape: its architecture, its layers and their attention, its block, the target layers
    that feed it."""

    drafter_arch: DrafterArch = "dflash"
    """drafter architecture: dflash (DFlash v1) or dflash2 (z-lab's DFlash2: a dynamic convolution around
    each draft sublayer and a candidate selector; same spool and shards; docs/training.md, "DFlash2")"""
    num_layers: int = 5
    """draft decoder layers"""
    draft_layer_types: str = "auto"
    """attention of each draft layer, one per --num-layers, e.g. sliding,sliding,sliding,sliding,full; auto:
    for a hybrid target (linear-attention layers: Qwen3.5/3.6) the public drafters' layout, every layer but
    the last sliding, else all full (docs/training.md, "Sliding-window layers")"""
    sliding_window: int | None = None
    """window W of the sliding draft layers: a query sees the W positions up to its own (default when a
    layer slides: 2048, the public Qwen3.6-27B drafter's)"""
    block_size: int | None = None
    """tokens per draft block: the anchor token plus block-size - 1 predicted positions (default: 16 for
    dflash, 8 for dflash2)"""
    mask_token_id: int | None = None
    """token id of the draft mask (default: chosen from the tokenizer, docs/training.md)"""
    target_layer_ids: list[int] | None = None
    """target layers the producers captured, sorted and distinct, e.g. 1,9,17,25,33 (default: K=5 from 1 to
    L-3)"""

    def __post_init__(self) -> None:
        check_choices(self)
        if self.block_size is None:
            self.block_size = ARCH_DEFAULTS[self.drafter_arch]["block_size"]
        require_positive_ints(self, "num_layers", "block_size")
        require_at_least_one_when_given(self, "sliding_window")
        if self.block_size < 2:
            raise ValueError(f"block-size must be >= 2, got {self.block_size}")
        if self.target_layer_ids is not None:
            self.target_layer_ids = check_layer_ids(self.target_layer_ids, what="--target-layer-ids")
        layer_types = parse_layer_types(self.draft_layer_types)
        if layer_types is not None and len(layer_types) != self.num_layers:
            raise ValueError(
                f"draft-layer-types names {len(layer_types)} layers, num-layers is {self.num_layers}"
            )

    @property
    def layer_types(self) -> list[str] | None:
        """--draft-layer-types in the HF names; None for auto (resolved against the target's config)."""
        return parse_layer_types(self.draft_layer_types)


@dataclass(kw_only=True)
class StepConfig:
    """One training step: its fixed shapes (the packed context, the anchor blocks) and its loss."""

    context_tokens: int = 4096
    """packed context tokens per step (fixed: the step's shapes never change)"""
    num_anchors: int | None = None
    """anchor blocks per step (fixed shape; default: 256 for dflash, 512 for dflash2)"""
    max_anchors_per_doc: int = 256
    """at most this many of a step's anchor blocks from one document (so long documents do not dominate)"""
    gamma: float = 7.0
    """loss weight decay over block positions: exp(-(k-1)/gamma)"""
    loss_impl: LossImpl = "auto"
    """lm_head + cross-entropy, both loss_chunk_tokens query rows at a time, neither keeping logits for the
    backward: chunked (torch ops, fp32 softmax passes), liger (liger-kernel's Triton cross-entropy kernel:
    loss, gradient and argmax in one pass over the bf16 logits; CUDA only, needs the liger-kernel package);
    auto = liger on CUDA when liger-kernel is installed (measured faster), else chunked
    (common/drafter/loss.py)"""
    loss_chunk_tokens: int = 2048
    """query tokens per lm_head + cross-entropy chunk of the chunked loss (logits memory: chunk x vocab)"""
    selector_loss_alpha: float = 1.0
    """dflash2: weight of the candidate selector's cross-entropy (over the strict top-k) beside the draft loss"""
    selector_warmup_ratio: float = 0.0005
    """dflash2: fraction of the schedule's steps with the selector loss at weight 0"""
    selector_ramp_ratio: float = 0.0005
    """dflash2: fraction of the schedule's steps over which its weight then rises linearly to the alpha"""

    def __post_init__(self) -> None:
        check_choices(self)
        self.num_anchors_defaulted = self.num_anchors is None  # TrainConfig applies --drafter-arch's default
        if self.num_anchors is None:
            self.num_anchors = ARCH_DEFAULTS["dflash"]["num_anchors"]
        require_non_negative(self, "selector_loss_alpha", "selector_warmup_ratio", "selector_ramp_ratio")
        require_positive_ints(
            self, "context_tokens", "num_anchors", "max_anchors_per_doc", "loss_chunk_tokens"
        )
        require_positive(self, "gamma")

    def resolved_loss_impl(self, device_type: str) -> str:
        """``loss_impl`` on this device: auto = liger on CUDA when liger-kernel is installed (measured 1.12x
        the reference step against the chunked loss's 1.07x, same call, docs/benchmarks.md), else chunked."""
        if self.loss_impl != "auto":
            return self.loss_impl
        import importlib.util  # not at the top: the CLI imports this config before parsing its flags

        return "liger" if device_type == "cuda" and importlib.util.find_spec("liger_kernel") else "chunked"


@dataclass(kw_only=True)
class OptimConfig:
    """The optimizer, its precision and the learning-rate schedule (consumer/optim.py, schedule.py)."""

    lr: float = 6e-4
    """peak AdamW learning rate (after warmup, then cosine decay)"""
    warmup_ratio: float = 0.04
    """fraction of the schedule's steps spent in linear learning-rate warmup, in [0, 1)"""
    total_steps: int | None = None
    """cosine schedule length (default: max-steps, else the campaign's length from the data, else 10000)"""
    weight_decay: float = field(default=0.0, metadata=flag(cli=False))
    """AdamW weight decay (the public recipe: none)"""
    grad_clip: float = 1.0
    """clip the gradient's global L2 norm to this"""
    precision: Precision = "auto"
    """parameters and Adam state: mixed (bf16 weights; fp32 master and moments in the optimizer, one fused
    update pass), bf16sr (bf16 weights, no master: one fused update pass that writes weights and moments
    back with stochastic rounding; --moment-dtype), amp (fp32 + bf16 autocast), bf16 (bf16 weights and
    moments, round-to-nearest: measured to learn worse), fp32; auto = amp on CUDA, fp32 on the CPU (docs/training.md, consumer/optim.py)"""

    moment_dtype: MomentDtype = "auto"
    """AdamW's moments under --precision bf16sr (the only precision that takes a choice): bfloat16 (16 bytes
    a parameter a step with the gradient norm, against 30-32 for mixed and amp) or float32 (24); auto =
    bfloat16"""

    def __post_init__(self) -> None:
        check_choices(self)
        if self.moment_dtype != "auto" and self.precision != "bf16sr":
            raise ValueError(
                f"moment-dtype {self.moment_dtype} needs --precision bf16sr (got {self.precision}): the other "
                "precisions fix their moments' dtype"
            )
        require_at_least_one_when_given(self, "total_steps")
        require_positive(self, "lr")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup-ratio must be in [0, 1), got {self.warmup_ratio}")

    def resolved_precision(self, device_type: str) -> str:
        """``precision`` on this device: auto = amp on CUDA (the fastest measured that learns as fp32 does;
        mixed is not yet measured faster, docs/training.md), fp32 on the CPU (bf16 matmuls are 4-5x
        slower)."""
        if self.precision != "auto":
            return self.precision
        return "amp" if device_type == "cuda" else "fp32"

    def resolved_moment_dtype(self) -> str:
        """``moment_dtype`` as a torch dtype name: auto = bfloat16."""
        return "bfloat16" if self.moment_dtype == "auto" else self.moment_dtype

    def param_dtype(self, device_type: str):
        """The drafter's parameter dtype for ``precision`` on this device: bf16 for mixed and bf16 (mixed
        keeps fp32 masters in its optimizer) and bf16sr, fp32 for amp (bf16 autocast) and fp32."""
        import torch  # not at the top: the CLI imports this config before parsing its flags

        return (
            torch.bfloat16
            if self.resolved_precision(device_type) in ("mixed", "bf16sr", "bf16")
            else torch.float32
        )


@dataclass(kw_only=True)
class LogConfig:
    """What the run reports: log lines, wandb, the held-out evaluations, a profile of a few steps."""

    log_every: int = 10
    """console/metrics line every N steps"""
    wandb_project: str | None = None
    """log to this wandb project (offline unless WANDB_API_KEY is set; default: no wandb)"""
    eval_every: int = 500
    """steps between decode-order acceptance-length evaluations on the held-out shards the producers
    spool with --eval-samples (also before the first step and after the last; 0: never)"""
    eval_budget: float = 0.03
    """largest share of the run's time periodic evaluations may take; one that would exceed it is
    skipped and said in the log (the first and the last always run)"""
    profile_steps: str | None = None
    """FIRST:COUNT, e.g. 40:5: record steps FIRST..FIRST+COUNT-1 with torch.profiler and write their kernel
    table to run-dir/profile-r<rank>.txt (default: no profile)"""

    def __post_init__(self) -> None:
        require_positive_ints(self, "log_every")
        require_non_negative(self, "eval_every")
        if not 0.0 < self.eval_budget <= 1.0:
            raise ValueError(f"eval-budget must be in (0, 1], got {self.eval_budget}")
        if self.profile_steps is not None:
            self.profile_window  # noqa: B018  raises ValueError on a malformed FIRST:COUNT

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


@dataclass(kw_only=True)
class HostConfig:
    """How the process uses its host and device: its threads, the CUDA allocator, Python's collector."""

    cpu_threads: int | None = None
    """torch threads per CPU consumer (default: torch's own choice; several CPU processes share the cores)"""
    decode_threads: int | None = None
    """zarr's threads decoding a shard's chunks in this process (default: zarr's own choice); each shares the
    GIL with the thread launching the kernels"""
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

    def __post_init__(self) -> None:
        check_choices(self)
        require_at_least_one_when_given(self, "cpu_threads", "decode_threads")


DEFAULT_RUN = "default"
"""The run name of a consumer given none, whose spool records none either."""


@dataclass(kw_only=True)
class TrainConfig:
    """What one consumer process trains: the run's identity and length, then one section per part of the
    trainer (the module docstring). Defaults follow the public DFlash recipe (docs/architecture.md, "The
    drafter")."""

    spool: str
    """spool directory the producers write into"""
    target: str
    """target model folder or hub id: the drafter is sized from its config and borrows its frozen
    embedding and lm_head (read alone from the safetensors, never the whole model)"""
    run: str | None = None
    """run name: the checkpoint folder under the store and the trained-sample set's key (default: the
    spool's run, else 'default')"""
    run_dir: str | None = None
    """folder for metrics JSONL, plots and logs (default: none written)"""
    seed: int = 0
    """random seed of the drafter init and anchor sampling (each rank offsets it by its rank)"""
    max_steps: int | None = None
    """stop after N optimizer steps, counting resumed ones (default: when the spool is drained)"""
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig, metadata=flag(cli=False))
    feed: FeedConfig = field(default_factory=FeedConfig, metadata=flag(cli=False))
    drafter: DrafterShapeConfig = field(default_factory=DrafterShapeConfig, metadata=flag(cli=False))
    step: StepConfig = field(default_factory=StepConfig, metadata=flag(cli=False))
    optim: OptimConfig = field(default_factory=OptimConfig, metadata=flag(cli=False))
    logs: LogConfig = field(default_factory=LogConfig, metadata=flag(cli=False))
    host: HostConfig = field(default_factory=HostConfig, metadata=flag(cli=False))
    compile_options: CompileConfig = field(default_factory=CompileConfig, metadata=flag(cli=False))

    def __post_init__(self) -> None:
        require_at_least_one_when_given(self, "max_steps")
        if self.step.num_anchors_defaulted:  # the architecture's default (StepConfig cannot see it)
            self.step.num_anchors = ARCH_DEFAULTS[self.drafter.drafter_arch]["num_anchors"]
        total = self.optim.total_steps
        if total is not None and self.max_steps is not None and total < self.max_steps:
            raise ValueError(
                f"total-steps {total} is below max-steps {self.max_steps}: steps past {total} would train "
                "at lr 0 (the cosine ends there); give total-steps >= max-steps, or leave it out"
            )

    @property
    def run_name(self) -> str:
        """The run as given, else ``DEFAULT_RUN`` (the launch fills ``run`` with the spool's first)."""
        return self.run or DEFAULT_RUN

    @property
    def schedule_steps(self) -> int:
        """The schedule's length before the data sizes it: --total-steps, else --max-steps, else 10000."""
        return self.optim.total_steps or self.max_steps or 10_000

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_flat(cls, **values: Any) -> TrainConfig:
        """A config from flag names (``block_size=4``, ``lr=1e-2``), each routed to its section: what a
        library caller, a bench or a test writes, as a user writes flags."""
        kwargs: dict[str, Any] = {}
        for name, section in SECTIONS.items():
            own = {f.name for f in dataclasses.fields(section)}
            kwargs[name] = section(**{k: values.pop(k) for k in list(values) if k in own})
        return cls(**values, **kwargs)


SECTIONS: dict[str, type] = {
    f.name: f.default_factory
    for f in dataclasses.fields(TrainConfig)
    if f.default_factory is not dataclasses.MISSING
}
"""TrainConfig's sections: {attribute: config class}, in the order --help shows them."""


def add_train_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    exclude: typing.Iterable[str] = (),
    defaults: dict | None = None,
) -> None:
    """TrainConfig's flags on ``parser``: the top-level fields, then one argument group per section (on a
    group, as a bench adds them, all in that group: argparse does not nest groups). ``exclude`` and
    ``defaults`` name flat fields, as ``add_flags`` takes them."""
    add_flags(parser, TrainConfig, exclude=exclude, defaults=defaults)
    for section in SECTIONS.values():
        group = parser
        if isinstance(parser, argparse.ArgumentParser):
            group = parser.add_argument_group(section.__doc__.splitlines()[0].rstrip("."))
        add_flags(group, section, exclude=exclude, defaults=defaults)


def train_flag_names() -> set[str]:
    """Every TrainConfig field that is a flag, by its flat name (the parsed namespace's attributes)."""
    names = set()
    for cls in (TrainConfig, *SECTIONS.values()):
        names |= {
            f.name
            for f in dataclasses.fields(cls)
            if f.metadata.get("flag") is None or f.metadata["flag"].cli
        }
    return names


def train_config_from_args(args: argparse.Namespace, **fixed: Any) -> TrainConfig:
    """The TrainConfig of parsed ``add_train_flags`` flags; ``fixed`` (flat names) fills or overrides
    fields."""
    sections, known = {}, {f.name for f in dataclasses.fields(TrainConfig)}
    for name, section in SECTIONS.items():
        own = {f.name for f in dataclasses.fields(section)}
        sections[name] = from_args(section, args, **{k: v for k, v in fixed.items() if k in own})
        known |= own
    if unknown := sorted(set(fixed) - known):
        raise TypeError(f"no TrainConfig field named {', '.join(unknown)}")
    top = {f.name for f in dataclasses.fields(TrainConfig)} - set(SECTIONS)
    return from_args(TrainConfig, args, **{k: v for k, v in fixed.items() if k in top}, **sections)


@dataclass(kw_only=True)
class ConsumeConfig:
    """Everything ``dflash-consume`` was told: built once from the flags, the only thing the launch reads."""

    process: ProcessConfig
    train: TrainConfig

    def __post_init__(self) -> None:
        if self.process.gpu == "cpu" and self.train.step.loss_impl == "liger":
            raise ValueError("loss-impl liger needs a CUDA device (its kernel is Triton): use chunked")


def config_of(args: argparse.Namespace) -> ConsumeConfig:
    """The consumer's one config from the parsed flags; ValueError (one line) on a bad value."""
    return ConsumeConfig(process=from_args(ProcessConfig, args), train=train_config_from_args(args))
