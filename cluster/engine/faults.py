"""Per-sequence fault isolation inside one engine step: a request is a unit of failure.

Owns: ``SeqFault`` (why one sequence failed a step, with the message its caller gets as
``RequestOutput.error``), ``fault`` (logs the traceback, keeps only a one-line message: clients
never see tracebacks), and ``per_row`` (run a batched computation; when it raises, run each row
alone so the exception is attributed to its own sequence and every other row keeps its result).
Ignores: what the rows are (sampling, verification, drafting) and what happens to a failed
sequence (``LLMEngine`` finishes it with ``FinishReason.ERROR`` and frees its KV).
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Callable, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_MESSAGE_CHARS = 300  # a message, not a dump: the log has the rest


class FaultStage(enum.Enum):
    """Where in the step a sequence failed (the message names it)."""

    PROPOSE = "drafting"
    FORWARD = "the model forward pass"
    SAMPLE = "sampling"
    VERIFY = "speculative verification"
    COMMIT = "committing tokens (detokenize / stop check)"
    STEP = "the engine step"


@dataclass(frozen=True, slots=True)
class SeqFault:
    stage: FaultStage
    message: str


def fault(stage: FaultStage, exc: BaseException, seq_id: str | None = None) -> SeqFault:
    """Log exc with its traceback; return the short message for the client."""
    log.error("request %s failed in %s", seq_id or "?", stage.value, exc_info=exc)
    detail = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
    message = f"internal error in {stage.value}: {text}"
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    return SeqFault(stage, message)


def per_row(n: int, run: Callable[[list[int]], list[T]], stage: FaultStage,
            seq_ids: list[str] | None = None,
            not_theirs: tuple[type[BaseException], ...] = ()) -> list[T | SeqFault]:
    """run(rows) -> one result per row, for rows a sorted subset of range(n). All n rows at once
    first; if that raises, each row alone (an unseeded row then draws again from the global RNG,
    which keeps its distribution; seeded and greedy rows are deterministic). Exceptions of the
    ``not_theirs`` types are no row's fault and propagate."""
    if n == 0:
        return []
    try:
        out = run(list(range(n)))
        if len(out) != n:
            raise RuntimeError(f"{n} rows but {len(out)} results")
        return out
    except not_theirs:
        raise
    except Exception as batch_exc:  # noqa: BLE001 (attributed below)
        if n == 1:
            return [fault(stage, batch_exc, seq_ids[0] if seq_ids else None)]
        log.warning("batched %s failed (%s: %s); retrying each sequence alone",
                    stage.value, type(batch_exc).__name__, batch_exc)
    results: list[T | SeqFault] = []
    for i in range(n):
        try:
            results.append(run([i])[0])
        except not_theirs:
            raise
        except Exception as exc:  # noqa: BLE001 (this row's own failure)
            results.append(fault(stage, exc, seq_ids[i] if seq_ids else None))
    return results
