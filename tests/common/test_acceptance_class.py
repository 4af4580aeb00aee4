"""Acceptance classes: a request's class follows from its sampling parameters alone, and tags
its draft contexts."""
from __future__ import annotations

import pytest

from cluster.common.acceptance_class import CLASS_NAMES, acceptance_class, class_name, classed_context
from cluster.common.request import SamplingParams


@pytest.mark.parametrize("fields, tag", [
    ({}, ""),
    ({"temperature": 0.0, "top_k": 5, "min_tokens": 2}, ""),  # greedy stays greedy; min_tokens shapes no rate
    ({"temperature": 0.7}, "+sampled"),
    ({"temperature": 1.0, "top_p": 0.9, "min_p": 0.05}, "+sampled"),
    ({"repetition_penalty": 1.2}, "+shaped"),
    ({"presence_penalty": 0.5}, "+shaped"),
    ({"frequency_penalty": -0.5}, "+shaped"),
    ({"logit_bias": ((3, 1.0),)}, "+shaped"),
    ({"temperature": 0.8, "repetition_penalty": 1.1}, "+sampled+shaped"),
])
def test_acceptance_class_names_sampling_and_shaped_logits(fields, tag):
    params = SamplingParams(max_tokens=8, **fields)
    assert acceptance_class(params) == tag
    assert classed_context("n2", acceptance_class(params)) == f"n2{tag}"
    assert class_name(acceptance_class(params)) in CLASS_NAMES


def test_class_names_are_what_stats_and_the_router_use():
    assert CLASS_NAMES == ("base", "sampled", "shaped", "sampled+shaped")
