"""One training step's inputs: a packed context stream, anchors per document, and the draft blocks.

Every step has FIXED shapes (S context tokens, N anchor slots of B tokens) so a compiled step never recompiles;
what varies is carried by padding (doc id -1, invalid anchor slots with zero label weight).

Label convention (docs/architecture.md, the training recipe): block position k predicts the token AT anchor+k (same position, no shift).
Position 0 holds the anchor token itself and is never a label.

Hidden states from FP8 shards stay FP8 (values + per-(token, layer) scales) through packing and the copy to
the device, and are dequantized there (``PackedSamples.to``): the host packs and copies half the bytes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash.common.contract import hidden_fp8


@dataclass(kw_only=True)
class PackedSamples:
    """Documents packed back to back into exactly S tokens (what the trainer assembles from shards)."""

    input_ids: torch.Tensor  # int64 [S]
    loss_mask: torch.Tensor  # bool [S]
    hidden: torch.Tensor  # [S, K*H] (bf16 from shards; float8_e4m3fn from FP8 shards, with hidden_scales)
    doc_ids: torch.Tensor  # int32 [S], 0..num_docs-1 in order, -1 = padding
    positions: torch.Tensor  # int64 [S], position within its document (0 for padding)
    sample_index: list[int]  # global dataset index of each document, in doc id order
    epoch: int = 0  # the campaign epoch of every document (a stream never mixes epochs)
    hidden_scales: torch.Tensor | None = None  # bf16 [S, K] with FP8 hidden (0 on padding); None after .to()

    def __post_init__(self) -> None:
        s = self.input_ids.shape[0]
        for name in ("input_ids", "loss_mask", "doc_ids", "positions"):
            t = getattr(self, name)
            if t.dim() != 1 or t.shape[0] != s:
                raise ValueError(f"{name} must have shape [{s}], got {list(t.shape)}")
        if self.hidden.dim() != 2 or self.hidden.shape[0] != s:
            raise ValueError(f"hidden must have shape [{s}, K*H], got {list(self.hidden.shape)}")
        if (self.hidden_scales is not None) != (self.hidden.dtype == hidden_fp8.FP8_DTYPE):
            raise ValueError(f"hidden of {self.hidden.dtype} needs hidden_scales exactly when it is FP8")
        if self.hidden_scales is not None and (
            self.hidden_scales.dim() != 2
            or self.hidden_scales.shape[0] != s
            or self.hidden.shape[1] % max(1, self.hidden_scales.shape[1])
        ):
            raise ValueError(f"hidden_scales must have shape [{s}, K], got {list(self.hidden_scales.shape)}")

    @property
    def context_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_docs(self) -> int:
        return len(self.sample_index)

    def to(
        self,
        device: torch.device | str,
        *,
        non_blocking: bool = False,
        hidden_dtype: torch.dtype | None = None,
    ):
        """A copy with every tensor on `device` (same class, lists kept); `hidden` optionally cast on the way.

        FP8 hidden states are copied as they are (half the bytes of bf16) and dequantized on `device`,
        after the copy (in the current stream: the input pipeline's copy stream), to `hidden_dtype` (default
        bf16); the copy holds no scales."""
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor) and f.name not in ("hidden", "hidden_scales")
        }
        if self.hidden_scales is None:
            moved["hidden"] = self.hidden.to(
                device, dtype=hidden_dtype or self.hidden.dtype, non_blocking=non_blocking
            )
        else:
            values = self.hidden.to(device, non_blocking=non_blocking)
            scales = self.hidden_scales.to(device, non_blocking=non_blocking)
            moved["hidden"] = hidden_fp8.dequantize(values, scales, hidden_dtype or torch.bfloat16)
            moved["hidden_scales"] = None
        return dataclasses.replace(self, **moved)


@dataclass(kw_only=True)
class DraftBatch(PackedSamples):
    """PackedSamples plus N anchor slots and their draft blocks of B tokens."""

    anchors: torch.Tensor  # int64 [N], index into the packed stream (0 for invalid slots)
    anchor_valid: torch.Tensor  # bool [N]
    block_input_ids: torch.Tensor  # int64 [N, B]: token at anchor, then mask_token_id
    block_positions: torch.Tensor  # int64 [N, B]: document position of anchor + k
    labels: torch.Tensor  # int64 [N, B]: token at anchor+k where it is in the anchor's document, else 0
    # float32 [N, B]: 0 at k=0, outside the document, off loss_mask, invalid slots
    label_weights: torch.Tensor

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.anchors.shape[0]
        if self.anchor_valid.shape != (n,):
            raise ValueError(f"anchor_valid must have shape [{n}], got {list(self.anchor_valid.shape)}")
        shape = self.block_input_ids.shape
        if len(shape) != 2 or shape[0] != n:
            raise ValueError(f"block_input_ids must have shape [{n}, B], got {list(shape)}")
        for name in ("block_positions", "labels", "label_weights"):
            if getattr(self, name).shape != shape:
                raise ValueError(
                    f"{name} must have shape {list(shape)}, got {list(getattr(self, name).shape)}"
                )

    @property
    def num_anchors(self) -> int:
        return self.anchors.shape[0]

    @property
    def block_size(self) -> int:
        return self.block_input_ids.shape[1]


def pack_samples(
    samples: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
    *,
    context_tokens: int,
    pin_memory: bool = False,
    position_offsets: Sequence[int] | None = None,
    epoch: int = 0,
    hidden_scales: Sequence[torch.Tensor | None] | None = None,
) -> PackedSamples:
    """Pack (input_ids [T], loss_mask [T], hidden [T, D], sample_index) documents into exactly S tokens.

    Raises ValueError when they do not fit: the caller decides what goes into a step (a silent truncation here
    would train on a cut document and report it as trained). ``pin_memory`` allocates the stream in page-locked
    memory, so the host->device copy of the (hundreds of MB) hidden states can run asynchronously on a copy
    stream; the hidden states are written once (no zero-fill of the whole stream, no second copy to pin).
    ``position_offsets`` gives each document's first position (a piece of a split document continues
    where the previous piece ended; default 0). ``hidden_scales``: each document's [T, K] scales when its
    hidden states are FP8 (None for a bf16 one); a stream of FP8 documents stays FP8, one mixing them with
    bf16 documents (a spool of both codecs) is packed in bf16.
    """
    if not samples:
        raise ValueError("pack_samples needs at least one sample")
    lengths = [int(ids.shape[0]) for ids, _, _, _ in samples]
    total = sum(lengths)
    if total > context_tokens:
        raise ValueError(
            f"{len(samples)} samples hold {total} tokens, more than context_tokens={context_tokens}"
        )
    if min(lengths) < 1:
        raise ValueError("pack_samples got an empty sample")
    width = samples[0][2].shape[-1]
    for doc, ((_, mask, hid, _), n) in enumerate(zip(samples, lengths, strict=True)):
        if mask.shape != (n,) or hid.shape != (n, width):
            raise ValueError(
                f"sample {doc}: loss_mask {list(mask.shape)} / hidden {list(hid.shape)} do not match {n} tokens"
            )
    hidden, scales = _pack_hidden([s[2] for s in samples], hidden_scales, context_tokens, total, pin_memory)
    input_ids = torch.zeros(context_tokens, dtype=torch.int64)
    input_ids[:total] = torch.cat([ids for ids, _, _, _ in samples])
    loss_mask = torch.zeros(context_tokens, dtype=torch.bool)
    loss_mask[:total] = torch.cat([mask.bool() for _, mask, _, _ in samples])
    lengths_t = torch.tensor(lengths)
    doc_ids = torch.full((context_tokens,), -1, dtype=torch.int32)
    doc_ids[:total] = torch.repeat_interleave(torch.arange(len(samples), dtype=torch.int32), lengths_t)
    positions = torch.zeros(context_tokens, dtype=torch.int64)
    starts = torch.cumsum(lengths_t, 0) - lengths_t
    if position_offsets is not None:
        starts = starts - torch.tensor(list(position_offsets), dtype=torch.int64)
    positions[:total] = torch.arange(total) - torch.repeat_interleave(starts, lengths_t)
    return PackedSamples(
        input_ids=input_ids,
        loss_mask=loss_mask,
        hidden=hidden,
        doc_ids=doc_ids,
        positions=positions,
        sample_index=[int(s[3]) for s in samples],
        epoch=epoch,
        hidden_scales=scales,
    )


def _pack_hidden(
    parts: list[torch.Tensor],
    scales: Sequence[torch.Tensor | None] | None,
    context_tokens: int,
    total: int,
    pin_memory: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The stream's hidden states (and FP8 scales), written once into (page-locked) memory, padding zeroed."""
    if scales is not None and len(scales) != len(parts):
        raise ValueError(f"hidden_scales has {len(scales)} entries for {len(parts)} samples")
    fp8 = scales is not None and all(sc is not None for sc in scales)
    if scales is not None and not fp8:  # FP8 beside bf16 documents: the stream is bf16 (mixed spools only)
        parts = [
            p if sc is None else hidden_fp8.dequantize(p, sc) for p, sc in zip(parts, scales, strict=True)
        ]
    dtype = parts[0].dtype
    hidden = torch.empty(context_tokens, parts[0].shape[-1], dtype=dtype, pin_memory=pin_memory)
    torch.cat([p.to(dtype) for p in parts], out=hidden[:total])
    hidden[total:].zero_()
    if not fp8:
        return hidden, None
    num_layers = scales[0].shape[-1]
    if any(sc.shape != (p.shape[0], num_layers) for p, sc in zip(parts, scales, strict=True)):
        raise ValueError(f"hidden_scales must be [T, {num_layers}] for each sample's T tokens")
    packed_scales = torch.empty(context_tokens, num_layers, dtype=scales[0].dtype, pin_memory=pin_memory)
    torch.cat(list(scales), out=packed_scales[:total])
    packed_scales[total:].zero_()
    return hidden, packed_scales


