"""LLaVA-style vision + text model on the shared transformer (`plait.models.llama`): a patch embedding,
ViT layers and an MLP projector in front of the text model's decoder layers (`plait.spec.stacks.vision_stack`).

The first `image_tokens` positions of every text sequence hold the image: the projector's outputs take
their place, and the loss counts only the text tokens after them (`image_targets`). Up to the projector the
carried state is one flat tensor per sample, [B, tokens x width + (T - image_tokens) x H]: the image (pixels
before the patch embedding, then the tower's hidden state of its own width) followed by the embeddings of
the text tokens, which pass through the tower untouched. The projector is the boundary where the width
changes: it hands the text layers [B, T, H]. So the tower's width may differ from the text model's, and
pipeline stages carry exactly the elements `ModelSpec.carried_elements` prices; the tower and projector
run without sequence splits (sp, cp), which their token counts rarely allow anyway.

Images are synthetic and deterministic: patch i of a sample is row tokens[i] of a fixed N(0, 1) table
[vocab, channels x patch^2] (seeded by `IMAGE_SEED`), so every plan trains on the same images.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from plait.models.gpt import MLP
from plait.models.llama import Transformer, TransformerBlock
from plait.models.parts import gelu, gelu_tanh, norm, pre_norm_layer
from plait.spec.layers import Block
from plait.spec.model import ModelSpec
from plait.spec.stacks import image_patches

IMAGE_SEED = 7_919
"""Seed of the table that turns a sample's tokens into its image's patches."""
IGNORE_INDEX = -100
"""Target of a position the loss leaves out (PyTorch's cross-entropy default)."""


def pack(image: Tensor, text: Tensor) -> Tensor:
    """(image [B, N, W], text [B, ...]) -> the flat carried state [B, N x W + text elements]."""
    return torch.cat([image.flatten(1), text.flatten(1)], dim=1)


def unpack(x: Tensor, tokens: int, width: int) -> tuple[Tensor, Tensor]:
    """The flat carried state -> (image [B, tokens, width], text [B, rest] flat)."""
    image, text = x.split([tokens * width, x.shape[1] - tokens * width], dim=1)
    return image.view(x.shape[0], tokens, width), text


def image_targets(targets: Tensor, spec: ModelSpec) -> Tensor:
    """Next-token targets [B, T] with those predicted at image positions left out (all but the last image
    position, which predicts the first text token)."""
    first_text = spec.image_tokens
    if first_text <= 1:
        return targets
    out = targets.clone()
    out[:, : first_text - 1] = IGNORE_INDEX
    return out


class PatchEmbed(nn.Module):
    """Pixels of P patches -> the tower's tokens: a linear projection, a class token in front (when the
    tower has one), learned positions and the pre-norm (when it has one)."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        self.patches, self.in_dim = image_patches(block), block.in_dim
        self.proj = nn.Linear(block.in_dim, block.hidden, bias=block.bias)
        self.class_token = nn.Parameter(torch.empty(block.hidden)) if block.tokens > self.patches else None
        self.positions = nn.Embedding(block.tokens, block.hidden)
        self.pre_norm = norm(block) if block.norms else None

    def forward(self, x: Tensor, freqs: Tensor | None = None) -> Tensor:
        pixels, text = unpack(x, self.patches, self.in_dim)
        h = self.proj(pixels)
        if self.class_token is not None:
            h = torch.cat([self.class_token.expand(h.shape[0], 1, -1), h], dim=1)
        h = h + self.positions.weight
        if self.pre_norm is not None:
            h = self.pre_norm(h)
        return pack(h, text)


class VisionLayer(TransformerBlock):
    """A bidirectional pre-norm layer on the tower's tokens [B, tokens, width] of the carried state."""

    def __init__(self, *parts: nn.Module | float, tokens: int, width: int) -> None:
        super().__init__(*parts)  # type: ignore[arg-type]
        self.tokens, self.width = tokens, width

    def forward(self, x: Tensor, freqs: Tensor | None = None) -> Tensor:
        h, text = unpack(x, self.tokens, self.width)
        return pack(super().forward(h), text)


class Projector(nn.Module):
    """The tower's tokens [B, tokens, in_dim] -> the image's text positions [B, P, H] (LLaVA's two-layer
    GELU MLP, the class token dropped unless kept), put in front of the text embeddings: [B, T, H]."""

    def __init__(self, block: Block, tower_tokens: int) -> None:
        super().__init__()
        self.tower_tokens, self.in_dim = tower_tokens, block.in_dim
        self.image_tokens, self.hidden = block.seq(0), block.hidden
        self.feed_forward = MLP(block, gelu)

    def forward(self, x: Tensor, freqs: Tensor | None = None) -> Tensor:
        tower, text = unpack(x, self.tower_tokens, self.in_dim)
        image = self.feed_forward(tower[:, self.tower_tokens - self.image_tokens:])
        return torch.cat([image, text.view(x.shape[0], -1, self.hidden)], dim=1)


class Llava(Transformer):
    """Patch embedding, vision layers and projector, then the text model's decoder layers (Llama- or
    GPT-shaped, as their Block says); the text model's embedding and head."""

    def __init__(self, spec: ModelSpec, dropout: float = 0.0) -> None:
        stack = spec.stack

        def make_layer(i: int, block: Block) -> nn.Module:
            if block.kind == "patch_embed":
                return PatchEmbed(block)
            if block.kind == "vision":
                return pre_norm_layer(block, dropout, gelu, VisionLayer, tokens=block.tokens, width=block.hidden)
            if block.kind == "projector":
                return Projector(block, stack[i - 1].seq(0))
            return pre_norm_layer(block, dropout, gelu_tanh)

        super().__init__(spec, lambda: norm(spec.block), None, dropout, make_layer)
        self.image_tokens, self.patches, self.patch_dim = spec.image_tokens, image_patches(stack[0]), stack[0].in_dim
        self.image_table: Tensor
        self.register_buffer("image_table", self._image_table(), persistent=False)

    def _image_table(self, device: torch.device | str | None = None) -> Tensor:
        gen = torch.Generator().manual_seed(IMAGE_SEED)
        return torch.randn(self.spec.vocab, self.patch_dim, generator=gen, device="cpu").to(device or "cpu")

    def embed(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        """tokens [B, T] -> the flat state the patch embedding reads: the image's pixels [B, P, C x p^2],
        then the embeddings of the text tokens after the image positions."""
        text = super().embed(tokens, positions)[:, self.image_tokens:]
        return pack(self.image_table[tokens[:, : self.patches]], text)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        super().init_weights(seed)
        self.image_table = self._image_table(self.image_table.device)
