"""A small GPT-style transformer (nanoGPT / picotron style), and its one-process training as the reference.

The model is the usual decoder-only stack::

    tokens -> token embedding + position embedding -> dropout
           -> layers x [ x + Attention(LayerNorm(x)) ;  x + MLP(LayerNorm(x)) ]
           -> LayerNorm -> LM head (logits over the vocabulary)

Each piece is a module of its own, usable alone, because the parallel notebooks split them one at a time:

* :class:`MLP`: ``up`` (dim -> hidden), GELU, ``down`` (hidden -> dim), dropout.
* :class:`CausalSelfAttention`: ``q``, ``k``, ``v`` (dim -> dim, ``heads`` heads of ``head_dim``), causal
  softmax attention per head, dropout on the attention probabilities, ``out`` (dim -> dim), dropout.
  The number of heads is read from the width of ``q``'s output (``width // head_dim``), so a copy whose
  projections hold only some of the heads (tensor parallelism) runs the same ``forward``.

:func:`transformer` builds the model from a seed without touching the caller's random generator (like
:func:`course_lib.models.mlp`): every rank that builds it with the same seed holds the same weights.
:func:`train_reference` trains it in one process: the result every parallel layout must reproduce.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class TransformerConfig:
    """The shape of the model. The defaults keep a CPU step in milliseconds."""

    vocab: int = 32        # tokens 0 .. vocab-1
    seq_len: int = 32      # the longest sequence (number of position embeddings)
    dim: int = 64          # the width of the residual stream
    heads: int = 4         # attention heads; dim must divide by it
    layers: int = 2        # transformer blocks
    hidden: int = 256      # the MLP's inner width (4 x dim, as in GPT-2)
    dropout: float = 0.0   # one rate for every dropout (embeddings, attention probabilities, residual branches)
    bias: bool = True      # biases in the Linear layers

    def __post_init__(self):
        if self.dim % self.heads:
            raise ValueError(f"dim={self.dim} does not divide into heads={self.heads}: pick dim a multiple of heads")
        if min(self.vocab, self.seq_len, self.dim, self.heads, self.layers, self.hidden) < 1:
            raise ValueError(f"every size must be at least 1, got {self}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def with_(self, **changes) -> TransformerConfig:
        return replace(self, **changes)


class MLP(nn.Module):
    """The feed-forward block: ``dropout(down(gelu(up(x))))``."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate ``q``, ``k``, ``v`` and ``out`` projections.

    Heads never look at each other: head ``h`` uses only columns ``h*head_dim .. (h+1)*head_dim`` of
    ``q``, ``k`` and ``v``, and only the matching rows of ``out``. That is what lets tensor parallelism
    give each rank whole heads.

    ``k`` has no bias (as in Whisper): a bias on the keys adds ``q·b`` to every score of a query's row, and
    softmax ignores a constant added to a row, so that bias would get a gradient of exactly zero; an
    optimizer such as Adam would turn its rounding noise into full-size steps.
    """

    def __init__(self, dim: int, heads: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} does not divide into heads={heads}")
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim, bias=bias)
        self.k = nn.Linear(dim, dim, bias=False)   # see the docstring
        self.v = nn.Linear(dim, dim, bias=bias)
        self.out = nn.Linear(dim, dim, bias=bias)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def split_heads(self, t: torch.Tensor) -> torch.Tensor:
        """(batch, seq, heads*head_dim) -> (batch, heads, seq, head_dim); heads = what ``t`` holds."""
        b, s, width = t.shape
        return t.view(b, s, width // self.head_dim, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_heads(self.q(x)), self.split_heads(self.k(x)), self.split_heads(self.v(x))
        s = x.shape[1]
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)           # (b, heads, s, s)
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)  # position j > i: masked
        probs = self.attn_dropout(scores.masked_fill(future, float("-inf")).softmax(dim=-1))
        y = (probs @ v).transpose(1, 2).reshape(x.shape[0], s, -1)            # heads side by side again
        return self.resid_dropout(self.out(y))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg.dim, cfg.heads, cfg.dropout, cfg.bias)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg.dim, cfg.hidden, cfg.dropout, cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.shape[1] > self.cfg.seq_len:
            raise ValueError(f"tokens must be (batch, seq) with seq <= {self.cfg.seq_len}, "
                             f"got shape {tuple(tokens.shape)}")
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.dropout(self.tok_emb(tokens) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: normal(0, 0.02) weights, zero biases (LayerNorm keeps ones and zeros)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


def transformer(cfg: TransformerConfig | None = None, seed: int = 0) -> Transformer:
    """The model of ``cfg``, its weights a function of ``seed`` alone; the caller's RNG is left as it was."""
    cfg = cfg or TransformerConfig()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Transformer(cfg)
        model.apply(_init_weights)
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the next token, averaged over every position of every sequence."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass(frozen=True)
class LMTrainConfig:
    """A training run of the small transformer (the same on every rank)."""

    model: TransformerConfig = TransformerConfig()
    steps: int = 20
    batch_size: int = 16   # the global batch: data-parallel ranks each take an equal slice of it
    lr: float = 3e-3
    optimizer: str = "adamw"   # or "sgd" (with momentum 0.9): see make_optimizer
    n: int = 512           # sequences in the data set
    seed: int = 0

    def with_(self, **changes) -> LMTrainConfig:
        return replace(self, **changes)


def batch_indices(cfg: LMTrainConfig) -> list[torch.Tensor]:
    """The data set indices of each step's global batch: a function of ``cfg.seed`` alone."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return [torch.randint(cfg.n, (cfg.batch_size,), generator=g) for _ in range(cfg.steps)]


def make_optimizer(params, cfg: LMTrainConfig) -> torch.optim.Optimizer:
    """AdamW (no weight decay), the transformer's usual optimizer, or SGD with momentum.

    To compare two layouts' *weights*, use SGD: a weight then differs by the learning rate times the
    difference of the gradients, a direct measure of the parallel arithmetic. Adam divides each gradient by
    its running size, so an element whose gradient is nearly zero (1e-9) moves by a sizeable fraction of the
    learning rate in a direction set by rounding noise: equal losses, weights equal only to ~1e-5 (notebook 12).
    """
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}: use 'adamw' or 'sgd'")


def train_reference(cfg: LMTrainConfig | None = None) -> dict:
    """One process trains the model on each step's global batch: the loss of every step, the final weights
    (``state``) and the gradients of the first step (``first_grads``, before any optimizer step).

    Every parallel layout of the course (tensor, sequence, 2-D) must end where this ends.
    """
    from ..data import make_token_dataset

    cfg = cfg or LMTrainConfig()
    inputs, targets = make_token_dataset(cfg.n, cfg.model.seq_len, cfg.model.vocab, seed=cfg.seed).tensors
    model = transformer(cfg.model, seed=cfg.seed)
    opt = make_optimizer(model.parameters(), cfg)
    losses, first_grads = [], {}
    with torch.random.fork_rng(devices=[]):    # dropout's masks: from the seed, the caller's RNG untouched
        torch.manual_seed(cfg.seed)
        for idx in batch_indices(cfg):
            opt.zero_grad()
            loss = lm_loss(model(inputs[idx]), targets[idx])
            loss.backward()
            if not first_grads:
                first_grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
            opt.step()
            losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "first_grads": first_grads}
