"""`specserve bench serve --api openai`: the same load through the OpenAI-compatible HTTP front door
beside gRPC.

Owns: one request through the official ``openai`` client (streaming, ``stream_options.include_usage``;
chat rows through ``chat.completions``, the others through ``completions``; the policy as the
``mode`` extension, ``temperature`` 0 unless the row says otherwise, so both front doors decode
alike), returning what ``cluster.bench.serve`` records for a gRPC stream; and the comparison of
the two front doors (``api_overhead``): per (segment, concurrency, policy) OpenAI / gRPC e2e p50,
the paired median (same prompt, same round), TTFT and gRPC / OpenAI tokens/s, against the goal
of issue 20 (<= 1.10). Ignores: the policies, rounds and the in-process side of the front-door
measurement (``cluster.bench.serve``), the API's own rules (``deployments/openai_http.py``).
"""
from __future__ import annotations

import json
import statistics
import time

APIS = ("grpc", "openai")
OPENAI_GOAL = 1.10  # the OpenAI front door adds <= 10% over gRPC (and over in-process)
MODE_NAMES = {0: "auto", 1: "speculative", 2: "plain"}  # proto SpecMode -> the ``mode`` extension


class OpenAIDoor:
    """Requests through the ``openai`` client at ``base_url`` (``http://host:port[/prefix]/v1``)."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 600) -> None:
        import openai

        self.base_url = base_url
        self.client = openai.OpenAI(base_url=base_url, api_key=token or "unused", max_retries=0,
                                    timeout=timeout_s)
        self.model = self.client.models.list().data[0].id  # the served name, asked once, untimed

    def _create(self, row: dict, mode: int, max_tokens: int):
        body = {"max_tokens": min(max_tokens, int(row.get("max_tokens", max_tokens))),
                "temperature": float(row.get("temperature") or 0.0), "stream": True,
                "stream_options": {"include_usage": True}}
        extra = {"mode": MODE_NAMES[mode]}
        for key in ("segment", "draft_scope"):
            if row.get(key):
                extra[key] = row[key]
        for key in ("top_k", "regex", "grammar"):
            if row.get(key):
                extra[key] = row[key]
        if row.get("top_p") is not None:
            body["top_p"] = float(row["top_p"])
        if row.get("seed") is not None:
            body["seed"] = int(row["seed"])
        if row.get("stop"):
            body["stop"] = list(row["stop"])
        if row.get("json_schema"):
            schema = row["json_schema"]
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "row", "schema": schema if isinstance(schema, dict) else json.loads(schema)}}
        if "messages" in row or row.get("chat"):
            messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
            return self.client.chat.completions.create(model=self.model, messages=messages,
                                                       extra_body=extra, **body), True
        return self.client.completions.create(model=self.model, prompt=row["prompt"], extra_body=extra,
                                              **body), False

    def one(self, row: dict, mode: int, max_tokens: int) -> dict:
        """One streamed request -> the fields ``cluster.bench.serve.stream_one`` records for gRPC."""
        import openai

        t0 = time.perf_counter()
        ttft, tokens, spec, route = None, 0, None, None
        try:
            stream, chat = self._create(row, mode, max_tokens)
            for chunk in stream:
                extra = (chunk.model_extra or {}).get("specserve") or {}
                route = extra.get("route", route)
                spec = extra.get("spec", spec)
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                if not chunk.choices:
                    continue
                text = (chunk.choices[0].delta.content if chat else chunk.choices[0].text) or ""
                if text and ttft is None:
                    ttft = time.perf_counter() - t0
        except openai.APIError as exc:  # counted per cell as gRPC errors are
            code = getattr(exc, "status_code", None) or type(exc).__name__
            return {"error": f"HTTP_{code}" if isinstance(code, int) else code, "e2e": time.perf_counter() - t0,
                    "ttft": None, "tokens": 0, "tpot": None, "path": "error", "reason": str(code),
                    "drafted": 0, "accepted": 0}
        e2e = time.perf_counter() - t0
        return {"error": None, "e2e": e2e, "ttft": ttft, "tokens": tokens,
                "tpot": (e2e - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None,
                "path": (route or {}).get("path", "?"), "reason": (route or {}).get("reason", ""),
                "drafted": (spec or {}).get("draft_tokens", 0), "accepted": (spec or {}).get("accepted_tokens", 0)}


def _paired(a: list[float], b: list[float]) -> float | None:
    if not a or len(a) != len(b):
        return None
    return round(statistics.median(x / y for x, y in zip(a, b)), 4)


def api_overhead(cells: list[dict]) -> list[dict]:
    """Per (segment, concurrency, policy) with both front doors: OpenAI / gRPC e2e p50 (and the
    median of per-request ratios, same prompt and round, when neither side had errors), TTFT p50
    ratio, and gRPC / OpenAI tokens/s (above 1: the OpenAI door delivers less); ``meets_goal``
    when the e2e p50 ratio is <= OPENAI_GOAL."""
    out = []
    keys = sorted({(c["segment"], c["concurrency"], c["policy"]) for c in cells if c.get("api") == "openai"})
    for seg, conc, policy in keys:
        by = {c.get("api", "grpc"): c for c in cells
              if (c["segment"], c["concurrency"], c["policy"]) == (seg, conc, policy)}
        g, o = by.get("grpc"), by.get("openai")
        if not g or not o or not g["e2e_p50"] or not o["e2e_p50"]:
            continue
        aligned = not g.get("errors") and not o.get("errors")
        ratio = round(o["e2e_p50"] / g["e2e_p50"], 4)
        out.append({"segment": seg, "concurrency": conc, "policy": policy,
                    "e2e_ratio": ratio,
                    "e2e_ratio_paired": _paired(o.get("e2e_s") or [], g.get("e2e_s") or []) if aligned else None,
                    "ttft_ratio": round(o["ttft_p50"] / g["ttft_p50"], 4) if o["ttft_p50"] and g["ttft_p50"] else None,
                    "throughput_ratio": round(g["tokens_per_s"] / o["tokens_per_s"], 4) if o["tokens_per_s"] else None,
                    "meets_goal": ratio <= OPENAI_GOAL})
    return out


def format_api_overhead(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["", f"OpenAI HTTP / gRPC front door, same load side by side (goal e2e p50 <= {OPENAI_GOAL}):"]
    for r in rows:
        lines.append(f"  {r['segment']:<12} c={r['concurrency']:<3} {r['policy']:<11} e2e {r['e2e_ratio']:.3f}"
                     f" (paired {r['e2e_ratio_paired']}) ttft {r['ttft_ratio']} tok/s grpc/openai "
                     f"{r['throughput_ratio']}{'' if r['meets_goal'] else '  MISSES GOAL'}")
    return lines
