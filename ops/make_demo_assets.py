"""Build the demo assets shipped under common/assets/ (run once; the outputs are committed).

Why this exists: tests and the demo need a target model, a tokenizer with a chat template and a chat
dataset of REAL text, without internet. Everything here is derived from what every Python install
carries: the chat dataset is built from the standard library's own docstrings (PSF-licensed prose),
and a small byte-level BPE tokenizer is trained on that dataset. The target model config is tiny and its
weights are created from the config with a fixed seed (dflash.common.demo_assets.build_tiny_target), so
no weights are shipped.

The script is deterministic for a given Python version (docstrings change between versions; the version
used is recorded in assets/README.md).

    .venv/bin/python ops/make_demo_assets.py            # rewrite common/assets/
    .venv/bin/python ops/make_demo_assets.py --check    # rebuild into a temp dir and diff
"""

from __future__ import annotations

import argparse
import filecmp
import importlib
import inspect
import json
import random
import re
import sys
import tempfile
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "common" / "assets"

# Modules whose public API is documented in plain prose. Order matters (it is the dataset order).
MODULES = [
    "json", "os", "os.path", "re", "collections", "itertools", "functools", "pathlib", "string",
    "textwrap", "shutil", "glob", "fnmatch", "heapq", "bisect", "math", "statistics", "random",
    "datetime", "calendar", "time", "typing", "dataclasses", "enum", "abc", "contextlib", "copy",
    "pprint", "operator", "inspect", "tempfile", "zipfile", "tarfile", "gzip", "csv", "base64",
    "hashlib", "hmac", "secrets", "struct", "difflib", "shlex", "subprocess", "threading", "queue",
    "socket", "argparse", "logging", "urllib.parse", "html", "uuid", "decimal", "fractions",
    "unicodedata", "weakref", "traceback", "warnings", "io", "codecs", "locale",
]  # fmt: skip

SYSTEM_PROMPTS = [
    "You are a helpful assistant that explains the Python standard library.",
    "You answer questions about Python modules precisely, quoting their documentation.",
]
ASK_FUNCTION = [
    "What does `{name}` do?",
    "Can you explain `{name}`?",
    "I keep seeing `{name}` in code. What is it for?",
    "Explain the purpose of `{name}` in Python.",
    "How does `{name}` behave?",
]
ASK_MODULE = [
    "Give me an overview of the `{name}` module.",
    "What is the `{name}` module used for?",
    "Summarize the Python `{name}` module.",
]
FOLLOW_UP = [
    "And what about `{name}`?",
    "Thanks. How about `{name}`?",
    "What does `{name}` do, then?",
]
ASK_SIGNATURE = "What is the signature of `{name}`?"

MIN_DOC_CHARS = 160  # ~40+ tokens with the demo tokenizer: enough supervised tokens for 2 blocks of 16
MAX_DOC_CHARS = 1200  # keep the dataset a few hundred KB
NUM_CONVERSATIONS = 320
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]

# Qwen-style ChatML. The {% generation %} block marks what the assistant says (content + end-of-turn)
# so `apply_chat_template(..., return_assistant_tokens_mask=True)` yields the loss mask directly.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TINY_QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,  # default K=5 layer ids 1..L-3 = [1, 2, 3, 4, 5]: all distinct
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    "torch_dtype": "float32",
}


def _clean_doc(doc: str) -> str:
    """First paragraphs of a docstring, whitespace-normalized, cut at a paragraph boundary."""
    paras = [re.sub(r"[ \t]+", " ", p.strip()) for p in doc.strip().split("\n\n") if p.strip()]
    out: list[str] = []
    for p in paras:
        if out and len("\n\n".join(out + [p])) > MAX_DOC_CHARS:
            break
        out.append(p)
    text = "\n\n".join(out)
    return text[:MAX_DOC_CHARS].rstrip()


def collect_docs() -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """(module name, module doc) and (qualified name, signature or '', doc) for public callables."""
    modules, members = [], []
    seen: set[int] = set()
    for mod_name in MODULES:
        mod = importlib.import_module(mod_name)
        mdoc = inspect.getdoc(mod) or ""
        if len(mdoc) >= MIN_DOC_CHARS:
            modules.append((mod_name, _clean_doc(mdoc)))
        public = getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]
        for name in sorted(set(public)):
            obj = getattr(mod, name, None)
            if obj is None or not callable(obj) or inspect.ismodule(obj):
                continue
            if id(obj) in seen:
                continue  # re-exports (e.g. shutil names in os): ask about each object once
            seen.add(id(obj))
            doc = inspect.getdoc(obj) or ""
            if len(doc) < MIN_DOC_CHARS:
                continue
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                sig = ""
            if " at 0x" in sig:
                sig = ""  # default values printed with memory addresses: not reproducible
            members.append((f"{mod_name}.{name}", sig, _clean_doc(doc)))
    return modules, members


