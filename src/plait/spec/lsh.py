"""LSH-MoE's hash settings (Nie et al., NeurIPS 2024, arXiv 2411.08446), shared by the runtime's hashing
(`plait.runtime.lsh`) and the cost model (`plait.cost.experts`)."""

from __future__ import annotations

LSH_HASHES = 4
"""Cross-polytope hash functions per bucket key (the paper's ablation spans 2-10)."""
LSH_DIMS = 4
"""Rotated coordinates per hash: 2*dims = 8 cross-polytope vertices (buckets) per hash. Chosen on tiny-moe
(trained 150 steps) over Genesis, 256 tokens per expert: compression rates 0.08-0.17 across its MoE layers,
inside the paper's 10-20% (Fig. 7), with the experts' output off by at most 0.16 (relative); 2 hashes gave
0.04-0.07 and up to 0.27."""
LSH_SEED = 20241113
"""Seed of the rotations (any fixed value: every rank draws the same ones)."""
LSH_COMPRESSION_RATE = 0.2
"""Centroids per routed (token, expert) pair the cost model assumes: the paper's largest rate (its
experiments run at 10-20%, Fig. 7 and Table 3); what the runtime measures depends on the data."""
