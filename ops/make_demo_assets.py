"""Build the demo assets shipped under tools/demo/data/ (run once; the outputs are committed).

Why this exists: tests and the demo need a target model, a tokenizer with a chat template and a chat
dataset of REAL text, without internet. Everything here is derived from what every Python install
carries: the chat dataset is built from the standard library's own docstrings (PSF-licensed prose),
and a small byte-level BPE tokenizer is trained on that dataset. The target model config is tiny;
`--train-target` trains its weights for a few CPU minutes on the same text plus the stdlib's source
files (a random target answers in junk loops, and a drafter trained on those learns nothing useful),
ships them as bf16 safetensors, and ships the trained target's greedy answers to the bundled prompts
(what the demo trains its drafter on).

The script is deterministic for a given Python version (docstrings change between versions; the version
used is recorded in assets/README.md).

    .venv/bin/python ops/make_demo_assets.py                  # rewrite tools/demo/data/ (not the weights)
    .venv/bin/python ops/make_demo_assets.py --train-target   # and retrain the target (~10-20 min, 2 cores)
    .venv/bin/python ops/make_demo_assets.py --check          # rebuild into a temp dir and diff
"""

from __future__ import annotations

import argparse
import ast
import filecmp
import importlib
import inspect
import json
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "tools" / "demo" / "data"

# Modules whose public API is documented in plain prose. Order matters (it is the dataset order).
MODULES = [
    "json",
    "os",
    "os.path",
    "re",
    "collections",
    "itertools",
    "functools",
    "pathlib",
    "string",
    "textwrap",
    "shutil",
    "glob",
    "fnmatch",
    "heapq",
    "bisect",
    "math",
    "statistics",
    "random",
    "datetime",
    "calendar",
    "time",
    "typing",
    "dataclasses",
    "enum",
    "abc",
    "contextlib",
    "copy",
    "pprint",
    "operator",
    "inspect",
    "tempfile",
    "zipfile",
    "tarfile",
    "gzip",
    "csv",
    "base64",
    "hashlib",
    "hmac",
    "secrets",
    "struct",
    "difflib",
    "shlex",
    "subprocess",
    "threading",
    "queue",
    "socket",
    "argparse",
    "logging",
    "urllib.parse",
    "html",
    "uuid",
    "decimal",
    "fractions",
    "unicodedata",
    "weakref",
    "traceback",
    "warnings",
    "io",
    "codecs",
    "locale",
]

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
    write_readme(out, n_chars=sum(len(t) for t in texts), n_convs=len(convs), n_tokens=len(tok))


# --------------------------------------------------------------------------- stage 2: a trained target
# Why: a target with random weights answers every prompt with a junk loop ("ventventvent..."), so a
# drafter trained on it learns a degenerate task and its tau swings wildly. A few minutes of CPU training
# on text every Python install carries gives a target whose greedy answers read like documentation.

TRAINED_OUTPUTS = ("tiny-qwen3/model.safetensors", "tiny-qwen3/training.json", "demo_chat_distilled.jsonl")
"""Outputs of ``--train-target`` (minutes of training): written once and committed; ``--check`` skips them."""


@dataclass(frozen=True)
class TargetTrainConfig:
    """The recipe of the shipped target weights (recorded in assets/README.md and training.json)."""

    steps: int = 600
    batch: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 40
    weight_decay: float = 0.1
    chat_fraction: float = 0.6
    """Rows drawn from the chat-formatted bundled conversations; the rest from the stdlib's .py files."""
    seed: int = 0
    threads: int = 2
    distill_new_tokens: int = 128


def stdlib_source_files() -> list[Path]:
    """The top-level modules of the running Python's standard library, read as text (never imported)."""
    root = Path(os.__file__).resolve().parent
    return sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))


def stdlib_docstrings(files: list[Path]) -> list[str]:
    """Module, class and function docstrings of `files` (via ast: no module is imported or run)."""
    docs: list[str] = []
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 80:
                    docs.append(doc)
    return docs


