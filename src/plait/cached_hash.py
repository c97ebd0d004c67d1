"""Hash once: the frozen value objects that key the cost model's caches (layer shapes, strategies, contexts,
group shapes, GPUs) keep their hash after the first call instead of hashing every field again on each
cached pricing call. The cached hash stays out of pickles and copies (a copy may be updated, and a string's
hash differs between processes, so an object sent to a worker hashes afresh there)."""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T", bound=type)

_KEY = "_hash"


def cached_hash(cls: T) -> T:
    """Class decorator for a frozen dataclass (applied above `@dataclass(frozen=True)`) or a frozen pydantic
    model: the same hash as before, computed once per instance."""
    compute = cls.__hash__
    get_state = cls.__getstate__

    def __hash__(self: Any) -> int:
        d = self.__dict__
        h = d.get(_KEY)
        if h is None:
            h = d[_KEY] = compute(self)
        return h

    def __getstate__(self: Any) -> Any:
        state = get_state(self)
        inner = state.get("__dict__", state) if isinstance(state, dict) else None
        if not (isinstance(inner, dict) and _KEY in inner):
            return state
        inner = {k: v for k, v in inner.items() if k != _KEY}
        return {**state, "__dict__": inner} if "__dict__" in state else inner

    cls.__hash__ = __hash__  # type: ignore[assignment]
    cls.__getstate__ = __getstate__  # type: ignore[assignment]
    for name in ("__copy__", "__deepcopy__"):  # pydantic's model_copy(update=...) copies __dict__, then updates
        if hasattr(cls, name):
            setattr(cls, name, _forgetting(getattr(cls, name)))
    return cls


def _forgetting(copier: Any) -> Any:
    """`copier` whose copy drops the cached hash (the copy may be updated afterwards)."""

    def copy(self: Any, *args: Any) -> Any:
        result = copier(self, *args)
        result.__dict__.pop(_KEY, None)
        return result

    return copy
