"""Stacks of layers of several kinds: local and global attention, dense and MoE layers, encoder-decoders,
vision towers. Each builder returns the layers in model order (`ModelSpec.stack`).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import isqrt

from plait.errors import PlaitError
from plait.spec.layers import IMAGE_CHANNELS, Block, Gating


def windowed(block: Block, layers: int, window: int, global_every: int = 0,
             local: tuple[bool, ...] | None = None) -> tuple[Block, ...]:
    """`layers` copies of `block`, each local (sliding window of `window` tokens) or global: as `local`
    lists them, else every `global_every`-th layer global (Gemma-2: 2, Gemma-3: 6), else all local."""
    if local is None:
        local = tuple(not (global_every and (i + 1) % global_every == 0) for i in range(layers))
    if len(local) != layers:
        raise PlaitError(f"layer types list {len(local)} layers but the model has {layers}; give one per layer")
    near, far = block.with_(window=window), block.with_(window=0)
    return tuple(near if is_local else far for is_local in local)


def moe_layers(block: Block, layers: int, experts: int, top_k: int, expert_ffn: int, shared_ffn: int = 0,
               dense_first: int = 0, every: int = 1, dense: tuple[int, ...] = (), expert_groups: int = 0,
               group_top_k: int = 0, gating: Gating = Gating()) -> tuple[Block, ...]:
    """`layers` layers of which the first `dense_first` (DeepSeek's first_k_dense_replace), those listed in
    `dense` (Qwen-MoE's mlp_only_layers) and those off the `every` step (decoder_sparse_step) are `block`
    (dense); the rest route each token to `top_k` of `experts` experts of width `expert_ffn` (from the
    `group_top_k` best of `expert_groups` groups, when given), beside shared experts of total width `shared_ffn`,
    weighed as `gating` says."""
    moe = block.with_(kind="moe", experts=experts, top_k=top_k, expert_ffn=expert_ffn, ffn=shared_ffn,
                      expert_groups=expert_groups, group_top_k=group_top_k, gating=gating)
    every = max(every, 1)
    return tuple(block if (i < dense_first or i in dense or (i + 1) % every) else moe for i in range(layers))


MTP_NORMS = 3
"""Norms a multi-token-prediction module adds to its layer: of the embedding, of the hidden state, and final."""


def with_mtp(stack: tuple[Block, ...], modules: int) -> tuple[Block, ...]:
    """`stack` followed by `modules` multi-token-prediction modules, each around a copy of its last layer
    (`Block.mtp`; DeepSeek-V3's is one of its MoE layers)."""
    if modules < 0:
        raise PlaitError(f"multi-token-prediction modules must be >= 0, got {modules}")
    last = stack[-1]
    return stack + (last.with_(mtp=True, norms=last.norms + MTP_NORMS),) * modules


def encoder_decoder(block: Block, encoder_layers: int, decoder_layers: int) -> tuple[Block, ...]:
    """T5: `encoder_layers` bidirectional layers, then `decoder_layers` causal layers with cross-attention
    to the encoder's output (one more norm each)."""
    if encoder_layers <= 0 or decoder_layers <= 0:
        raise PlaitError(f"an encoder-decoder needs encoder and decoder layers, got {encoder_layers} and "
                         f"{decoder_layers}")
    return ((block.with_(kind="encoder"),) * encoder_layers
            + (block.with_(kind="cross_decoder", norms=block.norms + 1),) * decoder_layers)


@dataclass(frozen=True)
class VisionTower:
    """A ViT/CLIP/SigLIP image encoder. Widths in elements; image and patch sizes in pixels."""

    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    image: int
    patch: int
    class_token: bool = True  # CLIP prepends a class token; SigLIP does not
    pre_norm: bool = True  # CLIP normalises the patch embeddings before the first layer

    @property
    def patches(self) -> int:
        """Patches per image."""
        if self.image % self.patch:
            raise PlaitError(f"vision tower {self.name}: image size {self.image} is not a multiple of the patch "
                             f"size {self.patch}")
        return (self.image // self.patch) ** 2

    @property
    def tokens(self) -> int:
        """Tokens per image inside the tower (patches + the class token)."""
        return self.patches + self.class_token


VISION_TOWERS: dict[str, VisionTower] = {
    # CLIP ViT-L/14 (Radford et al. 2021) at 224 and 336 pixels (LLaVA-1.5/NeXT use the 336 one).
    "clip-l14": VisionTower("clip-l14", 24, 1024, 16, 4096, 224, 14),
    "clip-l14-336": VisionTower("clip-l14-336", 24, 1024, 16, 4096, 336, 14),
    # SigLIP so400m/14 at 384 pixels (Zhai et al. 2023): no class token, no pre-norm.
    "siglip-so400m": VisionTower("siglip-so400m", 27, 1152, 16, 4304, 384, 14, class_token=False, pre_norm=False),
    # A tiny CLIP-style tower for tests and CPU runs: 32-pixel images in 16 patches of 8 pixels, + class token.
    "tiny-vit": VisionTower("tiny-vit", 2, 64, 4, 128, 32, 8),
}


def image_patches(patch_embed: Block) -> int:
    """Patches per image of a patch embedding: its tokens, less the class token when they do not form a
    square grid (towers cut square images into square patches)."""
    side = isqrt(patch_embed.tokens)
    return patch_embed.tokens if side * side == patch_embed.tokens else patch_embed.tokens - 1


def vision_stack(tower: VisionTower, text_hidden: int, projector_ffn: int = 0, keep_class_token: bool = False
                 ) -> tuple[Block, ...]:
    """Patch embedding, the tower's layers and a two-layer MLP projector into the text model's width
    (LLaVA's mlp2x_gelu); the projector passes the patches on (the class token is dropped unless kept).
    The image tokens take their place in the text sequence, which counts them."""
    patch = Block(kind="patch_embed", hidden=tower.hidden, in_dim=IMAGE_CHANNELS * tower.patch ** 2,
                  tokens=tower.tokens, bias=False, norms=1 if tower.pre_norm else 0, dropout=False)
    layer = Block(kind="vision", hidden=tower.hidden, heads=tower.heads, ffn=tower.ffn, tokens=tower.tokens,
                  dropout=False)
    projector = Block(kind="projector", hidden=text_hidden, in_dim=tower.hidden, ffn=projector_ffn or text_hidden,
                      tokens=tower.tokens if keep_class_token else tower.patches, norms=0, dropout=False)
    return (patch, *(layer,) * tower.layers, projector)
