"""The files ``specserve map`` leaves in ``--out``: ``serve_config.yaml``, ``values-mapped.yaml``,
``map.json`` (every number), and (``report``) ``report.md`` with its PNGs.

Owns: applying the mapped knobs to the Serve config the map ran with (everything else kept, so
the result loads as is with ``specserve serve --config`` and ``serve deploy``; checked with the
app's own ``AppConfig`` before it is written), the Helm values overlay (the chart's ``app`` keys
the map decided), writing each file atomically (a Ctrl-C mid-write leaves the previous version),
and the per-segment measurements as comments (the per-segment choices themselves are keys:
``router.segments.<name>`` thresholds, min_alpha, drafter, num_draft_tokens).
Ignores: what the knobs should be (``decide``).
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import yaml

KNOB_KEYS = ("drafter", "num_draft_tokens")
ROUTER_KEYS = ("enter_threshold", "exit_threshold", "min_alpha", "segments")


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def mapped_args(app_args: dict, knobs: dict) -> dict:
    """The app args with the mapped knobs applied, validated by ``AppConfig``."""
    from deployments.app_config import AppConfig

    args = copy.deepcopy(app_args)
    for key in KNOB_KEYS:
        if key in knobs:
            args[key] = knobs[key]
    router = dict(args.get("router") or {})
    router.update({k: knobs["router"][k] for k in ROUTER_KEYS if k in knobs.get("router", {})})
    args["router"] = router
    if args.get("drafter") == "none" and args.get("placement") == "separate":
        args["placement"] = "shared"  # separate placement needs a drafter
    AppConfig(**args)  # raises on anything the service would refuse
    return args


def _segment_comments(decision: dict) -> list[str]:
    lines = ["# per-segment measurements (router.segments holds each segment's own thresholds, drafter and K):"]
    for seg, d in decision.get("segments", {}).items():
        cross = d.get("crossover") or {}
        lines.append(f"#   {seg}: share {d.get('share')}, speculate={d.get('speculate')}, "
                     f"drafter {d.get('best_drafter')}, K {d.get('best_num_draft_tokens')}, α {d.get('alpha')}, "
                     f"crossover {cross.get('value', '-')} ({cross.get('kind', 'not swept')}, 90% "
                     f"{cross.get('ci90', '-')}), predicted {d.get('predicted_crossover', '-')}")
    return lines


def serve_config_text(base_cfg: dict, args: dict, decision: dict, source: str) -> str:
    cfg = copy.deepcopy(base_cfg)
    cfg["applications"][0]["args"] = args
    head = [f"# Serve config written by `specserve map` from {source}.",
            "#   specserve serve --config serve_config.yaml    or    serve deploy serve_config.yaml",
            "# Mapped knobs: drafter, num_draft_tokens, router.enter_threshold / exit_threshold / min_alpha /",
            "# segments (a segment's own thresholds, min_alpha, drafter, num_draft_tokens);",
            "# everything else is the config the map ran with. Why each value: report.md, map.json."]
    head += _segment_comments(decision)
    return "\n".join(head) + "\n" + yaml.safe_dump(cfg, sort_keys=False)


def values_text(args: dict, decision: dict) -> str:
    app = {k: args[k] for k in KNOB_KEYS if k in args}
    app["router"] = {k: args["router"][k] for k in ROUTER_KEYS if k in args.get("router", {})}
    head = ["# Helm values overlay written by `specserve map` (keys of the chart's `app` values):",
            "#   helm upgrade --install specserve helm/specserve -f values-mapped.yaml",
            "# Only what the map decided; the chart's defaults (or your values file before this one) keep",
            "# the rest. Mapped on this machine: thresholds in concurrent requests scale with the",
            "# hardware, so map again on the cluster's own nodes before trusting them there."]
    head += _segment_comments(decision)
    return "\n".join(head) + "\n" + yaml.safe_dump({"app": app}, sort_keys=False)


def write_map_json(out: Path, state: dict) -> Path:
    path = out / "map.json"
    write_atomic(path, json.dumps(state, indent=2, default=str))
    return path


def write_configs(out: Path, base_cfg: dict, decision: dict, source: str) -> dict:
    args = mapped_args(base_cfg["applications"][0].get("args") or {}, decision["knobs"])
    write_atomic(out / "serve_config.yaml", serve_config_text(base_cfg, args, decision, source))
    write_atomic(out / "values-mapped.yaml", values_text(args, decision))
    return args
