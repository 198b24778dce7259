"""Codecs for the `hidden` array of a shard: what a value is stored as, and the zarr v3 compression chain.

A codec is named by a short spec string (`zstd:1:shuffle`, `fp8`, `fp8:zstd:3`) so that it can be passed
on a command line and logged. It says two things:

- the values: bf16 as they are (bit-exact), or FP8 (e4m3 with a bf16 scale per token and captured layer,
  hidden_fp8.py: half the bytes through every stage, measured no worse for the drafter);
- the bytes: each name maps, through a small registry, to zarr v3 *core* codecs; nothing here compresses
  bytes itself, and any zarr v3 reader (not only zarr-python) can read a shard:

- `none`           -> [crc32c]
- `zstd:L`         -> [zstd(level=L), crc32c]
- `zstd:L:shuffle` -> [blosc(cname=zstd, clevel=(L+1)/2, shuffle, typesize=2, blocksize=1 MiB), crc32c]
- `fp8:<bytes>`    -> the same chains over the e4m3 bytes (`fp8` alone: `fp8:zstd:3`; no shuffle: a byte
                      shuffle of one-byte values is the identity)

Why zstd level 3 for FP8 and level 1 with shuffle for bf16 (measured on real shards of the demo target,
docs/shard-format.md): an e4m3 byte is a sign, 4 exponent bits that take few values and 3 mantissa bits
of noise, so zstd's entropy coder saves ~21 % at level 1 and ~23 % at level 3, which is what takes FP8
from 2.0x (no zstd) to 2.5x / 2.57x smaller than raw bf16; higher levels gain < 0.5 % more at more CPU.

Why a byte shuffle pays for bf16: the high byte of a bf16 value is the sign and 7 of the 8 exponent bits,
which take few distinct values in hidden states; the low byte is mostly mantissa noise. Shuffling puts all
high bytes of a chunk together, where zstd's entropy coder squeezes them, instead of interleaving them with
incompressible mantissa bytes. Blosc's SIMD shuffle + zstd measured faster (encode and decode) than
numcodecs' `Shuffle` filter followed by zarr's `ZstdCodec`, at the same ratio, and `blosc` is in the zarr v3
core spec while `numcodecs.shuffle` is not. Blosc maps its clevel c to zstd level 2c-1 (c < 9) and c = 9 to
22, so with shuffle only those zstd levels exist. The trailing crc32c turns any damaged byte into a read
error instead of silently wrong activations (blosc has no checksum of its own), and rejects damaged bytes
before they reach the blosc decoder. docs/shard-format.md has the measured numbers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

log = logging.getLogger(__name__)

# zstd accepts levels from ZSTD_minCLevel() (= -131072, the "fast" levels) to 22; level 0 means zstd's
# default (3). Negative levels skip entropy coding of literals, which is where bf16 data compresses, so
# they store bf16 almost raw (measured ratio 1.00): allowed, but pointless.
ZSTD_MIN_LEVEL = -131072
ZSTD_MAX_LEVEL = 22
# zstd level -> blosc clevel that produces it (c-blosc 1.x: zstd level = 2c-1 for c < 9, max level for 9).
SHUFFLE_ZSTD_LEVELS = {2 * c - 1: c for c in range(1, 9)} | {ZSTD_MAX_LEVEL: 9}
# Blosc splits a chunk into blocks compressed independently; below ~1 MiB the ratio drops (measured 1.29
# at blosc's automatic size, 1.44 at 256 KiB, 1.46 at 1 MiB and at 4 MiB for hidden states).
BLOSC_BLOCK_BYTES = 1 << 20

# FP8 (docs/shard-format.md, "Default codec"): half the bytes through every stage, and the demo's drafter
# trained from FP8 shards decodes as well as from bf16 ones (held-out τ over nine seeds,
# docs/benchmarks.md, "FP8 shards"). Keep the CodecConfig field defaults equal to it.
DEFAULT_CODEC_SPEC = "fp8:zstd:3"
# What a bare value name means: each value format with its measured best byte codec.
VALUE_DEFAULTS = {"bf16": "zstd:1:shuffle", "fp8": "fp8:zstd:3"}

Values = Literal["bf16", "fp8"]

_SPEC_HELP = (
    "expected [bf16:|fp8:]none|zstd[:<level>][:shuffle], or bf16 / fp8 alone "
    f"({', '.join(f'{k} = {v}' for k, v in VALUE_DEFAULTS.items())})"
)


@dataclass(kw_only=True)
class CodecConfig:
    """What the `hidden` array of a shard stores and how it is compressed.

    Spec strings (`CodecConfig.parse`): `[bf16:|fp8:]` then `none` | `zstd` | `zstd:<level>` |
    `zstd:<level>:shuffle` | `zstd:shuffle`; or `bf16` / `fp8` alone (VALUE_DEFAULTS). A spec lists what is
    on: `zstd:1` has no shuffle; a missing level means 1; no prefix means bf16.
    """

    values: Values = "fp8"
    """`bf16` (bit-exact) or `fp8` (e4m3 + a bf16 scale per token and captured layer)."""
    name: str = "zstd"
    """`none` (raw little-endian bytes) or `zstd`."""
    level: int = 3
    """zstd level; with shuffle one of 1, 3, 5, ..., 15, 22. Ignored (set to 0) for `none`."""
    shuffle: bool = False
    """Byte-shuffle (element size 2) before zstd. Not allowed with `none` or `fp8`."""

    def __post_init__(self) -> None:
        if self.name not in _CHAINS:
            raise ValueError(f"CodecConfig.name={self.name!r}: must be one of {sorted(_CHAINS)}")
        if isinstance(self.level, bool) or not isinstance(self.level, int):
            raise ValueError(f"CodecConfig.level={self.level!r}: must be an int")
        if not isinstance(self.shuffle, bool):
            raise ValueError(f"CodecConfig.shuffle={self.shuffle!r}: must be a bool")
        if self.values not in VALUE_DEFAULTS:
            raise ValueError(f"CodecConfig.values={self.values!r}: must be one of {sorted(VALUE_DEFAULTS)}")
        if self.name == "none":
            # Canonical form, so that CodecConfig(name="none") == CodecConfig.parse("none").
            self.level, self.shuffle = 0, False
        elif not ZSTD_MIN_LEVEL <= self.level <= ZSTD_MAX_LEVEL:
            raise ValueError(
                f"CodecConfig.level={self.level}: zstd levels are {ZSTD_MIN_LEVEL}..{ZSTD_MAX_LEVEL}"
            )
        elif self.fp8 and self.shuffle:
            raise ValueError("CodecConfig.shuffle=True: a byte shuffle of one-byte fp8 values does nothing")
        elif self.shuffle and self.level not in SHUFFLE_ZSTD_LEVELS:
            raise ValueError(
                f"CodecConfig.level={self.level}: with shuffle the zstd level must be one of "
                f"{sorted(SHUFFLE_ZSTD_LEVELS)} (blosc's levels)"
            )

    @classmethod
    def parse(cls, spec: str) -> CodecConfig:
        """Parse `none`, `zstd`, `zstd:3`, `zstd:3:shuffle`, `zstd:shuffle`, any of them after `bf16:` or
        `fp8:`, or `bf16` / `fp8` alone (case-insensitive)."""
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"codec spec {spec!r}: {_SPEC_HELP}")
        text = spec.strip().lower()
        values: Values = (
            "bf16"  # no prefix: bf16 values, so spool specs written as `zstd:1` read as they were
        )
        if text in VALUE_DEFAULTS:
            text = VALUE_DEFAULTS[text]
        for prefix in VALUE_DEFAULTS:
            if text.startswith(prefix + ":"):
                values, text = prefix, text[len(prefix) + 1 :]  # type: ignore[assignment]
        name, *opts = text.split(":")
        if name == "none":
            if opts:
                raise ValueError(f"codec spec {spec!r}: 'none' takes no options (no level, no shuffle)")
            return cls(values=values, name="none", level=0, shuffle=False)
        if name != "zstd":
            raise ValueError(f"codec spec {spec!r}: unknown codec {name!r}; {_SPEC_HELP}")
        shuffle = bool(opts) and opts[-1] == "shuffle"
        if shuffle:
            opts.pop()
        if len(opts) > 1:
            raise ValueError(f"codec spec {spec!r}: {_SPEC_HELP}")
        level = 1
        if opts:
            try:
                level = int(opts[0])
            except ValueError:
                raise ValueError(
                    f"codec spec {spec!r}: level {opts[0]!r} is not an integer; {_SPEC_HELP}"
                ) from None
        try:
            return cls(values=values, name="zstd", level=level, shuffle=shuffle)
        except ValueError as e:
            raise ValueError(f"codec spec {spec!r}: {str(e).split(': ', 1)[-1]}") from None

    @property
    def spec(self) -> str:
        """The canonical spec string, e.g. `zstd:1:shuffle`, `fp8:zstd:3`; `CodecConfig.parse(c.spec) == c`.
        bf16 specs carry no prefix (the spelling shards and logs have always had)."""
        prefix = "fp8:" if self.values == "fp8" else ""
        if self.name == "none":
            return prefix + "none"
        return prefix + f"zstd:{self.level}" + (":shuffle" if self.shuffle else "")

    @property
    def fp8(self) -> bool:
        """True when `hidden` is stored as e4m3 values with a bf16 scale per token and captured layer."""
        return self.values == "fp8"

    def __str__(self) -> str:
        return self.spec

    def zarr_codecs(self, *, element_size: int | None = None) -> list[Any]:
        """The zarr v3 bytes-to-bytes codecs (`compressors=` of `zarr.create_array`); the element size is
        the stored value's (2 for bf16, 1 for fp8) unless given."""
        size = element_size if element_size is not None else (1 if self.fp8 else 2)
        return _CHAINS[self.name](self, size)


def default_codec() -> CodecConfig:
    return CodecConfig.parse(DEFAULT_CODEC_SPEC)


def _none_chain(codec: CodecConfig, element_size: int) -> list[Any]:
    return [Crc32cCodec()]


def _zstd_chain(codec: CodecConfig, element_size: int) -> list[Any]:
    if not codec.shuffle:
        return [ZstdCodec(level=codec.level), Crc32cCodec()]
    blosc = BloscCodec(
        cname="zstd",
        clevel=SHUFFLE_ZSTD_LEVELS[codec.level],
        shuffle="shuffle",
        typesize=element_size,
        blocksize=BLOSC_BLOCK_BYTES,
    )
    return [blosc, Crc32cCodec()]


# The codec registry: name -> builder of the zarr codec chain. Add a codec here (and to the format doc).
_CHAINS: dict[str, Callable[[CodecConfig, int], list[Any]]] = {"none": _none_chain, "zstd": _zstd_chain}