def build_conversations(seed: int = 0) -> list[dict]:
    """A deterministic mix of single-turn, multi-turn, system-prompted and module-overview chats."""
    modules, members = collect_docs()
    rng = random.Random(seed)
    members = members[:]
    rng.shuffle(members)
    convs: list[dict] = []
    it = iter(members)
    mod_it = iter(modules)
    while len(convs) < NUM_CONVERSATIONS:
        kind = rng.random()
        msgs: list[dict] = []
        if kind < 0.12:
            m = next(mod_it, None)
            if m is not None:
                msgs = [
                    {"role": "user", "content": rng.choice(ASK_MODULE).format(name=m[0])},
                    {"role": "assistant", "content": m[1]},
                ]
        if not msgs:
            try:
                name, sig, doc = next(it)
            except StopIteration:
                break
            if rng.random() < 0.3:
                msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
            msgs.append({"role": "user", "content": rng.choice(ASK_FUNCTION).format(name=name)})
            msgs.append({"role": "assistant", "content": doc})
            if sig and rng.random() < 0.25:
                msgs.append({"role": "user", "content": ASK_SIGNATURE.format(name=name)})
                msgs.append({"role": "assistant", "content": f"`{name}{sig}`"})
            if rng.random() < 0.3:
                nxt = next(it, None)
                if nxt is not None:
                    msgs.append({"role": "user", "content": rng.choice(FOLLOW_UP).format(name=nxt[0])})
                    msgs.append({"role": "assistant", "content": nxt[2]})
        convs.append({"id": f"stdlib-{len(convs):04d}", "messages": msgs})
    return convs


def train_tokenizer(texts: list[str]):
    """Byte-level BPE (GPT-2 / Qwen pre-tokenization) trained on the dataset text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=TINY_QWEN3_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    convs = build_conversations()
    with open(out / "demo_chat.jsonl", "w", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps(c, ensure_ascii=False, sort_keys=True) + "\n")

    texts = [m["content"] for c in convs for m in c["messages"]]
    tok = train_tokenizer(texts)
    tdir = out / "tiny-qwen3"
    tdir.mkdir(exist_ok=True)
    tok.save_pretrained(tdir)
    cfg = dict(TINY_QWEN3_CONFIG)
    cfg.update(
        vocab_size=len(tok),
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        mask_token_id=tok.convert_tokens_to_ids("<|mask|>"),
    )
    with open(tdir / "config.json", "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    n_chars = sum(len(t) for t in texts)
    (out / "README.md").write_text(
        "# Demo assets (generated by ops/make_demo_assets.py; do not edit by hand)\n\n"
        f"- `demo_chat.jsonl`: {len(convs)} conversations (OpenAI `messages` form, {n_chars} characters of\n"
        "  message text) built from the docstrings of the Python standard library (PSF license).\n"
        f"  Built with Python {sys.version.split()[0]}; other versions may produce different text.\n"
        f"- `tiny-qwen3/`: a tiny Qwen3ForCausalLM config (no weights: `build_tiny_target` creates them\n"
        f"  from the config with a fixed seed) and a byte-level BPE tokenizer ({len(tok)} tokens) trained\n"
        "  on that text, with a ChatML chat template whose `{% generation %}` block marks assistant\n"
        "  content + `<|im_end|>` (the loss mask). Special tokens: "
        + ", ".join(f"`{t}`" for t in SPECIAL_TOKENS)
        + " (`<|endoftext|>` = pad, `<|im_end|>` = eos, `<|mask|>` = the drafter's mask token).\n"
    )


def _diff(a: Path, b: Path) -> list[str]:
    cmp = filecmp.dircmp(a, b)
    bad = [str(Path(a) / n) for n in cmp.diff_files + cmp.left_only + cmp.right_only]
    for sub in cmp.common_dirs:
        bad += _diff(a / sub, b / sub)
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ASSETS, help="where to write (default: common/assets)")
    ap.add_argument("--check", action="store_true", help="rebuild into a temp dir and compare with --out")
    args = ap.parse_args()
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            build(Path(tmp))
            bad = _diff(args.out, Path(tmp))
        if bad:
            sys.exit("make_demo_assets: differs: " + ", ".join(bad))
        print("demo assets are up to date")
        return
    build(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
