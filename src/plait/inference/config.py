"""What a selective KV cache keeps: the method, the token budget and each method's knobs."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

METHODS = ("pqcache", "full", "window", "h2o", "snapkv")


class PQCacheConfig(BaseModel):
    """A decode step attends to `budget` past tokens (a fraction of the prompt when < 1, else a count):
    always the first `sinks` and the last `recent`, the rest chosen by the method.

    - pqcache: the middle tokens with the highest approximate q . k from product-quantised keys
      (`subspaces` sub-spaces of 2^`bits` centroids each, `iterations` k-means steps at prefill);
    - window (StreamingLLM): the sinks and the most recent tokens only;
    - h2o (Zhang et al. 2023): half the budget is the recent window (at least `recent`), the rest heavy
      hitters: the tokens, prompt and decoded alike, with the highest attention accumulated so far (every
      step adds its attention to the tokens it read; one token leaves per step); evicted ones never return;
    - snapkv: chosen once at prefill by the attention of the prompt's last `observation` queries, max-pooled
      over `pool` neighbouring tokens; every decoded token is kept;
    - full: every token (exact attention; the reference).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str = "pqcache"
    budget: float = Field(default=0.2, gt=0)
    sinks: int = Field(default=4, ge=0)
    recent: int = Field(default=32, ge=1)
    subspaces: int = Field(default=8, ge=1)
    bits: int = Field(default=6, ge=1, le=8)
    iterations: int = Field(default=8, ge=1)
    observation: int = Field(default=32, ge=1)
    pool: int = Field(default=7, ge=1)
    measure_recall: bool = False

    @field_validator("budget")
    @classmethod
    def _budget(cls, budget: float) -> float:
        """Below 1 a fraction of the context, from 2 a whole number of tokens: nothing in between."""
        if not math.isfinite(budget) or 1 <= budget < 2 or (budget >= 2 and budget != int(budget)):
            raise ValueError(f"budget must be a fraction below 1 or a whole number of tokens from 2, got {budget:g}")
        return budget

    @model_validator(mode="after")
    def _known(self) -> PQCacheConfig:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        return self

    def tokens(self, context: int) -> int:
        """Past tokens a decode step attends to, for a prompt of `context` tokens."""
        wanted = round(self.budget * context) if self.budget < 1 else int(self.budget)
        return max(wanted, self.sinks + self.recent)

    def h2o_recent(self, budget: int) -> int:
        """h2o's recent window for a budget of `budget` tokens: half of it, as H2O splits its cache evenly
        between heavy hitters and recent tokens, and never fewer than `recent`."""
        return min(budget, max(self.recent, budget // 2))