def _token_stream(tok, texts: list[str]):
    """All `texts` tokenized and joined, each followed by the pad token (a document separator)."""
    import torch

    ids: list[int] = []
    for enc in tok(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(tok.pad_token_id)
    return torch.tensor(ids, dtype=torch.long)


def training_streams(out: Path, tok) -> tuple:
    """(chat stream, stdlib stream): the bundled conversations in the chat template, so the target learns
    to answer and end its turn; and the stdlib's source files plus their docstrings as plain text."""
    convs = [json.loads(line) for line in open(out / "demo_chat.jsonl", encoding="utf-8")]
    chats = [tok.apply_chat_template(c["messages"], tokenize=False) for c in convs]
    files = stdlib_source_files()
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files] + stdlib_docstrings(files)
    return _token_stream(tok, chats), _token_stream(tok, texts)


def _batch(streams: tuple, cfg: TargetTrainConfig, gen):
    """One [batch, seq_len + 1] batch of random windows; rows from the chat stream w.p. chat_fraction."""
    import torch

    rows = []
    for _ in range(cfg.batch):
        stream = streams[0] if torch.rand((), generator=gen) < cfg.chat_fraction else streams[1]
        start = int(torch.randint(0, stream.numel() - cfg.seq_len - 1, (), generator=gen))
        rows.append(stream[start : start + cfg.seq_len + 1])
    return torch.stack(rows)


def _lr(step: int, cfg: TargetTrainConfig) -> float:
    import math

    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * frac))


def train_target(out: Path, cfg: TargetTrainConfig) -> dict:
    """Train the tiny target from its seed-0 init (fp32 on CPU: bf16 matmuls are 4-5x slower there);
    save bf16 safetensors; return the record (recipe, final loss, time)."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(cfg.threads)
    tdir = out / "tiny-qwen3"
    tok = AutoTokenizer.from_pretrained(tdir)
    streams = training_streams(out, tok)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tdir), dtype=torch.float32).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    losses: list[float] = []
    t0 = time.monotonic()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        batch = _batch(streams, cfg, gen)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == cfg.steps - 1:
            print(
                f"[target] step {step:4d}/{cfg.steps} loss {loss:.3f} ({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tdir / "model.safetensors"), metadata={"format": "pt"})
    tail = losses[-50:]
    return {
        "recipe": asdict(cfg),
        "tokens": {"chat": int(streams[0].numel()), "stdlib": int(streams[1].numel())},
        "final_loss": round(sum(tail) / len(tail), 4),
        "first_loss": round(losses[0], 4),
        "train_s": round(time.monotonic() - t0, 1),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }


def distill_answers(out: Path, cfg: TargetTrainConfig) -> int:
    """The trained target's greedy answers to every bundled prompt -> demo_chat_distilled.jsonl; rows kept."""
    from dflash.tools.demo.assets import self_distill

    dst = self_distill(
        out / "tiny-qwen3",
        out / "demo_chat.jsonl",
        out / "demo_chat_distilled.jsonl",
        limit=NUM_CONVERSATIONS,
        max_new_tokens=cfg.distill_new_tokens,
    )
    return sum(1 for _ in open(dst, encoding="utf-8"))


def build_trained_target(out: Path, cfg: TargetTrainConfig) -> None:
    record = train_target(out, cfg)
    record["distilled_rows"] = distill_answers(out, cfg)
    with open(out / "tiny-qwen3" / "training.json", "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")
    build(out)  # the README now records the training


def _training_record(out: Path) -> dict | None:
    path = out / "tiny-qwen3" / "training.json"
    return json.loads(path.read_text()) if path.is_file() else None


