"""The producer's target forward under ``torch.compile``: the trunk cut after the last captured layer, its
batch shapes a small known set warmed once per process, recompiles after warm-up counted as bugs.

Why: a producer GPU runs nothing but the target forward, and eager HF leaves its memory-bound work unfused
(norms, rotary, SiLU x up, residual adds): the 8B-shaped trunk compiled ran 1.29x its eager self, 1.45x
the eager full forward (docs/benchmarks.md). Two choices, each selectable, so the GPU run can measure
both (docs/producer.md, "Compiled trunk"):

- scope ``layers`` (default): each decoder layer's ``forward`` is compiled; layers of one kind share one
  graph (parameters are graph inputs), so compile time does not grow with depth, the capture hooks and the
  early stop stay eager (capture.py, unchanged), and a kernel that breaks the graph (fla's delta rule is
  ``torch.compiler.disable``d) splits one layer, not a 64-layer graph (a whole hybrid trunk with fla gave
  no result in 300 s). ``trunk``: the whole truncated text model in one graph, layer outputs tapped by
  wrapper modules instead of hooks (hooks cannot raise out of a graph), cross-layer fusion included.
- shapes ``dynamic`` (default): one graph with symbolic rows and length (plus one for 1-row batches, as
  dynamo specializes sizes of 1), warmed on three shapes; batches keep the buckets' tight padding (~1 %).
  ``static``: one graph per bucket shape; batches are padded to their bucket's full shape
  (buckets.BucketConfig.fixed_shapes) on a coarser grid (`static_buckets`: 4 per octave from 64 tokens,
  20 shapes up to 4K, ~9 % padding against ~1 %), every shape the data uses warmed up front.

Hybrid targets (Gated DeltaNet + attention): in a linear-attention layer only the token mixer (the GDN
module: projections, conv, fla's chunked delta rule, gated norm) runs eagerly, outside the graph; the
layer's norms, residuals and MLP are compiled, and attention layers are compiled whole. The mixer's
heavy work is fla's own Triton kernels (nothing for inductor to fuse), and its compiled form never
finished warming up on an H200 (docs/producer.md, "Hybrid targets"); with the torch reference delta rule
its Python loop over 64-token chunks would unroll into one graph per length. Its memory-bound parts, the
causal conv and the gated norm, are small graphs of their own (common/target/mixer_kernels.py). fla
autotunes each kernel once, at a full-size batch in warm-up, and reuses that choice at every other token
count (common/target/fla_configs.py); warm-up also runs the mixer at every row count the data's buckets
make and at every token-count class of fla's L2 norm, so nothing is tuned or built in the production loop.

Warm-up is bounded (``CompileSpec.timeout_s``, ``--compile-timeout-s``): a compile still running past the
bound is abandoned for the eager path with one warning line, never a silent wait. If compiling fails,
the same; a compile after warm-up is logged ``RECOMPILE ... this is a bug`` and counted (heartbeats,
result).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch._dynamo.config as dynamo_config
import torch.fx.experimental._config as fx_config
from torch import nn
from torch._dynamo.exc import TorchDynamoException
from torch._inductor.exc import InductorError

from dflash.common.cli.exits import error_line
from dflash.common.drafter.dflash import recompile_count
from dflash.common.target.capture import LayerCapture
from dflash.common.target.fla_configs import save_tuned_configs
from dflash.common.target.kernels import REFERENCE, KernelReport
from dflash.common.target.mixer_kernels import compile_mixer_parts
from dflash.producer.buckets import BucketConfig
from dflash.producer.compile_plan import CompileSpec, compile_spec, mixer_shapes, shape_buckets, warmup_shapes
from dflash.producer.config import ProducerConfig, Worker
from dflash.producer.tapped_trunk import TappedTrunk

log = logging.getLogger(__name__)

_COMPILE_ERRORS = (TorchDynamoException, InductorError)


def _why(err: BaseException) -> str:
    """One line naming a compile failure's cause (dynamo wraps a backend's error in BackendCompilerFailed)."""
    inner = getattr(err, "inner_exception", None)
    err = inner if isinstance(inner, BaseException) else err
    return error_line(err)


def _linear_mixers(layer: nn.Module) -> list[nn.Module]:
    """The Gated DeltaNet token mixers of a decoder layer (empty for attention layers and dense targets)."""
    return [m for m in layer.modules() if type(m).__name__.endswith("GatedDeltaNet")]


class CompileTimeout(BaseException):
    """Raised into the warm-up when it runs past its bound. A BaseException, so that no ``except
    Exception`` inside dynamo or inductor swallows it on its way out."""


@contextmanager
def _deadline(seconds: float | None) -> Iterator[None]:
    """Raise CompileTimeout in this (main) thread after ``seconds``: SIGALRM interrupts Python code and
    blocking waits alike. Off the main thread (no signals there) or without a bound: no deadline."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise CompileTimeout(f"still compiling after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    # and again every second after the bound: dynamo swallows an exception raised while it traces (the frame
    # then runs eagerly and the next layer compiles), so one alarm could be lost and the bound with it
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Trunk:
    """The target forward a producer runs: ``run(input_ids, valid)`` -> packed [T, K*H] features, as
    ``LayerCapture.run``, compiled per ``spec`` (eager when not enabled). ``warm_up`` compiles every
    expected shape; afterwards ``recompiles`` counts compiles (a bug: a shape outside the warmed set)."""

    def __init__(self, capture: LayerCapture, spec: CompileSpec, kernels: KernelReport | None = None):
        self.capture, self.spec = capture, spec
        self.layer_ids, self.hidden_size = capture.layer_ids, capture.hidden_size
        self.num_layers, self.feature_size = capture.num_layers, capture.feature_size
        self.recompiles = 0
        self.compile_s = 0.0
        self.warmed = 0  # batch shapes compiled in warm-up
        self.eager_mixers: list[nn.Module] = []  # linear-attention token mixers kept out of the graphs
        self.fallback: str | None = None  # why compiling was given up (one line), None while compiled
        self._baseline: int | None = None
        self._batches = 0
        self._tapped: TappedTrunk | None = None
        self._compiled_trunk = None
        self._hybrid = kernels is not None
        self._conv_on_reference = kernels is not None and kernels.kernels.get("causal_conv1d") == REFERENCE
        self._restore_mixer_parts: Callable[[], None] | None = None
        self._fla = kernels is not None and kernels.fast
        self.scope = spec.scope
        if spec.enabled and spec.scope == "trunk" and self._hybrid:
            log.warning(
                "compile scope trunk: a hybrid target compiles per layer, its linear attention eager (docs/producer.md)"
            )
            self.scope = "layers"
        if spec.enabled:
            self._compile()

    @property
    def compiled(self) -> bool:
        return self.spec.enabled and self.fallback is None

    def bucket_config(self, cfg: BucketConfig) -> BucketConfig:
        """How to batch for this trunk: the static grid while compiled with static shapes; row counts
        rounded to powers of two on fla's kernels (see `mixer_rows`)."""
        cfg = shape_buckets(cfg, self.spec) if self.compiled else cfg
        return replace(cfg, round_rows=True) if self._fla and not cfg.fixed_shapes else cfg

    def _torch_compile(self, fn):
        return torch.compile(fn, backend=self.spec.backend, dynamic=self.spec.shapes == "dynamic")

    def _compile(self) -> None:
        if self.scope == "trunk":
            self.capture.close()  # the taps replace the hooks (a hook cannot raise out of a graph)
            self._tapped = TappedTrunk(self.capture)
            self._compiled_trunk = self._torch_compile(self._tapped)
            return
        last = max(self.layer_ids)
        for i, layer in enumerate(self.capture.layers):
            if i > last:  # never runs (freed, or after the early stop)
                continue
            for mixer in _linear_mixers(layer):  # a graph break around the mixer: it runs eagerly
                mixer.forward = torch.compiler.disable(mixer.forward, recursive=True)
                self.eager_mixers.append(mixer)
            layer.forward = self._torch_compile(layer.forward)  # instance attribute: hooks stay eager
        if self._hybrid:  # the eager mixers' memory-bound parts, each a small graph of its own
            self._restore_mixer_parts = compile_mixer_parts(
                self.capture.text_model, self._torch_compile, conv_on_reference=self._conv_on_reference
            )

    def _to_eager(self, why: str) -> None:
        """Give up compiling: one warning line, then the eager path for the rest of the process."""
        self.fallback = why
        log.warning(
            "compiling the target failed (%s): running it eagerly (slower); --no-compile skips compiling", why
        )
        self._uncompile()
        torch._dynamo.reset()  # an abandoned compile leaves nothing behind

    def _uncompile(self) -> None:
        """The layers' and mixers' own forwards back (the compiled ones are instance attributes)."""
        for module in [*self.capture.layers, *self.eager_mixers]:
            if "forward" in vars(module):
                del module.forward
        self.eager_mixers = []
        if self._restore_mixer_parts is not None:
            self._restore_mixer_parts()
            self._restore_mixer_parts = None

    def _forward(self, input_ids: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        if self._tapped is None:
            return self.capture.run(input_ids, valid)
        model = self._compiled_trunk if self.compiled else self._tapped
        if torch.is_inference_mode_enabled() and not input_ids.is_inference():
            input_ids = input_ids.clone()  # a normal tensor is another guard (dispatch keys): a recompile
        out = model(input_ids).reshape(-1, self.feature_size)
        if valid is None:
            return out
        index = valid.reshape(-1).nonzero().squeeze(1)
        if index.device != out.device:
            index = (
                index.pin_memory().to(out.device, non_blocking=True) if out.is_cuda else index.to(out.device)
            )
        return out.index_select(0, index)

    def _call(self, input_ids: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        if not self.compiled:
            return self._forward(input_ids, valid)
        # duck sizing would tie a length to an equal-sized static dim (e.g. a head dim) and specialize it
        with fx_config.patch(use_duck_shape=False):
            return self._forward(input_ids, valid)

    def warm_up(
        self,
        shapes: list[tuple[int, int]],
        device: torch.device | str,
        mixer_inputs: Iterable[tuple[int, int]] = (),
    ) -> float:
        """Compile every shape in ``shapes`` (a forward of pad tokens each), then run a linear-attention
        mixer once per shape in ``mixer_inputs`` (`mixer_shapes`: fla compiles and autotunes there, not
        while producing); returns the seconds taken. A compile failure, or one past ``spec.timeout_s``, falls back to the eager path (one
        warning)."""
        t0 = time.monotonic()
        if self.compiled and shapes:
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 4 * len(shapes) + 16)
            dynamo_config.accumulated_recompile_limit = max(
                dynamo_config.accumulated_recompile_limit, 16 * len(shapes) + 256
            )
            self.warmed = len(shapes)
            try:
                with _deadline(self.spec.timeout_s), torch.inference_mode():
                    for rows, length in shapes:
                        t_shape = time.monotonic()
                        ids = torch.zeros((rows, length), dtype=torch.int64, device=device)
                        self._call(ids, torch.ones((rows, length), dtype=torch.bool))
                        log.debug(
                            "warm-up: shape %s compiled in %.1f s", (rows, length), time.monotonic() - t_shape
                        )
                    if torch.device(device).type == "cuda":
                        torch.cuda.synchronize(device)
            except CompileTimeout as err:
                self._to_eager(f"{err} (--compile-timeout-s)")
            except Exception as err:  # noqa: BLE001 - any failure to compile: the eager path, said once
                self._to_eager(_why(err))
        mixer_inputs = list(mixer_inputs)
        if mixer_inputs and torch.device(device).type == "cuda" and self._fla:
            t_mixers = time.monotonic()
            tuned = self._warm_mixers(mixer_inputs, device)
            log.info(
                "linear-attention kernels warmed on %d input shapes in %.1f s; %s",
                len(mixer_inputs),
                time.monotonic() - t_mixers,
                f"{tuned} fla kernels' tuned configs reused at every other token count"
                if tuned
                else "fla retunes per token count class (FLA_CACHE_MODE set by the user, or fla imported early)",
            )
        self.compile_s = time.monotonic() - t0
        self._baseline = recompile_count()
        return self.compile_s

    def _warm_mixers(self, shapes: list[tuple[int, int]], device: torch.device | str) -> int:
        """One forward of the first linear-attention mixer per [rows, length] in ``shapes``; returns the fla
        kernels whose tuning is reused (fla_configs.py). What fla tuned so far (on the compiled warm-up's
        full batches, else on ``shapes[0]``, a full batch) is saved before the other shapes run, so each of
        them builds the chosen config once instead of tuning again: seconds per shape, not ten."""
        mixer = next(m for layer in self.capture.layers for m in _linear_mixers(layer))
        dtype = next(p.dtype for p in mixer.parameters() if p.dtype.itemsize > 1)  # not an FP8 weight
        tuned = 0
        with torch.inference_mode():
            for k, (rows, length) in enumerate(shapes):
                if k == 1 or (k == 0 and self.warmed):
                    tuned = save_tuned_configs()
                mixer(hidden_states=torch.zeros((rows, length, self.hidden_size), dtype=dtype, device=device))
        torch.cuda.synchronize(device)
        return max(tuned, save_tuned_configs())

    def run(self, input_ids: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """LayerCapture.run's contract (see capture.py), through the compiled trunk."""
        self._batches += 1
        try:
            out = self._call(input_ids, valid)
        except _COMPILE_ERRORS as err:
            if not self.compiled:
                raise
            self._to_eager(_why(err))
            return self._forward(input_ids, valid)
        if self.compiled and self._baseline is not None:
            extra = recompile_count() - self._baseline
            if extra > self.recompiles:
                self.recompiles = extra
                log.error(
                    "RECOMPILE after warm-up at batch %d, shape %s (%d so far): a batch shape outside the warmed set — this is a bug",
                    self._batches,
                    tuple(input_ids.shape),
                    extra,
                )
        return out

    def report(self) -> dict:
        """What the start line and the result say about the forward."""
        return {
            "compile": self.spec.describe()
            if self.compiled
            else ("eager (compile failed)" if self.fallback else "eager"),
            "compile_scope": self.scope if self.compiled else None,
            "compile_s": round(self.compile_s, 2),
            "warmed_shapes": self.warmed,
            "recompiles": self.recompiles,
            "eager_mixers": len(self.eager_mixers),
        }

    def close(self) -> None:
        """Remove the hooks and give the model back as it was before compiling (compiled forwards, taps)."""
        self._uncompile()
        if self._tapped is not None:
            self._tapped.restore()
        self.capture.close()


def warm_trunk(
    cfg: ProducerConfig, worker: Worker, capture: LayerCapture, kernels: KernelReport | None, lengths
) -> Trunk:
    """A producer's trunk: compiled per ``cfg`` on the worker's device, every batch shape of samples of
    ``lengths`` compiled before the first batch (the worker's start; benchmarks call it the same way)."""
    spec = compile_spec(cfg.compile_options, worker.device)
    trunk = Trunk(capture, spec, kernels)
    buckets = trunk.bucket_config(cfg.buckets)
    shapes = warmup_shapes(buckets, spec, lengths)
    heads = max(
        (getattr(m, "num_v_heads", 0) for layer in capture.layers for m in _linear_mixers(layer)), default=0
    )
    seconds = trunk.warm_up(
        shapes, worker.device, mixer_shapes(buckets, lengths, heads) if kernels is not None else ()
    )
    if trunk.compiled and shapes:
        log.info(
            "producer %s: compiled %d batch shape(s) in %.1f s (%s)",
            worker.producer_id,
            len(shapes),
            seconds,
            spec.describe(),
        )
    return trunk
