"""T5-style encoder-decoder on the shared transformer (`plait.models.llama`).

The state every layer reads and writes is one tensor, [B, T, 2H]: the encoder's hidden state in
[..., :H] and the decoder's in [..., H:], token by token. Encoder layers update the first half and pass the
second through; decoder layers read the first half as memory (cross-attention) and update the second. So
pipeline stages, re-layouts and sequence splits (Megatron sp, Ulysses cp) see one sequence of T tokens, and
the encoder and the decoder read T tokens each (the cost model's encoder-decoder carries 2 x T x H per
sample too).

Data: the encoder reads the sequence; the decoder, teacher-forced on the same tokens, predicts each next
token (a sequence-to-sequence copy task). Positions: rotary in the self-attentions (T5's relative position
biases are left out, as the cost model does), none in the cross-attentions. The last encoder layer applies
the encoder's final norm (`output_norm`) to the memory; the head applies the decoder's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from plait.models.llama import Attention, Transformer, TransformerBlock
from plait.models.parts import norm, pre_norm_layer, relu
from plait.spec.layers import Block
from plait.spec.model import ModelSpec


def split(x: Tensor) -> tuple[Tensor, Tensor]:
    """The carried state [B, T, 2H] -> (encoder [B, T, H], decoder [B, T, H])."""
    encoder, decoder = x.chunk(2, dim=-1)
    return encoder, decoder


def join(encoder: Tensor, decoder: Tensor) -> Tensor:
    """(encoder [B, T, H], decoder [B, T, H]) -> the carried state [B, T, 2H]."""
    return torch.cat([encoder, decoder], dim=-1)


class EncoderLayer(TransformerBlock):
    """Bidirectional pre-norm layer on the encoder half of the carried state; the last one of the encoder
    also applies its final norm (`output_norm`)."""

    def __init__(self, *parts: nn.Module | float, output_norm: nn.Module | None = None) -> None:
        super().__init__(*parts)  # type: ignore[arg-type]
        self.output_norm = output_norm

    def forward(self, x: Tensor, freqs: Tensor | None = None) -> Tensor:
        encoder, decoder = split(x)
        encoder = super().forward(encoder, freqs)
        if self.output_norm is not None:
            encoder = self.output_norm(encoder)
        return join(encoder, decoder)


class CrossDecoderLayer(TransformerBlock):
    """Causal self-attention, cross-attention to the memory (the encoder half), MLP: each pre-norm with a
    residual, on the decoder half of the carried state."""

    def __init__(self, *parts: nn.Module | float, cross_attention_norm: nn.Module, cross_attention: Attention
                 ) -> None:
        super().__init__(*parts)  # type: ignore[arg-type]
        self.cross_attention_norm, self.cross_attention = cross_attention_norm, cross_attention

    def forward(self, x: Tensor, freqs: Tensor | None = None) -> Tensor:
        memory, h = split(x)
        h = h + self._drop(self.through(self.attention_norm, "attention", h, freqs))
        h = h + self._drop(self.through(self.cross_attention_norm, "cross_attention", h, memory))
        h = h + self._drop(self.through(self.ffn_norm, "feed_forward", h))
        return join(memory, h)


class CrossAttention(Attention):
    """Attention of the decoder's tokens x [B, T, H] to the memory [B, T, H] (bidirectional, no rotation)."""

    def __init__(self, block: Block, dropout: float = 0.0) -> None:
        super().__init__(block, dropout, causal=False)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:  # type: ignore[override]
        return self.attend_to(x, memory)


class T5(Transformer):
    """Encoder layers, then decoder layers with cross-attention (`spec.stack`), one tied embedding; ReLU
    MLPs (SwiGLU when the spec's MLP is gated)."""

    def __init__(self, spec: ModelSpec, dropout: float = 0.0) -> None:
        last_encoder = max(i for i, b in enumerate(spec.stack) if b.kind == "encoder")

        def make_layer(i: int, block: Block) -> nn.Module:
            if block.kind == "encoder":
                return pre_norm_layer(block, dropout, relu, EncoderLayer,
                                      output_norm=norm(block) if i == last_encoder else None)
            return pre_norm_layer(block, dropout, relu, CrossDecoderLayer, cross_attention_norm=norm(block),
                                  cross_attention=CrossAttention(block, dropout))

        super().__init__(spec, lambda: norm(spec.block), None, dropout, make_layer)

    def embed(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        """tokens [B, T] -> [B, T, 2H]: the encoder's and the decoder's inputs are the same embeddings."""
        h = self.tok_embeddings(tokens)
        return join(h, h)

    def readout(self, h: Tensor) -> Tensor:
        """The decoder half of the carried state [B, T, H]."""
        return split(h)[1]
