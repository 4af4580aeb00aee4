"""deployments/serve_config.yaml fits the machine it is calibrated for: what its deployments reserve
from Ray (num_cpus x num_replicas, summed the way `specserve serve` sizes a local Ray) fits one
2-CPU node in both placements, so `serve deploy` on such a node can place every replica."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deployments.local import needed_cpus

SERVE_CONFIG = Path(__file__).resolve().parents[2] / "deployments" / "serve_config.yaml"
CALIBRATED_NODE_CPUS = 2  # the router thresholds and batch sizes were measured on 2 CPU cores


def shipped_args() -> dict:
    return yaml.safe_load(SERVE_CONFIG.read_text())["applications"][0]["args"]


@pytest.mark.parametrize("placement", ["shared", "separate"])
def test_shipped_reservations_fit_a_two_cpu_node(placement):
    args = {**shipped_args(), "placement": placement}
    assert needed_cpus(args) <= CALIBRATED_NODE_CPUS, (placement, needed_cpus(args))


def test_the_fit_check_counts_every_replica_and_the_draft_side_only_when_separate():
    args = shipped_args()
    shared = needed_cpus(args)
    separate = needed_cpus({**args, "placement": "separate"})
    assert separate == pytest.approx(shared + args["draft_server"]["num_cpus"])
    two_batch = {**args, "batch_engine": {**args["batch_engine"], "num_replicas": 2}}
    assert needed_cpus(two_batch) == pytest.approx(shared + args["batch_engine"]["num_cpus"])
    assert needed_cpus({**two_batch, "router_deployment": {"num_cpus": 1}}) > CALIBRATED_NODE_CPUS
