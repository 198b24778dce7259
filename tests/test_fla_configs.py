"""fla's kernels tuned once per process, their configs reused at every token count (common/target/fla_configs.py):
the switch is set before fla imports and never over a user's own, and what fla's autotuners chose is written
as fla's config files (kernel name, entries keyed by fla's hash of the key, the config's launch fields).

fla itself (Triton kernels) needs a GPU: stand-in autotuners with fla's attributes (``kernel_name``, Triton's
``cache`` of key -> config) are put in a module named like fla's here; the producer's hybrid bench checks the
real ones on the device (docs/benchmarks.md)."""

from __future__ import annotations

import hashlib
import json
import sys
import types
from types import SimpleNamespace

import numpy as np

from dflash.common.target import fla_configs
from dflash.producer.buckets import BucketConfig, Bucketer
from dflash.producer.compile_plan import mixer_shapes


def _clean_env(monkeypatch):
    """No fla switch in the environment and no fla module, both restored after the test (set first, so
    monkeypatch records them and undoes what the code under test sets)."""
    for name in (fla_configs.MODE_ENV, fla_configs.DIR_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)


def test_the_switch_is_set_before_fla_imports_and_a_users_own_is_kept(monkeypatch):
    _clean_env(monkeypatch)
    folder = fla_configs.reuse_tuned_configs()
    assert folder is not None and folder.is_dir()
    assert fla_configs.os.environ[fla_configs.MODE_ENV] == "fuzzy"
    assert fla_configs.os.environ[fla_configs.DIR_ENV] == str(folder)

    _clean_env(monkeypatch)
    monkeypatch.setenv(fla_configs.MODE_ENV, "strict")
    assert fla_configs.reuse_tuned_configs() is None
    assert fla_configs.os.environ[fla_configs.MODE_ENV] == "strict"

    _clean_env(monkeypatch)
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))  # imported already: its mode is fixed
    assert fla_configs.reuse_tuned_configs() is None
    assert fla_configs.MODE_ENV not in fla_configs.os.environ


def test_tuned_configs_are_written_as_flas_config_files(monkeypatch, tmp_path):
    _clean_env(monkeypatch)
    config = SimpleNamespace(kwargs={"BT": 32}, num_warps=8, num_stages=2, num_ctas=1, maxnreg=None)
    norm = SimpleNamespace(kernel_name="l2norm_fwd_kernel", cache={(128, 24, "torch.bfloat16"): config})
    untuned = SimpleNamespace(kernel_name="chunk_fwd_kernel_o", cache={})
    cumsum = SimpleNamespace(kernel_name="chunk_local_cumsum_scalar_kernel", cache={(32, 48, 64): config})
    module = types.ModuleType("fla.modules.norm.l2norm")
    module.l2norm_fwd_kernel, module.chunk_fwd_kernel_o = norm, untuned
    module.chunk_local_cumsum_scalar_kernel = SimpleNamespace(fn=cumsum)  # under triton.heuristics
    monkeypatch.setitem(sys.modules, "fla.modules.norm.l2norm", module)
    monkeypatch.setenv(fla_configs.MODE_ENV, "fuzzy")
    monkeypatch.setenv(fla_configs.DIR_ENV, str(tmp_path))

    assert fla_configs.save_tuned_configs() == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "chunk_local_cumsum_scalar_kernel.json",
        "l2norm_fwd_kernel.json",
    ]
    data = json.loads((tmp_path / "l2norm_fwd_kernel.json").read_text())
    key_hash = hashlib.md5(b'[128,24,"torch.bfloat16"]').hexdigest()  # fla's AutotuneKey.key_hash
    assert data["kernel_name"] == "l2norm_fwd_kernel" and list(data["autotune_entries"]) == [key_hash]
    entry = data["autotune_entries"][key_hash]
    assert entry["autotune_key"] == [128, 24, "torch.bfloat16"]
    assert entry["config"] == {
        "kwargs": {"BT": 32},
        "num_warps": 8,
        "num_stages": 2,
        "num_ctas": 1,
        "maxnreg": None,
        "ir_override": None,
    }


def test_nothing_is_written_unless_fla_reuses_configs_in_this_process(monkeypatch):
    _clean_env(monkeypatch)
    assert fla_configs.save_tuned_configs() == 0


def test_the_mixers_first_warm_shape_is_a_full_batch_of_the_longest_bucket():
    """fla tunes a kernel at the first shape it sees, and that choice is reused for every token count: the
    first mixer input is the largest batch the data makes, not a 64-token one."""
    cfg = BucketConfig(batch_tokens=4096, round_rows=True)
    lengths = np.random.default_rng(0).integers(20, 900, 300)
    shapes = mixer_shapes(cfg, lengths)
    bk = Bucketer(cfg)
    longest = max(bk.bucket_of(int(n)) for n in lengths)
    assert shapes[0] == bk.shape_of(longest) and shapes[0][0] * shapes[0][1] > 2048
