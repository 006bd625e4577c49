"""A small GPT-style character language model in plain torch.

Pre-LayerNorm transformer blocks (causal multi-head self-attention, then a GELU
MLP), learned position embeddings, an untied output head. The default size
(2 layers, width 128, 4 heads, context 128: about 0.43 M parameters) is chosen
so that four peers sharing two CPU cores still see the loss fall within a
couple of minutes.

A batch is an int64 tensor ``(rows, context + 1)`` of token ids as produced by
:class:`p2ptrain.examples.charlm.data.BatchSampler`: the model reads the first
``context`` tokens of each row and predicts the last ``context``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

__all__ = [
    "CharTransformer",
    "ModelConfig",
    "evaluate",
    "generate",
    "loss",
    "make_model",
    "make_optimizer",
]


@dataclass(frozen=True)
class ModelConfig:
    """Shape and initialisation of a :class:`CharTransformer`.

    Attributes:
        vocab_size: Number of tokens (73 for the shipped King James text).
        context: Longest input the model reads (``seq_len`` of the sampler).
        d_model: Width of the residual stream.
        n_layers: Number of transformer blocks.
        n_heads: Attention heads per block; must divide ``d_model``.
        mlp_ratio: Hidden width of the MLP as a multiple of ``d_model``.
        seed: Seed of the weight initialisation; equal seeds give equal weights.
    """

    vocab_size: int = 73
    context: int = 128
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.d_model % self.n_heads:
            raise ValueError("n_heads must divide d_model")
        if self.seed < 0:
            raise ValueError("seed must be non-negative")


class _SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, length, width = x.shape
        qkv = self.qkv(x).view(rows, length, 3, self.n_heads, width // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(rows, length, width))
        return out


class _Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = _SelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.fc = nn.Linear(config.d_model, hidden)
        self.out = nn.Linear(hidden, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


class CharTransformer(nn.Module):
    """Decoder-only transformer over characters; build it with :func:`make_model`.

    Args:
        config: The model's shape. Weights are left at torch's defaults;
            :func:`make_model` gives them their seeded initialisation.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.positions = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``(rows, length, vocab_size)`` for ids ``(rows, length)``.

        Raises:
            ValueError: ``ids`` is not 2-D or is longer than the context.
        """
        if ids.dim() != 2:
            raise ValueError(f"ids must be (rows, length), got shape {tuple(ids.shape)}")
        length = ids.shape[1]
        if length > self.config.context:
            raise ValueError(f"length {length} exceeds the context {self.config.context}")
        x = self.tokens(ids) + self.positions.weight[:length]
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def _initialise(model: CharTransformer, seed: int) -> None:
    """GPT-2 style: N(0, 0.02) weights, zero biases, residual outputs scaled by depth."""
    generator = torch.Generator().manual_seed(seed)
    blocks = [module for module in model.modules() if isinstance(module, _Block)]
    residual = {id(block.attn.proj) for block in blocks} | {id(block.out) for block in blocks}
    residual_std = 0.02 / math.sqrt(2 * model.config.n_layers)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, 0.02, generator=generator)
            elif isinstance(module, nn.Linear):
                std = residual_std if id(module) in residual else 0.02
                module.weight.normal_(0.0, std, generator=generator)
                module.bias.zero_()


def make_model(config: ModelConfig) -> CharTransformer:
    """Build a model with weights drawn from ``config.seed`` (same config, same weights)."""
    model = CharTransformer(config)
    _initialise(model, config.seed)
    return model


def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy (nats) of ``model`` on ``batch``.

    Args:
        model: A :class:`CharTransformer` (or any module mapping ids to logits).
        batch: Int64 token ids ``(rows, length + 1)``.

    Returns:
        A scalar tensor that carries gradients.

    Raises:
        ValueError: ``batch`` is not 2-D with at least two columns.
    """
    if batch.dim() != 2 or batch.shape[1] < 2:
        raise ValueError(f"batch must be (rows, length + 1), got shape {tuple(batch.shape)}")
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def evaluate(model: nn.Module, windows: torch.Tensor, *, batch_size: int = 64) -> float:
    """Mean cross-entropy over ``windows`` without gradients (e.g. validation).

    The model is put in eval mode for the call and restored afterwards.

    Args:
        model: The model to score.
        windows: Int64 token ids ``(rows, length + 1)``.
        batch_size: Rows scored at a time.

    Returns:
        The loss in nats per character, weighted by rows.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be positive")
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        with torch.no_grad():
            for begin in range(0, windows.shape[0], batch_size):
                chunk = windows[begin : begin + batch_size]
                total += loss(model, chunk).item() * chunk.shape[0]
    finally:
        model.train(was_training)
    return total / windows.shape[0]


def make_optimizer(
    model: nn.Module, *, lr: float = 3e-3, weight_decay: float = 0.01
) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only, not on biases or norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # The fused kernel (CPU and CUDA): one call per step instead of ~10 small
    # ops per tensor. In a peer every op is a chance to wait for the GIL behind
    # the network thread; the per-tensor loop took ~100 ms of a swarm step.
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99), fused=True)
    except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99))


def generate(
    model: CharTransformer,
    prompt: torch.Tensor,
    length: int,
    *,
    temperature: float = 0.8,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample ``length`` tokens after ``prompt`` (1-D int64 ids); returns only the new ones.

    Raises:
        ValueError: An empty prompt, a negative length or a non-positive temperature.
    """
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError("prompt must be a non-empty 1-D tensor")
    if length < 0 or temperature <= 0:
        raise ValueError("length must be non-negative and temperature positive")
    was_training = model.training
    model.eval()
    ids = prompt.long()
    try:
        with torch.no_grad():
            for _ in range(length):
                logits = model(ids[-model.config.context :][None])[0, -1]
                probs = torch.softmax(logits / temperature, dim=-1)
                ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)])
    finally:
        model.train(was_training)
    return ids[prompt.numel() :]
