"""Host memory as a budget shared by a stage's layers: a Lagrangian on host bytes around the layer DP.

The layer DP (`planner.layerwise`) fits one budget, the device's memory. Layers that offload their states or
swap activations also take host memory, which the devices of a node share: a stage may put some of its layers'
states on the host but not all. Pricing each host byte at `per_byte` seconds and solving the DP again trades
host bytes for time; the smallest price whose answer fits the device's share of host memory is found by
bisection (geometric, a few coarser DP solves), and the fastest fitting answer seen is kept. A Lagrangian only reaches
the answers on the lower convex hull of (host bytes, seconds); what lies between is left to the host fill
(`planner.host_fill`), which moves layers paged from NVMe to the host after the search.
"""

from __future__ import annotations

from collections.abc import Callable

from plait.plan import Strategy

Solution = tuple[float, list[Strategy]]
"""Seconds a step of a stage's layers (host bytes not priced) and their strategies."""

PRICE_STEP = 3.0
"""Factor by which the price of a host byte moves between tries."""
HIGHEST_PRICE = 1e6
"""Multiple of the price tried first at which a byte of host memory outweighs any time saved: where the answer
there does not fit, none does."""
CUTS = 8
"""Cuts of the price by PRICE_STEP tried while the answer still fits."""
BISECTIONS = 5
"""Geometric bisections of the price between one too low and the highest."""
REFINES = 1
"""Geometric bisections of the price between the last cut whose answer overflowed and the price that fitted."""
NEAR_FREE = 1e-3
"""Share of the unpriced answer's seconds within which a fitting answer is taken as it is."""


def within_host(solve: Callable[[float], Solution | None], probe: Callable[[float], Solution | None],
                host_bytes: Callable[[list[Strategy]], float], share: float, price: float
                ) -> tuple[Solution, float] | None:
    """The fastest answer whose `host_bytes` fit `share` bytes, with the price of a host byte that gave it
    (seconds per byte; 0 where host memory needed no price): `solve(0)` (the layer DP, host memory not
    priced) where it fits, else the fastest fitting answer of `probe(per_byte)` (a coarser, faster layer DP
    with each host byte priced at `per_byte` seconds, whose answers are valid too) over prices stepped from
    `price` (raised until an answer fits, then cut while one does); None when none fits."""
    if (free := probe(0.0)) is None:
        return None
    if host_bytes(free[1]) <= share:  # the coarse answer fits: the exact one most likely does too
        first = solve(0.0)
        return (first, 0.0) if first is not None and host_bytes(first[1]) <= share else (free, 0.0)

    def fitting(per_byte: float) -> Solution | None:
        found = probe(per_byte)
        return found if found is not None and host_bytes(found[1]) <= share else None

    if (best := fitting(price)) is None:  # the price is too low: bisect up to one that surely fits
        low, high = price, price * HIGHEST_PRICE
        if (best := fitting(high)) is None:
            return None
        for _ in range(BISECTIONS):
            mid = (low * high) ** 0.5
            if (found := fitting(mid)) is None:
                low = mid
            else:
                high, best = mid, found
        return best, high
    found_at, low = price, 0.0
    for _ in range(CUTS):  # a price that fitted at once may be higher than needed
        if best[0] <= free[0] * (1 + NEAR_FREE):
            return best, found_at
        if (found := fitting(price / PRICE_STEP)) is None:
            low = price / PRICE_STEP
            break
        price /= PRICE_STEP
        if found[0] < best[0]:
            best, found_at = found, price
    for _ in range(REFINES if low else 0):  # between the last cut that overflowed and the price that fitted
        mid = (low * price) ** 0.5
        if (found := fitting(mid)) is None:
            low = mid
        else:
            price = mid
            if found[0] < best[0]:
                best, found_at = found, mid
    return best, found_at
