"""GPT-2 / GPT-3 (Megatron) on the shared transformer: LayerNorm, GELU(tanh) MLP, learned positions,
biases on every linear, output head tied to the token embedding. Shapes as in `plait.models.llama`."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from plait.models.llama import Transformer
from plait.spec.model import ModelSpec


class MLP(nn.Module):
    """w2(gelu_tanh(w1 x)), [B, T, H] -> [B, T, H]; w1 up [H -> ffn], w2 down [ffn -> H]."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        bias = spec.bias or spec.mlp_bias
        self.w1 = nn.Linear(spec.hidden, spec.ffn, bias=bias)
        self.w2 = nn.Linear(spec.ffn, spec.hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class GPT(Transformer):
    """GPT: pre-LayerNorm blocks (eps 1e-5, as GPT-2), GELU MLP, `pos_embeddings` [max_seq_len, H]."""

    def __init__(self, spec: ModelSpec, dropout: float = 0.0) -> None:
        super().__init__(spec, lambda: nn.LayerNorm(spec.hidden, eps=1e-5), lambda: MLP(spec), dropout)
