"""A plain hand-written PyTorch training loop: the baseline of `benchmarks/runtime_overhead.py`.

    torchrun --standalone --nproc-per-node=2 benchmarks/handwritten_train.py --strategy ddp \
        --model llama:layers=4,hidden=256,heads=4,kv_heads=2,ffn=688,vocab=512 --metrics-out m.jsonl

It does what `plait train` does for the same strategy, written the way one would by hand with the same
PyTorch APIs, and nothing of plait but the model definition (`plait.models.build_model`):

- ddp:  composable `replicate` over the 2 ranks;
- fsdp: FSDP2 `fully_shard` on every block, then on the root (ZeRO-3: reshard after forward);
- tp:   `parallelize_module`, Megatron plan (q/k/v, w1, w3 column-wise; wo, w2 row-wise, output Replicate;
        vocabulary-parallel embedding and LM head).

Same numerics as plait: same initial weights (seeded by name), the same global batch per step (synthetic
tokens seeded per step), each data-parallel rank takes its sequences of every micro-batch, loss averaged
over micro-batches, AdamW (betas 0.9/0.95, weight decay 0.1), linear warm-up then cosine learning rate,
gradient clipping by the global norm. Idiomatic details a hand-written loop has: no gradient sync on
micro-batches before the last (`set_requires_gradient_sync(False)`), one foreach norm with a single
collective for clipping, loss kept on the device until one all-reduce per step.

Rank 0 writes one JSON line per step: step, loss, step_time_s, tokens_per_s, grad_norm. `Trainer(args).step(k)`
runs one step inside an existing process group (`benchmarks/runtime_overhead.py` interleaves them with plait's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from plait.models import build_model
from plait.spec.model import load_model


def lr_at(step: int, peak: float, warmup: int, steps: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def batch(step: int, seed: int, vocab: int, seq: int, gbs: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    rows = torch.randint(0, vocab, (gbs, seq + 1), generator=gen)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def tensor_parallel(model: torch.nn.Module, mesh) -> None:
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "output": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate(), use_local_output=True),
    })
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Replicate()),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Replicate()),
        })


def clip_(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torchtitan-style clipping: one foreach norm per kind of gradient (DTensor shards: a single
    collective via full_tensor; plain tensors, e.g. TP's replicated norm weights: none), one foreach mul
    on the local tensors."""
    grads = [p.grad for p in params if p.grad is not None]
    dtensors = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    square = torch.zeros(())
    if dtensors:
        norm = torch.nn.utils.get_total_norm(dtensors, 2.0, foreach=True)
        square = square + (norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    if plain:
        square = square + torch.nn.utils.get_total_norm(plain, 2.0, foreach=True) ** 2
    total = square.sqrt()
    # Scale the local tensors (TP mixes DTensor and plain gradients, which one foreach op refuses).
    torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads],
                        torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="plain hand-written DDP / FSDP2 / TP training loop")
    ap.add_argument("--strategy", choices=("ddp", "fsdp", "tp"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--gbs", type=int, default=8)
    ap.add_argument("--mbs", type=int, default=1, help="sequences per data-parallel rank per micro-batch")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--sync-every-microbatch", action="store_true",
                    help="all-reduce gradients after every micro-batch, as plait does (for attribution)")
    ap.add_argument("--metrics-out")
    return ap


class Trainer:
    """The model, optimizer and data of one run, under an initialised gloo process group; `step(k)` runs
    optimizer step k and returns its record (the same on every rank)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        rank, self.world = dist.get_rank(), dist.get_world_size()
        dp = 1 if args.strategy == "tp" else self.world
        self.dp, self.dp_index = dp, (rank if dp > 1 else 0)
        mesh = init_device_mesh("cpu", (self.world,), mesh_dim_names=("tp" if args.strategy == "tp" else "dp",))
        self.spec = load_model(args.model)
        torch.manual_seed(args.seed)
        model = build_model(self.spec, seed=args.seed)
        if args.strategy == "tp":
            tensor_parallel(model, mesh)
        elif args.strategy == "ddp":
            replicate(model, device_mesh=mesh)
        else:
            for block in model.layers.values():
                fully_shard(block, mesh=mesh, reshard_after_forward=True)
            fully_shard(model, mesh=mesh, reshard_after_forward=True)
        self.model = model
        self.params = list(model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.micro = args.gbs // (args.mbs * dp)

    def step(self, step: int) -> dict:
        args, model, micro = self.args, self.model, self.micro
        t0 = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, args.lr, args.warmup, args.steps)
        inputs, targets = batch(step, args.seed, self.spec.vocab, args.seq, args.gbs)
        loss_sum = torch.zeros(())
        for k in range(micro):
            lo = k * args.mbs * self.dp + self.dp_index * args.mbs
            x, y = inputs[lo: lo + args.mbs], targets[lo: lo + args.mbs]
            if args.strategy != "tp" and not args.sync_every_microbatch:
                model.set_requires_gradient_sync(k == micro - 1)
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            (loss / micro).backward()
            loss_sum += loss.detach()
        grad_norm = clip_(self.params, args.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)
        elapsed = time.perf_counter() - t0
        return {"step": step, "loss": float(loss_sum) / (micro * self.world), "step_time_s": elapsed,
                "tokens_per_s": args.gbs * args.seq / elapsed, "grad_norm": float(grad_norm)}


def train(args: argparse.Namespace) -> list[dict]:
    """Train under an initialised gloo process group; returns one record per step (the same on every rank)."""
    trainer = Trainer(args)
    return [trainer.step(k) for k in range(args.steps)]


def main() -> None:
    args = parser().parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    records = train(args)
    if dist.get_rank() == 0 and args.metrics_out:
        with open(args.metrics_out, "w") as out:
            out.writelines(json.dumps(r) + "\n" for r in records)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