def empty_packed(
    context_tokens: int, hidden_width: int, *, dtype: torch.dtype = torch.bfloat16
) -> PackedSamples:
    """A stream of pure padding: a rank with no data still runs the step (same shapes, zero loss weight, zero
    gradients), so collective ops stay in lockstep across ranks."""
    return PackedSamples(
        input_ids=torch.zeros(context_tokens, dtype=torch.int64),
        loss_mask=torch.zeros(context_tokens, dtype=torch.bool),
        hidden=torch.zeros(context_tokens, hidden_width, dtype=dtype),
        doc_ids=torch.full((context_tokens,), -1, dtype=torch.int32),
        positions=torch.zeros(context_tokens, dtype=torch.int64),
        sample_index=[],
    )


def sample_anchors(
    doc_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    num_anchors: int,
    max_anchors_per_doc: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick anchors per document; returns (anchors [N] int64 sorted, padded with 0; anchor_valid [N] bool).

    Candidates are positions p whose next token p+1 is in the same (non-padding) document and on the loss mask,
    i.e. the block's first label is a trained token. Each document gets min(candidates, max_anchors_per_doc)
    anchors uniformly without replacement, so a long document cannot crowd out short ones. If the documents
    together want more than N, a uniform random subset of those N is kept. Fresh randomness every call: a sample
    seen twice trains on different blocks.
    """
    if num_anchors < 1 or max_anchors_per_doc < 1:
        raise ValueError(
            f"num_anchors and max_anchors_per_doc must be >= 1, got {num_anchors}, {max_anchors_per_doc}"
        )
    doc_ids = doc_ids.cpu()
    s = doc_ids.shape[0]
    candidate = torch.zeros(s, dtype=torch.bool)
    candidate[:-1] = loss_mask.cpu()[1:].bool() & (doc_ids[1:] == doc_ids[:-1]) & (doc_ids[:-1] >= 0)
    keys = torch.rand(s, generator=generator)
    idx = candidate.nonzero().squeeze(1)
    # Order candidates by (document, random key): the first max_anchors_per_doc of each document are a uniform
    # sample of that document's candidates.
    by_key = torch.argsort(keys[idx])
    order = by_key[torch.argsort(doc_ids[idx][by_key], stable=True)]
    sorted_docs = doc_ids[idx][order]
    _, counts = torch.unique_consecutive(sorted_docs, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(sorted_docs.shape[0]) - torch.repeat_interleave(starts, counts)
    chosen = idx[order[rank < max_anchors_per_doc]]
    if chosen.shape[0] > num_anchors:
        chosen = chosen[torch.randperm(chosen.shape[0], generator=generator)[:num_anchors]]
    chosen = torch.sort(chosen).values
    anchors = torch.zeros(num_anchors, dtype=torch.int64)
    anchor_valid = torch.zeros(num_anchors, dtype=torch.bool)
    anchors[: chosen.shape[0]] = chosen
    anchor_valid[: chosen.shape[0]] = True
    return anchors, anchor_valid


def position_decay(block_size: int, gamma: float) -> torch.Tensor:
    """Loss weight per block position: 0 at k=0 (the anchor, never predicted), exp(-(k-1)/gamma) for k >= 1.

    Early positions gate acceptance (a draft is accepted only up to its first miss), so they weigh most.
    """
    if gamma <= 0 or not math.isfinite(gamma):
        raise ValueError(f"gamma must be a positive number, got {gamma}")
    k = torch.arange(block_size, dtype=torch.float32)
    decay = torch.exp(-(k - 1) / gamma)
    decay[0] = 0.0
    return decay


def build_draft_batch(
    packed: PackedSamples,
    *,
    block_size: int,
    num_anchors: int,
    max_anchors_per_doc: int,
    mask_token_id: int,
    gamma: float,
    generator: torch.Generator,
) -> DraftBatch:
    """Sample anchors and build the N draft blocks, labels and label weights (all on CPU; `.to()` after)."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    anchors, anchor_valid = sample_anchors(
        packed.doc_ids,
        packed.loss_mask,
        num_anchors=num_anchors,
        max_anchors_per_doc=max_anchors_per_doc,
        generator=generator,
    )
    s = packed.context_tokens
    doc_ids = packed.doc_ids.cpu()
    offsets = torch.arange(block_size)
    idx = anchors[:, None] + offsets  # [N, B]
    safe = idx.clamp(max=s - 1)
    in_doc = (idx < s) & (doc_ids[safe] == doc_ids[anchors][:, None]) & anchor_valid[:, None]
    input_ids = packed.input_ids.cpu()
    labels = torch.where(in_doc, input_ids[safe], 0)
    on_loss = in_doc & packed.loss_mask.cpu()[safe]
    label_weights = on_loss.float() * position_decay(block_size, gamma)
    block_input_ids = torch.full((num_anchors, block_size), mask_token_id, dtype=torch.int64)
    block_input_ids[:, 0] = torch.where(anchor_valid, input_ids[anchors], mask_token_id)
    anchor_pos = torch.where(anchor_valid, packed.positions.cpu()[anchors], 0)
    block_positions = anchor_pos[:, None] + offsets
    fields = {f.name: getattr(packed, f.name) for f in dataclasses.fields(PackedSamples)}
    return DraftBatch(
        **fields,
        anchors=anchors,
        anchor_valid=anchor_valid,
        block_input_ids=block_input_ids,
        block_positions=block_positions,
        labels=labels,
        label_weights=label_weights,
    )
