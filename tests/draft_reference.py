"""Reference implementations shared by the drafter tests (not collected: no test_ prefix)."""

import pytest
import torch


def reference_mask(
    doc_ids: list[int],
    anchors: list[int],
    valid: list[bool],
    block_size: int,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Explicit loops over blocks, query tokens and keys: block b sees context keys of its anchor's document
    strictly before the anchor, and its own block's B keys; padding blocks see nothing. With a sliding
    window W, the query at document position p = pos(anchor) + i keeps only keys at positions p-W+1 .. p:
    context positions > p - W, and block offsets j <= i with i - j < W."""
    s, n = len(doc_ids), len(anchors)
    position = [0] * s  # position within the document, counted here independently of the code under test
    for kv in range(1, s):
        position[kv] = position[kv - 1] + 1 if doc_ids[kv] == doc_ids[kv - 1] else 0
    out = torch.zeros(n * block_size, s + n * block_size, dtype=torch.bool)
    for b in range(n):
        if not valid[b]:
            continue
        a = anchors[b]
        for i in range(block_size):
            q = b * block_size + i
            p = position[a] + i
            for kv in range(s):
                if doc_ids[kv] == doc_ids[a] and kv < a:
                    if sliding_window is None or p - position[kv] < sliding_window:
                        out[q, kv] = True
            for j in range(block_size):
                if sliding_window is None or (j <= i and i - j < sliding_window):
                    out[q, s + b * block_size + j] = True
    return out


def random_stream(seed: int, s: int = 64, n: int = 10, max_doc_len: int = 20):
    """Random packed docs with tail padding, and anchors anywhere in real documents (doc starts and ends too)."""
    g = torch.Generator().manual_seed(seed)
    doc_ids = torch.full((s,), -1, dtype=torch.int32)
    pos, doc = 0, 0
    while True:
        length = int(torch.randint(1, max_doc_len, (1,), generator=g))
        if pos + length > s - 5:
            break
        doc_ids[pos : pos + length] = doc
        pos, doc = pos + length, doc + 1
    real = (doc_ids >= 0).nonzero().squeeze(1)
    anchors = real[torch.randint(0, real.shape[0], (n,), generator=g)]
    valid = torch.rand(n, generator=g) < 0.7
    anchors = torch.where(valid, anchors, 0)
    return doc_ids, anchors, valid


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: intra-op threads only add contention on a shared 2-core machine (and nondeterminism).
    Import it into a test module to apply it there."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
