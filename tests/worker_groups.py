"""Which pytest worker runs which tests when the suite runs on both cores (``-n 2 --dist loadgroup``,
what ``make test`` does).

Owns: the group of every collected test and the xdist scheduler that hands out whole groups. Every
test marked ``ray`` (it starts a Ray cluster, a Serve app, or ``specserve serve``/``map``/``bench
serve``) is in one group, so those run one after another on one worker: two Ray clusters on two
cores would starve each other's proxies and replicas past their health checks. Every other module is
a group of its own, so its module fixtures (an engine, a trained head) are built once, on one
worker. The ``ray`` tests run last in their group's order, the ones on the shared Serve session
(``serve_shared``) after those that start Ray their own way.
Why a scheduler of our own: xdist's ``loadgroup`` marks a test's group by rewriting its node id,
which pytest 9.2 no longer lets it do (the groups were silently ignored); here each worker writes
the groups of what it collected into a file the controller's scheduler reads (``workerinput``).
Ignores: which worker takes which group (the largest first, as workers free up).
A test that starts Ray without the ``ray`` mark fails at ``ray.init`` (in any run, so a new one is
caught before it races the group).
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

RAY_GROUP = "ray"
GROUPS_KEY = "specserve_groups_file"  # workerinput: where the workers write the groups
_running: list[pytest.Item] = []  # the test being set up, run or torn down in this process


def group_of(item: pytest.Item) -> str:
    if item.get_closest_marker("ray") is not None:
        return RAY_GROUP
    return item.nodeid.split("::", 1)[0]  # the module's path


def uses_shared_serve(item: pytest.Item) -> bool:
    return "serve_shared" in getattr(item, "fixturenames", ())


def _distributed(config: pytest.Config) -> bool:
    return config.getoption("dist", "no") == "loadgroup" and bool(config.getoption("numprocesses", None))


def pytest_configure(config: pytest.Config) -> None:
    _guard_ray_init()
    if _distributed(config):  # the controller: a file for the workers' groups
        config.stash[_DIR] = Path(tempfile.mkdtemp(prefix="specserve-groups-"))


def pytest_unconfigure(config: pytest.Config) -> None:
    if _DIR in config.stash:
        shutil.rmtree(config.stash[_DIR], ignore_errors=True)


_DIR = pytest.StashKey[Path]()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    node.workerinput[GROUPS_KEY] = str(node.config.stash[_DIR] / "groups.json")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if not _distributed(config):
        return None
    return GroupScheduling(config, log, config.stash[_DIR] / "groups.json")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ray = [it for it in items if group_of(it) == RAY_GROUP]
    items[:] = ([it for it in items if group_of(it) != RAY_GROUP] + [it for it in ray if not uses_shared_serve(it)]
                + [it for it in ray if uses_shared_serve(it)])
    path = getattr(config, "workerinput", {}).get(GROUPS_KEY)
    if path:  # every worker collects the same tests and writes the same groups
        tmp = f"{path}.{os.getpid()}"
        Path(tmp).write_text(json.dumps({it.nodeid: group_of(it) for it in items}))
        os.replace(tmp, path)


class GroupScheduling(LoadScopeScheduling):
    """xdist's load-by-scope scheduling with our groups as the scopes."""

    def __init__(self, config: pytest.Config, log, groups_file: Path) -> None:
        super().__init__(config, log)
        self.groups_file = groups_file
        self._groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:  # called once the workers have collected (and written the file)
            self._groups = json.loads(self.groups_file.read_text())
        return self._groups[nodeid]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.pop()


def _guard_ray_init() -> None:
    import ray

    if getattr(ray.init, "_specserve_guarded", False):
        return
    init = ray.init

    @functools.wraps(init)
    def guarded_init(*args, **kwargs):
        if _running and _running[-1].get_closest_marker("ray") is None:
            raise RuntimeError(f"{_running[-1].nodeid} starts Ray without the `ray` mark "
                               "(pytestmark = pytest.mark.ray): tests/worker_groups.py")
        return init(*args, **kwargs)

    guarded_init._specserve_guarded = True
    ray.init = guarded_init
