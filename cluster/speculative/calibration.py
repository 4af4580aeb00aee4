"""Start-up measurement of the target's step costs, the prior of adaptive K's cost model.

Owns: timing one decode forward (1 new token) and one verification-shaped forward (K_max + 1 new
tokens) of the real target (``time_forwards``, also `bench decode`'s verification ratios) on this
machine, on a throw-away sequence whose KV is freed afterwards. Why: whether speculation pays
depends on how much more a (K+1)-token forward costs than a 1-token one — nearly nothing on a GPU;
for 6 tokens on a 2-core CPU in fp32 about 1.5-1.6x with the skinny-GEMM kernel (cluster/kernels) on
the development VM as measured on 2026-12-01, 1.8x on MKL's sgemm (docs/measurements.md, "Decode"),
1.2x on an AVX2 machine since the kernel passes over a weight tile once for up to 6 rows
(2026-12-02) — and a sequence mix that never varies its token count would otherwise never teach the
model the slope.
Ignores: draft costs (measured online as drafts happen).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from cluster.models.runner import SeqChunk

_SEQ = "__specserve_calibration__"


@dataclass(slots=True, frozen=True)
class StepCosts:
    decode_s: float  # seconds of a 1-token forward
    slope_ratio: float  # extra cost of each additional token, relative to decode_s


def measure_step_costs(runner, max_draft_tokens: int, context: int = 64, reps: int = 3) -> StepCosts:
    ids = [(i % 200) + 10 for i in range(context + max_draft_tokens + 1)]
    times = time_forwards(runner, ids[:context], ids[context:], (1, max_draft_tokens + 1), reps)
    t1, tk = times[1], times[max_draft_tokens + 1]
    return StepCosts(t1, max(0.0, (tk - t1) / (max_draft_tokens * t1)))


def time_forwards(runner, context_ids: list[int], new_ids: list[int], counts: tuple[int, ...], reps: int,
                  seq_id: str = _SEQ) -> dict[int, float]:
    """n -> median seconds of one forward of ``new_ids[:n]`` for one sequence after
    ``context_ids`` (prefilled once), for every n in ``counts``: ``reps`` rounds, the counts'
    forwards interleaved within each, the sequence cut back to its context after each forward
    and freed at the end (no KV left behind)."""
    times: dict[int, list[float]] = {n: [] for n in counts}
    try:
        runner.forward([SeqChunk(seq_id, context_ids, 0, 1)])
        length = len(context_ids)
        for _ in range(reps):
            for n, bucket in times.items():
                t0 = time.perf_counter()
                runner.forward([SeqChunk(seq_id, new_ids[:n], length, n)])
                bucket.append(time.perf_counter() - t0)
                runner.truncate(seq_id, length)
    finally:
        runner.free(seq_id)
    return {n: statistics.median(bucket) for n, bucket in times.items()}
