"""Run under torchrun (4 ranks): packed-document attention on groups of ranks against one process.

Writes {case: worst relative error} (JSON) to the path in argv[1] from rank 0. Cases: ring attention alone
(forward, dq, dk, dv) on groups of 4 and 2 ranks, including a group of non-neighbouring ranks; and a whole
Llama forward and backward (logits and every parameter's gradient summed over the group) run alone, with
Ulysses and with ring attention over groups that change from call to call.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.models import build_model
from plait.runtime.packing import IGNORE, document_mask, pack, zigzag
from plait.runtime.ring import RingLayout, ring_attention
from plait.runtime.varlen import masked, padding_multiple, run_group
from plait.spec.model import load_model

LENGTHS = [5, 17, 3, 30, 9, 1, 12]
GROUPS = [(0, 1, 2, 3), (1, 3), (0, 2), (2, 3)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def ring_case(group_ranks: tuple[int, ...], group, rank: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(7)
    docs = [torch.randint(0, 100, (n + 1,), generator=gen) for n in LENGTHS]
    packed = pack(docs, padding_multiple(len(group_ranks), "ring"))
    t = packed.length
    q, k, v, w = (torch.randn(1, 4, t, 8, generator=gen) for _ in range(4))
    place = torch.arange(t)
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, attn_mask=document_mask(packed.documents, place, packed.documents,
                                                                       place))
    (out * w).sum().backward()
    if rank not in group_ranks:
        return {}
    parts = zigzag(t, len(group_ranks))
    me = parts[group_ranks.index(rank)]
    layout = RingLayout(group, group_ranks, tuple(parts), tuple(packed.documents[p] for p in parts))
    mine = [x[:, :, me].clone().requires_grad_() for x in (q, k, v)]
    got = ring_attention(*mine, layout=layout)
    (got * w[:, :, me]).sum().backward()
    errors = {"out": rel(got.detach(), out.detach()[:, :, me])}
    for name, a, b in zip("qkv", mine, ref):
        errors[f"d{name}"] = rel(a.grad, b.grad[:, :, me])
    return errors


def model_case(group_ranks: tuple[int, ...], group, mode: str, rank: int) -> dict[str, float]:
    spec = load_model("tiny-llama")
    gen = torch.Generator().manual_seed(11)
    docs = [torch.randint(0, spec.vocab, (n + 1,), generator=gen) for n in LENGTHS]
    reference = build_model(spec)
    reference.init_weights(3)
    whole = pack(docs)
    place = torch.arange(whole.length)
    logits = reference(whole.tokens[None], whole.positions,
                       masked(document_mask(whole.documents, place, whole.documents, place)))[0]
    F.cross_entropy(logits, whole.targets, ignore_index=IGNORE, reduction="sum").backward()
    if rank not in group_ranks:
        return {}
    model = build_model(spec)
    model.init_weights(3)
    packed = pack(docs, padding_multiple(len(group_ranks), mode))
    local, targets = run_group(model, packed, group_ranks, mode, group)
    F.cross_entropy(local, targets, ignore_index=IGNORE, reduction="sum").backward()
    real = targets != IGNORE  # padding rows exist only in the packed row
    if mode == "ring":
        me = zigzag(packed.length, len(group_ranks))[group_ranks.index(rank)]
    else:
        d, i = len(group_ranks), group_ranks.index(rank)
        me = torch.arange(i * packed.length // d, (i + 1) * packed.length // d)
    keep = me[real]
    errors = {"logits": rel(local.detach()[real], logits.detach()[keep])}
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        grad = p.grad.clone()
        if group is not None:
            dist.all_reduce(grad, group=group)
        worst = max(worst, rel(grad, q.grad))
    errors["grads"] = worst
    return errors


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    groups = {g: dist.new_group(list(g)) for g in GROUPS}
    results: dict[str, float] = {}
    for g in GROUPS:
        for key, value in ring_case(g, groups[g], rank).items():
            results[f"ring {g} {key}"] = value
        for mode in ("ulysses", "ring"):
            for key, value in model_case(g, groups[g], mode, rank).items():
                results[f"llama {mode} {g} {key}"] = value
    for key, value in model_case((rank,), None, "ulysses", rank).items():
        results[f"llama alone {key}"] = value
    gathered: list[dict] = [{}] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rank == 0:
        worst: dict[str, float] = {}
        for r in gathered:
            for key, value in r.items():
                worst[key] = max(worst.get(key, 0.0), value)
        with open(sys.argv[1], "w") as fh:
            json.dump(worst, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
