"""Multi-token prediction (DeepSeek-V3's MTP modules, Megatron-LM's `--mtp-num-layers`).

The model's stack ends in `mtp_layers` modules (`Block.mtp`). Module k (1, 2, ...) predicts the token k + 1
places ahead: from the previous depth's normed hidden state h (the trunk's after its final norm for k = 1) and
the embedding of the token k places ahead, it computes

    h_k = final_norm(layer(eh_proj([enorm(embed(t[i + k])); hnorm(h[i])])))

(eh_proj [2H -> H], the embedding first as in DeepSeek-V3's and Megatron-LM's code; `layer` a copy of the
trunk's last layer kind) and its logits through the model's shared head. Position i's target at depth k is
t[i + k + 1]: the last k positions of a sequence have none and leave the loss. The loss is the trunk's plus
MTP_LOSS_SCALE times the mean over the depths (Megatron-LM's `--mtp-loss-scaling-factor`).

The tokens ahead are the step's targets (`next_tokens[i]` = t[i + 1]), so the last pipeline stage, which holds
the modules and the head, needs nothing else from the first; it looks them up in its own copy of the embedding
table, whose gradient is summed with the first stage's like a tied head's (`plait.runtime.placement`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.models.llama import TransformerBlock

MTP_LOSS_SCALE = 0.1
"""Weight of the mean multi-token-prediction loss beside the trunk's (Megatron-LM's default
--mtp-loss-scaling-factor; DeepSeek-V3 trained with 0.3, then 0.1)."""


class MTPLayer(TransformerBlock):
    """One multi-token-prediction module: the layer's attention and feed-forward (as its parts) between the
    projection of the normed embedding and hidden state and a final norm. [B, T, H] -> [B, T, H]."""

    def __init__(self, layer: TransformerBlock, make_norm: Callable[[], nn.Module], hidden: int) -> None:
        super().__init__(layer.attention_norm, layer.attention, layer.ffn_norm, layer.feed_forward,
                         layer.dropout)
        self.enorm, self.hnorm = make_norm(), make_norm()
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.final_norm = make_norm()

    def forward(self, x: Tensor, freqs: Tensor | None = None,  # type: ignore[override]
                embedded: Tensor | None = None) -> Tensor:
        """x: the previous depth's normed hidden state; `embedded`: the embeddings of the tokens ahead."""
        assert embedded is not None, "a multi-token-prediction module needs the tokens ahead, embedded"
        h = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(x)], dim=-1))
        return self.final_norm(super().forward(h, freqs))


def mtp_loss(outputs: Tensor, targets: Tensor) -> Tensor:
    """The trunk's mean cross-entropy plus MTP_LOSS_SCALE times the mean over the depths of each depth's
    mean cross-entropy on the positions that have a target: outputs [1 + D, B, T, V] (the trunk's logits,
    then each depth's), targets [B, T] (the next tokens)."""
    t, v = targets.shape[1], outputs.shape[-1]
    main = F.cross_entropy(outputs[0].reshape(-1, v), targets.reshape(-1))
    depths = [F.cross_entropy(outputs[k][:, : t - k].reshape(-1, v), targets[:, k:].reshape(-1))
              for k in range(1, outputs.shape[0])]
    return main + MTP_LOSS_SCALE * torch.stack(depths).mean()


def next_token_kwargs(chunk: nn.Module, targets: Tensor | None) -> dict[str, Tensor]:
    """The keyword a chunk holding multi-token-prediction modules takes in forward (`next_tokens`: its
    micro-batch's targets), or none."""
    return {"next_tokens": targets} if targets is not None and getattr(chunk, "holds_mtp", False) else {}
