"""The model zoo every differential test runs on: small, fast, and covering the constructs fleetc must capture."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 32, hidden: int = 64, classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.fc2(F.relu(self.fc1(x)))))


class ResidualBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + x)


class SmallCNN(nn.Module):
    """Conv + BatchNorm + ReLU stem, two residual blocks, global pooling, linear head."""

    def __init__(self, channels: int = 8, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.blocks = nn.Sequential(ResidualBlock(channels), ResidualBlock(channels))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(F.relu(self.bn(self.stem(x))))
        return self.head(h.mean(dim=(2, 3)))


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        return self.drop(self.proj((att @ v).transpose(1, 2).reshape(b, t, c)))


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    """GPT-style LM: token + position embeddings, pre-LN blocks, tied input/output embeddings."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2, seq: int = 16,
                 dropout: float = 0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(GPTBlock(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(positions))
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))


class WithUnusedParam(nn.Module):
    """A parameter that gets no gradient: it must be left untouched, as torch.optim leaves it."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(16, 8)
        self.unused = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.used(x))


class ReturnsLossDict(nn.Module):
    """Hugging Face style: `forward(x, labels=...)` returns {"loss": ..., "logits": ...}."""

    def __init__(self):
        super().__init__()
        self.body = MLP(16, 32, 5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.body(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


class CTR(nn.Module):
    """A CTR-style model: `fields` sparse ids per sample looked up in one large table, concatenated, then an MLP."""

    def __init__(self, rows: int = 100_000, dim: int = 16, fields: int = 4, hidden: int = 32):
        super().__init__()
        self.embedding = nn.Embedding(rows, dim)
        self.fc1 = nn.Linear(fields * dim, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(self.embedding(ids).flatten(1)))).squeeze(1)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass
class ZooEntry:
    """A model factory plus a batch maker; `loss_fn=None` means the model returns its loss."""

    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], tuple[tuple, dict]]
    loss_fn: Callable | None


def _mlp_batch(g: torch.Generator) -> tuple[tuple, dict]:
    return (torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)), {}


def _cnn_batch(g: torch.Generator) -> tuple[tuple, dict]:
    return (torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)), {}


def _gpt_batch(g: torch.Generator) -> tuple[tuple, dict]:
    tokens = torch.randint(0, 64, (4, 17), generator=g)
    return (tokens[:, :-1], tokens[:, 1:]), {}


def _unused_batch(g: torch.Generator) -> tuple[tuple, dict]:
    return (torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)), {}


def _dict_batch(g: torch.Generator) -> tuple[tuple, dict]:
    return (torch.randn(8, 16, generator=g),), {"labels": torch.randint(0, 5, (8,), generator=g)}


def _ctr_batch(g: torch.Generator, batch: int = 32, rows: int = 100_000) -> tuple[tuple, dict]:
    """Clicks a fixed rule decides from the ids (learnable): id parity and size vote, with noise-free labels.
    Ids come from a small hot range plus the long tail, as CTR data does."""
    hot = torch.randint(0, 64, (batch, 4), generator=g)
    tail = torch.randint(0, rows, (batch, 4), generator=g)
    ids = torch.where(torch.rand(batch, 4, generator=g) < 0.5, hot, tail)
    labels = ((ids % 2).sum(1) >= 2).float()
    return (ids, labels), {}


# The embedding-heavy model of the parameter-server tests (not in ZOO: its 100k-row table would slow every
# zoo-wide test; tests/fleet/test_parameter_server.py runs it).
CTR_ENTRY = ZooEntry("ctr", CTR, _ctr_batch, F.binary_cross_entropy_with_logits)

ZOO = {
    "mlp": ZooEntry("mlp", MLP, _mlp_batch, F.cross_entropy),
    "cnn": ZooEntry("cnn", SmallCNN, _cnn_batch, F.cross_entropy),
    "gpt": ZooEntry("gpt", TinyGPT, _gpt_batch, _lm_loss),
    "unused_param": ZooEntry("unused_param", WithUnusedParam, _unused_batch, F.mse_loss),
    "loss_dict": ZooEntry("loss_dict", ReturnsLossDict, _dict_batch, None),
}

OPTIMIZERS: dict[str, Callable] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05),
    "momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, dampening=0.1, nesterov=False,
                                               weight_decay=1e-3),
    "nesterov": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
}
