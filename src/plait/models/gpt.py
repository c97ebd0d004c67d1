"""GPT-2 / GPT-3 (Megatron) on the shared transformer: LayerNorm, GELU(tanh) MLP, learned positions,
biases on every linear, output head tied to the token embedding. Shapes as in `plait.models.llama`."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch.nn.functional as F
from torch import Tensor, nn

from plait.models.llama import Transformer
from plait.spec.layers import Block
from plait.spec.model import ModelSpec

gelu_tanh: Callable[[Tensor], Tensor] = partial(F.gelu, approximate="tanh")


class MLP(nn.Module):
    """w2(act(w1 x)), [B, T, in] -> [B, T, H]; w1 up [in -> ffn], w2 down [ffn -> H]. The input width is
    the hidden size, or a projector's `in_dim` (the vision tower's width); `act` GELU(tanh) by default."""

    def __init__(self, spec: ModelSpec | Block, act: Callable[[Tensor], Tensor] = gelu_tanh) -> None:
        super().__init__()
        bias = spec.bias or spec.mlp_bias
        self.act = act
        self.w1 = nn.Linear(getattr(spec, "in_dim", 0) or spec.hidden, spec.ffn, bias=bias)
        self.w2 = nn.Linear(spec.ffn, spec.hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.act(self.w1(x)))


class GPT(Transformer):
    """GPT: pre-LayerNorm blocks (eps 1e-5, as GPT-2), GELU MLP, `pos_embeddings` [max_seq_len, H]."""

    def __init__(self, spec: ModelSpec, dropout: float = 0.0) -> None:
        super().__init__(spec, lambda: nn.LayerNorm(spec.hidden, eps=1e-5), lambda: MLP(spec), dropout)
