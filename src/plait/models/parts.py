"""A layer's parts from its shape (`plait.spec.layers.Block`): the norm and MLP its fields name, and the
pre-norm attention + MLP layer the encoder, vision and decoder kinds share (names as in
`plait.models.llama`: attention_norm, attention (wq, wk, wv, wo), ffn_norm, feed_forward (w1, w2[, w3]))."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from plait.models.gpt import MLP, gelu_tanh
from plait.models.llama import Attention, FeedForward, TransformerBlock
from plait.spec.layers import Block

NORM_EPS = 1e-5
"""Epsilon of every norm (LayerNorm and RMSNorm) of the layer kinds built here."""
relu: Callable[[Tensor], Tensor] = F.relu
gelu: Callable[[Tensor], Tensor] = F.gelu


def norm(block: Block) -> nn.Module:
    """The block's norm over its hidden width: RMSNorm or LayerNorm (with a bias)."""
    return nn.RMSNorm(block.hidden, eps=NORM_EPS) if block.norm == "rmsnorm" else nn.LayerNorm(block.hidden,
                                                                                                 eps=NORM_EPS)


def feed_forward(block: Block, act: Callable[[Tensor], Tensor] = gelu_tanh) -> nn.Module:
    """SwiGLU when the block's MLP is gated, else a two-matrix MLP with activation `act`."""
    return FeedForward(block) if block.gated_mlp else MLP(block, act)


def pre_norm_layer(block: Block, dropout: float = 0.0, act: Callable[[Tensor], Tensor] = gelu_tanh,
                   layer: type[TransformerBlock] = TransformerBlock, **extra: object) -> TransformerBlock:
    """x + attention(norm(x)), then + MLP(norm(.)): causal for decoder kinds, bidirectional otherwise.
    `layer` is the class to build (a subclass taking `extra` keyword arguments)."""
    return layer(norm(block), Attention(block, dropout, causal=block.causal), norm(block), feed_forward(block, act),
                 dropout, **extra)
