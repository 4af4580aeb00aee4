"""Two Ray nodes on this machine: the DraftServer alone on the second node, the engines on the head,
KVSync across the nodes; greedy output equals the solo plain run, and killing the DraftServer
mid-stream loses nothing.

The nodes are started by ``tests.chaos.ray_nodes`` (own temp dirs and ports, stopped by pid).
The second node has no CPUs, so only the DraftServer (0 CPUs) can land there; it is pinned there by
a custom resource ``draft_node`` when the app config has a ``draft_server.resources`` knob, and
otherwise by the only knob that exists today: the second node advertises one GPU and the
DraftServer asks for it.
"""
from __future__ import annotations

import os
import signal

import grpc
import pytest

from deployments.app_config import DraftServerKnobs
from tests.chaos.ray_nodes import driver_token_auth, two_node_cluster
from tests.chaos.service import (PLAIN, PROMPTS, SPECULATIVE, TINY, draft_info, engine_pid, join_all,
                                 listening_pid, real_app, start_stream)
from tests.deployments.harness import Client, serve_apps
from tests.deployments.test_service_fake import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.ray, pytest.mark.model]
N = 64
HAS_RESOURCES_KNOB = "resources" in DraftServerKnobs.model_fields


def app_args() -> dict:
    draft = {"num_replicas": 1, "num_cpus": 0, "host": "127.0.0.1", "timeout_s": 2.0}
    if HAS_RESOURCES_KNOB:
        draft.update(num_gpus=0, resources={"draft_node": 1})
    else:
        draft.update(num_gpus=1)
    return real_app(placement="separate", router_deployment=TINY, draft_server=draft)


def test_draft_server_on_second_node(chaos_report):
    section = {"placement_knob": "resources" if HAS_RESOURCES_KNOB else "num_gpus (no resources knob)"}
    chaos_report.record("two_nodes", "setup", section)
    with two_node_cluster(head_cpus=2, worker_cpus=0, worker_resources={"draft_node": 1},
                          worker_gpus=0 if HAS_RESOURCES_KNOB else 1) as (address, head, worker):
        with driver_token_auth(), serve_apps({"two": app_args()}, ray_address=address, timeout_s=600) as addr:
            c = Client(addr, "two")
            c.wait_ready(timeout_s=300)
            draft_pid = listening_pid(draft_info("two")["address"])
            core = engine_pid("two", "SpecEngine")
            section.update(draft_on_second_node=draft_pid in worker.processes(),
                           engine_on_head=core in head.processes())
            assert section["draft_on_second_node"], "the DraftServer is not on the second node"
            assert section["engine_on_head"], "the SpecEngine's core is not on the head node"

            prompts = PROMPTS[:3]
            want = {}
            for p in prompts:
                want[p] = list(c.generate(prompt=p, max_tokens=N, mode=PLAIN, ignore_eos=True,
                                          timeout=120).token_ids)
                r = c.generate(prompt=p, max_tokens=N, mode=SPECULATIVE, ignore_eos=True, timeout=120)
                assert list(r.token_ids) == want[p], f"speculative output differs for {p!r}"
                assert r.spec.drafts > 0, "no drafts crossed KVSync"
            section["lossless"] = True

            runs = [start_stream(c, prompt=p, max_tokens=N, mode=SPECULATIVE, ignore_eos=True,
                                 timeout=300) for p in prompts]
            for _, r in runs:
                assert r.first.wait(180)
            os.kill(draft_pid, signal.SIGKILL)
            join_all([t for t, _ in runs], 300)
            lost = sum(1 for _, r in runs if r.code is not grpc.StatusCode.OK or not r.finished)
            corrupted = sum(1 for (_, r), p in zip(runs, prompts)
                            if r.code is grpc.StatusCode.OK and r.tokens != want[p])
            section.update(killed_streams=len(runs), lost=lost, corrupted=corrupted)
            assert lost == corrupted == 0, [(r.code, r.details[:200]) for _, r in runs]

            def speculating_again():  # Serve restarts the DraftServer, on the second node again
                r = c.generate(prompt=prompts[0], max_tokens=N, mode=SPECULATIVE, ignore_eos=True,
                               timeout=120)
                assert list(r.token_ids) == want[prompts[0]]
                return r.spec.drafts > 0
            wait_for(speculating_again, timeout=180, what="speculation over a new DraftServer")
            new_pid = listening_pid(draft_info("two")["address"])
            section["restarted_on_second_node"] = new_pid != draft_pid and new_pid in worker.processes()
            assert section["restarted_on_second_node"]
