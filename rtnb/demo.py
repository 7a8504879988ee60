"""The demo's model and data: a character model over Python's own source text.

What ``rtnb demo``, the quickstart notebook and the manual's pictures train: real
data that needs no download (the standard library's source files, which every
CPython install ships), a task whose curves look like training (next-character
cross-entropy falling from ln(100) ≈ 4.6, accuracy rising), a held-out validation
split, and a model small enough for 2 CPU ranks to train in seconds.

In [1]: from rtnb.demo import CharModel, char_datasets, complete, evaluate
In [2]: train_set, val_set = char_datasets()
In [3]: net = CharModel()

The vocabulary is fixed (printable ASCII, one id for anything else), so every rank
builds the same shapes whatever its Python's sources hold, and nodes whose Pythons
differ by a patch release still train one model.
"""

from __future__ import annotations

import importlib.util
import string
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

__all__ = [
    "CONTEXT",
    "VOCAB",
    "CharModel",
    "CharWindows",
    "char_datasets",
    "complete",
    "evaluate",
    "text",
]

VOCAB = string.printable  # 100 characters; id len(VOCAB) is any other
CONTEXT = 32  # characters the model sees before the one it predicts
# Standard-library modules whose source is the text: prose-heavy docstrings and code,
# stable across 3.11+ and present in every CPython install (no C-only modules).
SOURCES = (
    "argparse",
    "textwrap",
    "dataclasses",
    "difflib",
    "calendar",
    "shlex",
    "fractions",
    "contextlib",
    "functools",
    "enum",
    "string",
    "heapq",
    "bisect",
    "glob",
    "fnmatch",
)
BLOCK = 4096  # characters: every tenth block is held out for validation


def text(limit: int = 400_000) -> str:
    """The standard library's source for :data:`SOURCES`, joined, at most ``limit``
    characters: the same on every rank that runs the same Python."""
    parts = []
    for name in SOURCES:
        spec = importlib.util.find_spec(name)
        origin = getattr(spec, "origin", None)
        if origin and origin.endswith(".py") and Path(origin).is_file():
            parts.append(Path(origin).read_text(encoding="utf-8", errors="replace"))
    joined = "\n".join(parts)
    if len(joined) < 10 * CONTEXT:
        raise RuntimeError(
            "rtnb.demo reads the standard library's .py sources, and this Python has none "
            f"of {', '.join(SOURCES)} as source: the demo needs a CPython with its Lib/"
        )
    return joined[:limit]


def encode(chars: str) -> torch.Tensor:
    index = {c: i for i, c in enumerate(VOCAB)}
    return torch.tensor([index.get(c, len(VOCAB)) for c in chars], dtype=torch.long)


class CharWindows(Dataset):
    """Every window of :data:`CONTEXT` characters of ``ids`` and the character after it."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return max(0, len(self.ids) - CONTEXT)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i : i + CONTEXT], self.ids[i + CONTEXT]


def char_datasets() -> tuple[CharWindows, CharWindows]:
    """(train, validation): the text's windows, every tenth block of :data:`BLOCK`
    characters held out, so validation reads the same kinds of text as training but
    never its windows."""
    ids = encode(text())
    blocks = list(torch.split(ids, BLOCK))
    train = [b for i, b in enumerate(blocks) if i % 10 != 9]
    held_out = [b for i, b in enumerate(blocks) if i % 10 == 9]
    return CharWindows(torch.cat(train)), CharWindows(torch.cat(held_out))


class CharModel(nn.Module):
    """An embedding per character, then a two-layer MLP over the window: ~180k
    parameters, logits over ``len(VOCAB) + 1`` characters."""

    def __init__(self, embed: int = 24, hidden: int = 256) -> None:
        super().__init__()
        classes = len(VOCAB) + 1
        self.embed = nn.Embedding(classes, embed)
        self.mlp = nn.Sequential(
            nn.Linear(CONTEXT * embed, hidden), nn.GELU(), nn.Linear(hidden, classes)
        )

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(window).flatten(1))


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, samples: int = 2048) -> dict[str, float]:
    """``val_loss`` and ``val_accuracy`` over ``samples`` windows spread evenly over
    ``data`` (the same ones each time, so the curve moves only with the model)."""
    count = min(samples, len(data))
    picked = torch.linspace(0, len(data) - 1, count).long().tolist()
    windows = torch.stack([data[i][0] for i in picked])
    targets = torch.stack([data[i][1] for i in picked])
    was_training = model.training
    model.eval()
    logits = model(windows)
    model.train(was_training)
    return {
        "val_loss": nn.functional.cross_entropy(logits, targets).item(),
        "val_accuracy": (logits.argmax(-1) == targets).float().mean().item(),
    }


@torch.no_grad()
def complete(model: nn.Module, prompt: str, chars: int = 60) -> str:
    """``prompt`` and the ``chars`` characters the model finds likeliest after it, one
    at a time: what it has learned, readable (an untrained model writes noise)."""
    ids = encode(prompt.rjust(CONTEXT)[-CONTEXT:]).tolist()
    was_training = model.training
    model.eval()
    out = []
    for _ in range(chars):
        nxt = int(model(torch.tensor([ids[-CONTEXT:]])).argmax(-1))
        ids.append(nxt)
        out.append(VOCAB[nxt] if nxt < len(VOCAB) else "?")
    model.train(was_training)
    return prompt + "".join(out)
