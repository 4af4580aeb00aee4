"""Repeated rows in a benchmark through the service (``bench serve``, ``specserve map``'s sweep).

Owns: which rows the service's speculative path has answered in a run, how many speculative
requests repeat one (per cell and in all), where each concurrency level's rows start, whether the
service's drafter learns from traffic, and the report's lines on it. A drafter that learns from
traffic (``suffix``, ``portfolio``: ``DrafterChoice.learns_from_traffic``) drafts a repeated greedy
request from its own earlier answer (α near 1: measured 0.93-0.99, docs/measurements.md,
"Comparing drafters through the service"), so such a request measures memory, not new traffic.
It does so within a request's draft scope only: ``bench serve`` sends each policy's rows in
scopes of its own (``scoped_rows``), a new one each time the workload cycles, so nothing it sends
repeats; a repeat is the same row sent again in the same scope (``specserve map``'s sweep, which
sends no scope, where its sample cycles).
Ignores: sending requests and timing them (``cluster.bench.serve``).
"""
from __future__ import annotations

import json


def row_key(row: dict) -> str:
    """What a drafter that learns from traffic recognises again: the request's text, in its draft
    scope (it drafts only from answers of the same scope)."""
    return json.dumps([row.get("segment"), bool(row.get("chat")), row.get("prompt"), row.get("messages"),
                       row.get("draft_scope", "")])


class SpecAnswers:
    """The rows the service's speculative path has answered so far in this run. A drafter that
    learns from traffic (``suffix``, ``portfolio``: ``DrafterChoice.learns_from_traffic``) drafts a
    repeated greedy request from its own earlier answer (α near 1), so a speculative request that
    repeats a row measures that memory, not new traffic. Levels take fresh rows where the
    workload has enough (``level_start``); the policies of one level share theirs (fixed-spec and
    routed answer each row once each), each in its own draft scope where the bench gives one, and a
    short workload cycles: ``wave`` counts what repeats, per cell (``repeated_rows``) and in all
    (``summary``)."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.speculative = 0  # speculative-path requests seen
        self.repeated = 0  # of them, repeats of a row the speculative path had answered

    def wave(self, rows: list[dict], results: list[dict], forced_speculative: bool = False) -> int:
        """Record one wave (``results`` in ``rows``' order) -> how many of its speculative-path
        requests repeat a row answered on that path before (one earlier in the same wave counts:
        it may have finished first). A result without a ``path`` (unary calls) took the
        speculative path when the request forced it (``forced_speculative``)."""
        repeated = 0
        for row, r in zip(rows, results):
            if r.get("error") is not None:
                continue
            if not (r["path"] == "speculative" if "path" in r else forced_speculative):
                continue
            key = row_key(row)
            repeated += key in self.keys
            self.keys.add(key)
            self.speculative += 1
        self.repeated += repeated
        return repeated

    def summary(self, drafter: str | None) -> dict:
        """``drafter``: the service's (None: unknown, a running service without ``--config``)."""
        learns = None
        if drafter is not None:
            from cluster.speculative.proposer import parse_drafter_choice

            choice = parse_drafter_choice(drafter)
            learns = bool(choice and choice.learns_from_traffic)
        return {"speculative_requests": self.speculative, "repeated": self.repeated,
                "drafter": drafter, "drafter_learns_from_traffic": learns}


def scoped_rows(rows: list[dict], scope: str, needed: int) -> list[dict]:
    """``rows`` in draft scope ``<scope>/c<k>`` on their k-th pass, repeated until the list holds
    at least ``needed`` (the most this run sends from it): a row sent again goes in a scope with no
    memory of its first answer — a drafter that learns from traffic drafts it from that pass's
    earlier answers only, as it would new traffic."""
    passes = max(1, -(-needed // len(rows)))
    return [dict(r, draft_scope=f"{scope}/c{k}") for k in range(passes) for r in rows]


def level_start(start: int, rounds: int, per_round: int) -> int:
    """Where the next level's rows start: after the ``rounds`` × ``per_round`` rows this level sent
    (fresh rows for each level where the workload has enough; cycling where it has not)."""
    return start + rounds * per_round


def format_repeats(rep: dict | None) -> list[str]:
    """The report's lines on repeated rows (none when nothing repeated)."""
    if not rep or not rep["repeated"]:
        return []
    share = f"{rep['repeated']} of {rep['speculative_requests']} speculative-path requests"
    if rep["drafter_learns_from_traffic"] is False:
        return ["", f"{share} repeated a row the speculative path had answered before in this run; "
                    f"drafter {rep['drafter']!r} does not learn across requests: no effect"]
    who = f"drafter {rep['drafter']!r} learns" if rep["drafter_learns_from_traffic"] else \
        "if the service's drafter learns (suffix, portfolio; pass --config to know),"
    return ["", f"WARNING: {share} repeated a row the speculative path had answered before in this "
                f"run in the same draft scope (`repeated_rows` per cell); {who} from traffic and "
                "drafts a repeat from its own earlier answer, so those cells' α and latencies "
                "overstate new traffic (routed against fixed-spec and the front door's speculative "
                "pairs are not judged where they repeated). For new traffic only: more rows than a "
                "run sends (bench serve: --workloads, or fewer --requests; map: --rows-per-segment)."]