def write_readme(out: Path, *, n_chars: int, n_convs: int, n_tokens: int, record: dict | None = None) -> None:
    record = record if record is not None else _training_record(out)
    text = (
        "# Demo assets (generated by ops/make_demo_assets.py; do not edit by hand)\n\n"
        f"- `demo_chat.jsonl`: {n_convs} conversations (OpenAI `messages` form, {n_chars} characters of\n"
        "  message text) built from the docstrings of the Python standard library (PSF license).\n"
        f"  Built with Python {sys.version.split()[0]}; other versions may produce different text.\n"
        "- `tiny-qwen3/`: a tiny Qwen3ForCausalLM config and a byte-level BPE tokenizer\n"
        f"  ({n_tokens} tokens) trained on that text, with a ChatML chat template whose `{{% generation %}}`\n"
        "  block marks assistant content + `<|im_end|>` (the loss mask). Special tokens: "
        + ", ".join(f"`{t}`" for t in SPECIAL_TOKENS)
        + " (`<|endoftext|>` = pad, `<|im_end|>` = eos, `<|mask|>` = the drafter's mask token).\n"
    )
    if record is not None:
        r = record["recipe"]
        text += (
            "- `tiny-qwen3/model.safetensors`: the target's weights (bf16), trained by\n"
            "  `ops/make_demo_assets.py --train-target` from the seed-"
            f"{r['seed']} init: {r['steps']} AdamW steps of\n"
            f"  {r['batch']} x {r['seq_len']} tokens (lr {r['lr']} cosine to {r['min_lr']}, {r['warmup']} warm-up steps,"
            f" weight decay {r['weight_decay']},\n"
            f"  fp32 on CPU, {r['threads']} threads); rows drawn {r['chat_fraction']:.0%} from the chat-formatted\n"
            f"  conversations ({record['tokens']['chat']} tokens) and the rest from the top-level stdlib `.py`\n"
            f"  files plus their docstrings ({record['tokens']['stdlib']} tokens; Python {record['python']}).\n"
            f"  Loss {record['first_loss']} -> {record['final_loss']} (mean of the last 50 steps) in"
            f" {record['train_s']:.0f} s on a shared 2-core CPU box (torch {record['torch']}).\n"
            '  Recipe and numbers: `tiny-qwen3/training.json`. `build_tiny_target(weights="random")` still\n'
            "  gives the untrained seed weights.\n"
            f"- `demo_chat_distilled.jsonl`: the trained target's greedy answers (at most {r['distill_new_tokens']}\n"
            f"  new tokens) to the prompts of `demo_chat.jsonl` ({record['distilled_rows']} rows): what the demo\n"
            "  trains its drafter on (drafters learn to predict *the target's* tokens). Written by\n"
            "  dflash-regenerate's local engine (each row's first question), each answer cut to its longest\n"
            "  prefix that tokenizes back to the target's own tokens (rows with fewer than 40 left out).\n"
        )
    (out / "README.md").write_text(text)


def _diff(a: Path, b: Path, root: Path | None = None) -> list[str]:
    root = root or a
    cmp = filecmp.dircmp(a, b)
    bad = [str(Path(a) / n) for n in cmp.diff_files + cmp.left_only + cmp.right_only]
    bad = [p for p in bad if str(Path(p).relative_to(root)) not in TRAINED_OUTPUTS]
    for sub in cmp.common_dirs:
        bad += _diff(a / sub, b / sub, root)
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ASSETS, help="where to write (default: tools/demo/data)")
    ap.add_argument("--check", action="store_true", help="rebuild into a temp dir and compare with --out")
    ap.add_argument(
        "--train-target",
        action="store_true",
        help="also train the target and regenerate its answers (~10 min on 2 cores)",
    )
    args = ap.parse_args()
    if args.check:  # the cheap stage only; the trained outputs are checked by their recorded recipe
        with tempfile.TemporaryDirectory() as tmp:
            record = _training_record(args.out)
            if record is not None:
                (Path(tmp) / "tiny-qwen3").mkdir(parents=True)
                (Path(tmp) / "tiny-qwen3" / "training.json").write_text(
                    (args.out / "tiny-qwen3" / "training.json").read_text()
                )
            build(Path(tmp))
            bad = _diff(args.out, Path(tmp))
        if bad:
            sys.exit("make_demo_assets: differs: " + ", ".join(bad))
        print("demo assets are up to date")
        return
    build(args.out)
    if args.train_target:
        build_trained_target(args.out, TargetTrainConfig())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
