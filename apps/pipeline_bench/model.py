"""The pipeline program's model: a small GPT (token and position embedding,
pre-norm blocks of causal self-attention and a GELU MLP, final norm and a
language-model head) cut into pipeline stages, and the single-process run
whose gradients every pipelined run must reproduce."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 512
    dim: int = 256
    heads: int = 4
    blocks: int = 8
    seq: int = 128
    batch: int = 8           # sequences per step, split into micro-batches
    micro_batches: int = 4
    seed: int = 0


#: (block index, begin, end) on time.monotonic()'s clock, for every run of a block's forward
BlockObserver = Callable[[int, float, float], None]


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc1 = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.fc2 = nn.Linear(4 * cfg.dim, cfg.dim)
        self.observer: Optional[BlockObserver] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.timed(self.compute, x)

    def timed(self, compute: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``compute(x)``, told to the observer (a compiled block times its
        compiled ``compute`` so, outside what torch.compile traces)."""
        begin = time.monotonic()
        try:
            return compute(x)
        finally:  # a recomputation stops early, by an exception, once it has every saved tensor back
            if self.observer is not None:
                self.observer(self.index, begin, time.monotonic())

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab, cfg.dim)
        self.positions = nn.Embedding(cfg.seq, cfg.dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1]))


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class GPT(nn.Module):
    """The whole model; parameter names (``embedding.*``, ``blocks.<i>.*``,
    ``head.*``) are the ones every stage reports its gradients under."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        torch.manual_seed(cfg.seed)
        self.embedding = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.blocks))
        self.head = Head(cfg)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


#: how a stage runs a block: ``wrap(block, x)``; checkpointing goes here
BlockRunner = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class Stage(nn.Module):
    """A contiguous piece of the model: the embedding on the first stage,
    some blocks, the head on the last one."""

    def __init__(self, model: GPT, index: int, count: int, run_block: BlockRunner) -> None:
        super().__init__()
        per_stage = len(model.blocks) // count
        first = index * per_stage
        self.embedding = model.embedding if index == 0 else None
        # ModuleDict keyed by the block's index in the whole model, so that
        # parameter names match GPT's.
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(first, first + per_stage)})
        self.head = model.head if index == count - 1 else None
        self.run_block = run_block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        for block in self.blocks.values():
            x = self.run_block(block, x)
        if self.head is not None:
            x = self.head(x)
        return x


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def data(cfg: ModelConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """One step's tokens and next-token targets (the same every step)."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def reference_gradients(cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """The gradients of one step of the whole model in one process, without
    checkpoints: each micro-batch's loss backward in order, then divided by
    the number of micro-batches (what a pipeline schedule's scale_grads does)."""
    model = GPT(cfg)
    tokens, targets = data(cfg)
    for x, y in zip(tokens.tensor_split(cfg.micro_batches), targets.tensor_split(cfg.micro_batches)):
        loss_fn(model(x), y).backward()
    return {name: p.grad / cfg.micro_batches for name, p in model.named_parameters()}


def check_config(cfg: ModelConfig, stages: int) -> None:
    if cfg.blocks % stages:
        raise ValueError(f"{cfg.blocks} blocks do not split evenly into {stages} stages")
    if cfg.batch % cfg.micro_batches:
        raise ValueError(f"a batch of {cfg.batch} does not split evenly into {cfg.micro_batches} micro-batches")
    if cfg.dim % cfg.heads:
        raise ValueError(f"dim {cfg.dim} is not a multiple of {cfg.heads} heads")
    if min(cfg.vocab, cfg.dim, cfg.heads, cfg.blocks, cfg.seq, cfg.micro_batches) < 1:
        raise ValueError("every size of the model must be positive")
