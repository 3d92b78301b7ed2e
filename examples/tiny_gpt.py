"""A small decoder-only transformer (GPT) trained as a language model.

Data: by default, generated sequences x_t = (a + b*t) mod vocab, with a random start a and
stride b (1..max_stride) per sequence. After two tokens the rest is predictable, so the loss
falls from ln(vocab) towards the floor set by the first two tokens. Point ``text_file`` at
any UTF-8 file to train a character-level model on it instead.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import scaletrain


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout.p if self.training else 0.0
        )
        x = x + self.dropout(self.proj(attn.transpose(1, 2).reshape(b, t, d)))
        return x + self.dropout(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, layers: int, dim: int, heads: int, dropout: float):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied input and output embeddings
        self.apply(self._init)
        for block in self.blocks:  # GPT-2: scale residual projections by depth
            nn.init.normal_(block.proj.weight, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class Sequences(Dataset):
    """Fixed-length windows of a token tensor; item i is (input, next-token target)."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.rows[i]
        return row[:-1], row[1:]


class TinyGPTTask(scaletrain.Task):
    def __init__(
        self,
        text_file: str | None = None,
        context: int = 32,
        vocab: int = 32,
        sequences: int = 4096,
        max_stride: int = 4,
        layers: int = 2,
        dim: int = 64,
        heads: int = 4,
        dropout: float = 0.0,
        eval_fraction: float = 0.1,
    ):
        rows = self._text_rows(text_file, context) if text_file else self._progressions(
            sequences, context, vocab, max_stride
        )
        self.vocab = int(rows.max()) + 1 if text_file else vocab
        n_eval = max(1, int(len(rows) * eval_fraction))
        self.train, self.eval = Sequences(rows[n_eval:]), Sequences(rows[:n_eval])
        self.config = dict(context=context, layers=layers, dim=dim, heads=heads, dropout=dropout)
        self.tokens_per_sample = context  # the tokens each sample trains on: tokens/s in the metrics

    @staticmethod
    def _progressions(n: int, context: int, vocab: int, max_stride: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(2024)
        start = torch.randint(0, vocab, (n, 1), generator=generator)
        stride = torch.randint(1, max_stride + 1, (n, 1), generator=generator)
        return (start + stride * torch.arange(context + 1)) % vocab

    def _text_rows(self, path: str, context: int) -> torch.Tensor:
        text = Path(path).read_text(encoding="utf-8")
        chars = sorted(set(text))
        self.alphabet = "".join(chars)
        ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
        n = (len(ids) - 1) // context
        if n < 2:
            raise ValueError(f"{path} is too short for context {context}")
        return torch.stack([ids[i * context : i * context + context + 1] for i in range(n)])

    def build_model(self) -> nn.Module:
        c = self.config
        return GPT(self.vocab, c["context"], c["layers"], c["dim"], c["heads"], c["dropout"])

    def train_dataset(self) -> Dataset:
        return self.train

    def eval_dataset(self) -> Dataset:
        return self.eval

    def loss(self, model, batch):
        inputs, targets = batch
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        accuracy = (logits.argmax(-1) == targets).float().mean()
        return loss, {"token_accuracy": accuracy}
