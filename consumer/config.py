"""The consumer's configuration: one validated dataclass, filled from the command line."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(kw_only=True)
class TrainConfig:
    """Everything one consumer process needs. Defaults follow ARCHITECTURE.md §5."""

    spool: str
    """Spool directory the producers write into."""
    target: str
    """Target model folder (config.json + safetensors) or hub id: the drafter is sized from its config and
    borrows its frozen embedding and lm_head (read alone from the safetensors, never the whole model)."""
    run: str = "default"
    """Run name: the checkpoint folder under the store and the trained-sample set's key."""
    run_dir: str | None = None
    """Where metrics (JSONL), plots and logs go; None = no files."""
    device: str = "cpu"
    """'cpu', 'cuda' or 'cuda:N'."""
    checkpoint: str | None = None
    """Checkpoint store: s3://bucket/prefix or a local folder; None = no checkpoints."""
    resume: str = "auto"
    """'auto' = latest good checkpoint if any (falls back past a corrupt one), 'none' = start fresh."""
    save_every: int = 500
    keep_last: int = 3
    max_steps: int | None = None
    """Stop after this many optimizer steps (counting resumed ones); None = until the spool is drained."""
    total_steps: int | None = None
    """Length of the cosine schedule; default max_steps, else 10 000."""
    num_layers: int = 5
    block_size: int = 16
    context_tokens: int = 4096
    """Tokens in the packed context stream of one step (fixed: the step's shapes never change)."""
    num_anchors: int = 256
    """Anchor (block) slots per step (fixed)."""
    max_anchors_per_doc: int = 256
    gamma: float = 7.0
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    eval_every: int = 500
    """Steps between decode-order τ evaluations on the spool's held-out shards (0: never); also before the
    first step of a fresh run and after the last (common/drafter/decode_tau.py)."""
    eval_budget: float = 0.03
    """Largest share of the run's wall time the periodic evaluations may take: one that would exceed it is
    skipped (the first and the last always run; they are the before and after of the run)."""
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    loss_chunk_tokens: int = 2048
    """Query tokens per lm_head + cross-entropy chunk (bounds logits memory to chunk x vocab)."""
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    """Override; default = the layer ids recorded in the shards."""
    seed: int = 0
    log_every: int = 10
    wandb_project: str | None = None
    bucket: str | None = "random"
    """Claim policy: 'random' (default: mixes lengths in training order), 'oldest' (lowest name first),
    'fullest', or a bucket number. Steps have fixed shapes whatever the policy."""
    heartbeat_timeout_s: float = 60.0
    pool_streams: int = 4
    """Samples held for packing, in streams' worth of tokens (host memory: pool_streams x context_tokens x
    K*H x 2 bytes, ~0.8 GB at 32B-class width): more choice, fuller streams."""
    min_split_tokens: int = 256
    """A stream with at least this many empty slots is filled with the head of a longer document, whose tail
    goes into a later stream (see ShardFeed._best_fit); 0 = never split documents."""
    fill_wait_s: float = 2.0
    """Seconds to wait for enough samples to fill a stream before packing a short one (a starved pool
    would otherwise make half-empty streams; waiting forever could deadlock against a small budget)."""
    prefetch_steps: int = 2
    """Steps the input pipeline packs and copies ahead of the one training (host + device memory per step:
    one stream's hidden states)."""
    precision: str = "auto"
    """'amp': fp32 parameters and Adam state, bf16 autocast on CUDA; 'bf16': bf16 parameters and Adam state
    (the reference step's; fastest, but measured to learn worse than fp32 master weights); 'fp32': no
    autocast; 'auto' = amp on CUDA, fp32 on the CPU (bf16 matmuls are slow there). Measurements and the
    choice: docs/training.md."""
    compile: bool = True
    """torch.compile each draft decoder layer (with flex_attention inside on CUDA) once per process."""
    compile_backend: str = "inductor"
    """'inductor' (production), 'aot_eager' (traces like inductor, no codegen: CPU tests), 'eager'."""
    cpu_threads: int | None = None
    """torch intra-op threads on CPU (None = torch's default); several CPU processes share the cores."""

    def __post_init__(self) -> None:
        for name in (
            "save_every",
            "keep_last",
            "num_layers",
            "block_size",
            "context_tokens",
            "num_anchors",
            "max_anchors_per_doc",
            "loss_chunk_tokens",
            "log_every",
            "pool_streams",
            "prefetch_steps",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max-steps must be >= 1, got {self.max_steps}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"total-steps must be >= 1, got {self.total_steps}")
        if self.eval_every < 0:
            raise ValueError(f"eval-every must be >= 0, got {self.eval_every}")
        if not 0.0 < self.eval_budget <= 1.0:
            raise ValueError(f"eval-budget must be in (0, 1], got {self.eval_budget}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup-ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        if self.resume not in ("auto", "none"):
            raise ValueError(f"resume must be 'auto' or 'none', got {self.resume!r}")
        if self.block_size < 2:
            raise ValueError(f"block-size must be >= 2, got {self.block_size}")
        if self.bucket not in (None, "fullest", "random", "oldest") and not str(self.bucket).isdigit():
            raise ValueError(
                f"bucket must be random, oldest, fullest or a bucket number, got {self.bucket!r}"
            )
        if self.compile_backend not in ("inductor", "aot_eager", "eager"):
            raise ValueError(
                f"compile-backend must be inductor, aot_eager or eager, got {self.compile_backend!r}"
            )
        if self.fill_wait_s < 0:
            raise ValueError(f"fill-wait-s must be >= 0, got {self.fill_wait_s}")
        if self.min_split_tokens < 0:
            raise ValueError(f"min-split-tokens must be >= 0, got {self.min_split_tokens}")
        if self.precision not in ("auto", "amp", "bf16", "fp32"):
            raise ValueError(f"precision must be auto, amp, bf16 or fp32, got {self.precision!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu-threads must be >= 1, got {self.cpu_threads}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    @property
    def schedule_steps(self) -> int:
        return self.total_steps or self.max_steps or 10_000

    @property
    def claim_bucket(self) -> int | str | None:
        if self.bucket in (None, "oldest"):
            return None
        if self.bucket in ("fullest", "random"):
            return self.bucket
        return int(self.bucket)

    def param_dtype(self, device_type: str):
        """The drafter's parameter dtype for ``precision`` on this device."""
        import torch

        # auto: fp32 parameters and Adam state everywhere (on CUDA with bf16 autocast, i.e. amp): pure bf16
        # is faster but measured to learn worse (docs/training.md, tests/test_precision.py)
        return torch.bfloat16 if self.precision == "bf16" else torch.float32

    def to_dict(self) -> dict:
        return asdict(self)
