"""A FakeEngine-backed Serve config and a traffic file for the mapper tests (no model)."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.deployments.harness import FAKE, SMALL, fake_args

# code: 4 of 4 drafts accepted per step (5 tokens a step), chat: 1 of 4 (2 tokens a step)
ALPHA = {"code": 0.9, "chat": 0.3}
TOKEN_DELAY_S = 0.02  # a step costs more than the fake's overhead: queueing, not noise, decides


def fake_serve_config(path: Path, **over) -> Path:
    """The shipped serve config with FakeEngine args: a SpecEngine of 2 sequences at once (so
    speculation loses to batching at a few concurrent requests) and a BatchEngine of 32."""
    shipped = Path(__file__).resolve().parents[2] / "deployments" / "serve_config.yaml"
    cfg = yaml.safe_load(shipped.read_text())
    args = fake_args(spec_engine={**SMALL, "max_num_seqs": 2}, batch_engine={**SMALL, "max_num_seqs": 32},
                     engine_impl={**FAKE, "options": {"token_delay_s": TOKEN_DELAY_S, "acceptance_rate_by_segment": ALPHA,
                                                      "default_acceptance_rate": 0.5}})
    args.update(over)
    cfg["applications"][0]["args"] = args
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def traffic_file(path: Path, per_segment: int = 6, bad: bool = True) -> Path:
    rows = []
    for seg in ALPHA:
        for i in range(per_segment):
            rows.append(json.dumps({"id": f"{seg}-{i}", "segment": seg, "max_tokens": 24,
                                    "prompt": f"{seg} prompt number {i}: " + "abc " * (3 + i)}))
    if bad:
        rows.insert(2, "{not json")
        rows.insert(5, json.dumps({"segment": "code", "max_tokens": -3, "prompt": "x"}))
        rows.append(json.dumps({"prompt": "no segment here", "max_tokens": 8}))
    path.write_text("\n".join(rows) + "\n")
    return path
