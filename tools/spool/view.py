"""The read-only side of ``dflash-spool``: ``stats`` of a spool and ``inspect`` of one shard, as data and as
the text the command prints. Read-only (``Spool(create=False)``), so safe on a live run.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from dflash.common.contract.spool import Spool, SpoolError
from dflash.common.metrics import format_bytes

_DTYPE_BYTES = {"bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "bfloat16": 2, "float16": 2}
_DTYPE_BYTES |= {"uint32": 4, "int32": 4, "float32": 4, "uint64": 8, "int64": 8, "float64": 8}


class UserError(Exception):
    """Printed as one line ``dflash-spool: error: ...``; exit status 2."""


def fmt_num(x: float) -> str:
    if isinstance(x, int) or float(x).is_integer():
        return f"{int(x)}"
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def _table(rows: list[list[str]], *, right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]


def spool_stats(root: str) -> dict[str, Any]:
    try:
        return Spool(root, create=False).stats()
    except SpoolError as e:
        raise UserError(str(e)) from None
    except OSError as e:  # e.g. permission denied
        raise UserError(f"cannot read spool {root}: {e.strerror or e}") from None


def format_stats(st: dict[str, Any]) -> str:
    states = st["states"]
    buckets = sorted({b for row in states.values() for b in row["buckets"] if b != "other"})
    has_other = any("other" in row["buckets"] for row in states.values())
    head = ["state", "shards", "bytes"] + [f"b{b}" for b in buckets] + (["other"] if has_other else [])
    rows = [head]
    for state, row in states.items():
        cells = [state, str(row["shards"]), format_bytes(row["bytes"])]
        for b in buckets + (["other"] if has_other else []):
            cell = row["buckets"].get(b)
            cells.append(f"{cell['shards']} / {format_bytes(cell['bytes'])}" if cell else "-")
        rows.append(cells)
    prod = st["producers"]
    done = "drained" if st.get("drained") else ("producers done" if st["producers_done"] else "producing")
    out = [
        f"spool {st['root']}",
        f"total {format_bytes(st['total_bytes'])} in tmp+ready+claimed; "
        f"producers {len(prod['done'])}/{len(prod['registered'])} done ({done})",
        "",
        *_table(rows, right=set(range(1, len(head)))),
    ]
    if buckets:
        out.append("(bucket cells: shards / bytes)")
    if st["claimed_by"]:
        claims = ", ".join(
            f"{c}: {v['shards']} ({format_bytes(v['bytes'])})" for c, v in sorted(st["claimed_by"].items())
        )
        out += ["", f"claimed by  {claims}"]
    if st["processes"]:
        rows = [["role", "id", "pid", "host", "alive", "heartbeat", "counters (rate/s)"]]
        for p in sorted(st["processes"], key=lambda p: (str(p["role"]), str(p["id"]))):
            counters = []
            for k, v in p["counters"].items():
                rate = p["rates"].get(k)
                counters.append(
                    f"{k}={fmt_num(v) if isinstance(v, int | float) else v}"
                    + (f" ({fmt_num(rate)}/s)" if rate is not None else "")
                )
            age = p["age_s"]
            rows.append(
                [
                    str(p["role"]),
                    str(p["id"]),
                    str(p["pid"]),
                    str(p["host"]),
                    "yes" if p["alive"] else "no",
                    f"{age:.1f}s ago" if math.isfinite(age) else "?",
                    "  ".join(counters) or "-",
                ]
            )
        out += ["", *_table(rows, right={2})]
    if prod["registered"]:
        pending = sorted(set(prod["registered"]) - set(prod["done"]))
        out += [
            "",
            f"producers registered: {' '.join(prod['registered'])}"
            + (f"; not done: {' '.join(pending)}" if pending else ""),
        ]
    return "\n".join(out)


def shard_info(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise UserError(f"{path}: no such shard")
    # zarr only for `inspect`: `stats` and `prepare` answer without it
    from dflash.common.contract.hidden_fp8 import FP8_NAME
    from dflash.common.contract.shard import SCALES_ARRAY, ShardFormatError
    from dflash.common.contract.shard_reader import read_shard_meta

    try:
        meta = read_shard_meta(p)
    except ShardFormatError as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"cannot read shard {path}: {e.strerror or e}") from None
    arrays = meta.get("arrays", {})
    raw_total = 0
    for name, a in arrays.items():
        raw = math.prod(a["shape"]) * _DTYPE_BYTES.get(a["dtype"], 0)
        a["raw_bytes"] = raw
        a["disk_bytes"] = tree_bytes(p / name)
        raw_total += raw
    disk = int(meta["nbytes"])
    # An FP8 shard stores its hidden states as e4m3 bytes plus scales: the ratio a user compares across
    # codecs is against the bf16 the target computed them in (what a bf16 shard's raw bytes are).
    fp8 = meta.get("hidden_dtype") == FP8_NAME and "hidden" in arrays
    bf16_total = raw_total
    if fp8:
        scales = arrays.get(SCALES_ARRAY, {}).get("raw_bytes", 0)
        bf16_total += math.prod(arrays["hidden"]["shape"]) * 2 - arrays["hidden"]["raw_bytes"] - scales
    return {
        "path": str(p.absolute()),
        "meta": {k: v for k, v in meta.items() if k not in ("arrays", "nbytes")},
        "arrays": arrays,
        "num_samples": meta.get("num_samples", arrays.get("sample_index", {}).get("shape", [None])[0]),
        "num_tokens": meta.get("num_tokens", arrays.get("input_ids", {}).get("shape", [None])[0]),
        "codec": meta.get("codec"),
        "raw_bytes": raw_total,
        "disk_bytes": disk,
        "bf16_bytes": bf16_total,
        "compression_ratio": bf16_total / disk if disk else None,
        "stored_ratio": raw_total / disk if disk else None,
        "fp8": fp8,
    }


def tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        total += sum(os.lstat(os.path.join(dirpath, f)).st_size for f in files)
    return total


def format_inspect(info: dict[str, Any]) -> str:
    meta = info["meta"]
    ratio = info["compression_ratio"]
    out = [
        f"shard {info['path']}",
        *(f"  {k}: {json.dumps(v) if isinstance(v, list | dict) else v}" for k, v in meta.items()),
        f"samples {info['num_samples']}, tokens {info['num_tokens']}, codec {info['codec']}",
        f"bytes on disk {format_bytes(info['disk_bytes'])}, raw {format_bytes(info['bf16_bytes'])}"
        + (" with the hidden states as bf16" if info["fp8"] else "")
        + f", compression ratio {f'{ratio:.2f}x' if ratio else '?'}"
        + (" against bf16" if info["fp8"] else ""),
    ]
    if info["fp8"] and info["stored_ratio"]:
        out.append(
            f"  against the stored arrays (FP8 hidden states + scales, {format_bytes(info['raw_bytes'])} raw): "
            f"{info['stored_ratio']:.2f}x, as the table below counts"
        )
    out.append("")
    rows = [["array", "shape", "dtype", "chunks", "raw", "on disk", "ratio"]]
    for name, a in info["arrays"].items():
        r = a["raw_bytes"] / a["disk_bytes"] if a["disk_bytes"] else None
        rows.append(
            [
                name,
                "x".join(map(str, a["shape"])),
                a["dtype"],
                "x".join(map(str, a["chunks"])),
                format_bytes(a["raw_bytes"]),
                format_bytes(a["disk_bytes"]),
                f"{r:.2f}x" if r else "-",
            ]
        )
    out += _table(rows, right={4, 5, 6})
    return "\n".join(out)
