"""AppConfig (the Serve app's args) without Ray: the shipped config parses, knobs reach the engine
and router dataclasses, and bad knobs are rejected with the field named."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from deployments.app_config import BATCHED_TOKENS_DEFAULT, AppConfig

SERVE_CONFIG = Path(__file__).resolve().parents[2] / "deployments" / "serve_config.yaml"


def shipped_args() -> dict:
    return yaml.safe_load(SERVE_CONFIG.read_text())["applications"][0]["args"]


def test_shipped_serve_config_parses_and_maps_to_engine_configs():
    app = AppConfig(**shipped_args())
    spec, plain = app.engine_config(True), app.engine_config(False)
    assert spec.spec is not None and plain.spec is None
    knobs = shipped_args()
    for cfg, side in ((spec, knobs["spec_engine"]), (plain, knobs["batch_engine"])):
        assert cfg.max_num_seqs == side["max_num_seqs"]
        assert cfg.kv_cache_memory_mb == side["kv_cache_memory_mb"]
        assert cfg.max_num_batched_tokens == side.get("max_num_batched_tokens", BATCHED_TOKENS_DEFAULT)
        assert cfg.torch_threads == knobs["torch_threads"]
        assert cfg.max_queue == knobs["limits"]["max_queue"]


def test_engine_token_budget_is_per_engine():
    app = AppConfig(spec_engine={"max_num_batched_tokens": 64}, batch_engine={"max_num_batched_tokens": 512})
    assert app.engine_config(True).max_num_batched_tokens == 64
    assert app.engine_config(False).max_num_batched_tokens == 512
    assert AppConfig().engine_config(False).max_num_batched_tokens == BATCHED_TOKENS_DEFAULT


@pytest.mark.parametrize("args,needle", [
    ({"batch_engine": {"max_num_batched_tokens": 0}}, "max_num_batched_tokens"),
    ({"spec_engine": {"gpu_memory_utilization": 0.9}}, "gpu_memory_utilization"),
    ({"router": {"enter_threshold": 9, "exit_threshold": 4}}, "threshold"),
    ({"router": {"min_alpha": "sometimes"}}, "min_alpha"),
    ({"placement": "separate", "drafter": "none"}, "needs a drafter"),
    ({"temperature": 0.7}, "temperature"),
])
def test_bad_knobs_are_rejected_with_the_field_named(args, needle):
    with pytest.raises(ValidationError) as e:
        AppConfig(**args)
    assert needle in str(e.value)


def test_limits_reach_the_router_and_the_proxy():
    from deployments.app_config import PROXY_MAX_MESSAGE_ENV, AppConfig, proxy_env

    a = AppConfig(limits={"max_stop_strings": 4, "max_stop_chars": 32, "max_constraint_chars": 999})
    lim = a.limits_config()
    assert (lim.max_stop_strings, lim.max_stop_chars, lim.max_constraint_chars) == (4, 32, 999)
    # the proxy's cap: the request limit, unless a unary response may be bigger; the largest app's
    small = {"limits": {"max_message_bytes": 8192, "max_tokens": 256}}
    big = {"limits": {"max_message_bytes": 4 << 20}}
    assert proxy_env([small]) == {PROXY_MAX_MESSAGE_ENV: str(256 * 64 + (64 << 10))}
    assert proxy_env([small, big, {}]) == {PROXY_MAX_MESSAGE_ENV: str(4 << 20)}
    assert proxy_env([{}]) == {PROXY_MAX_MESSAGE_ENV: str(1 << 20)}
    with pytest.raises(ValueError):
        AppConfig(limits={"max_stop_strings": 0})


def test_constraint_limits_reach_the_router_and_the_engines():
    """limits.max_constraint_repeat is the Router's (validation), limits.constraint_compile_s the
    engines' (compile); both validated."""
    from deployments.app_config import AppConfig

    a = AppConfig(limits={"max_constraint_repeat": 123, "constraint_compile_s": 0.5})
    assert a.limits_config().max_constraint_repeat == 123
    assert a.engine_config(True).grammar_compile_s == a.engine_config(False).grammar_compile_s == 0.5
    assert AppConfig().limits_config().max_constraint_repeat == 8192
    assert AppConfig().engine_config(False).grammar_compile_s == 2.0
    for bad in ({"max_constraint_repeat": 0}, {"constraint_compile_s": 0}, {"constraint_compile_s": 61}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            AppConfig(limits=bad)


def test_per_segment_drafter_and_k_reach_the_engine_and_not_the_router():
    app = AppConfig(drafter="ngram", num_draft_tokens="auto", router={"segments": {
        "code": {"drafter": "suffix", "num_draft_tokens": 4}, "chat": {"exit_threshold": 9, "num_draft_tokens": 1},
        "json": {"min_alpha": 1.0}}})
    spec = app.engine_config(True).spec
    assert {s: (spec.drafter_for(s), spec.k_policy(s)) for s in ("code", "chat", "json", "other")} == {
        "code": ("suffix", 4), "chat": ("ngram", 1), "json": ("ngram", "auto"), "other": ("ngram", "auto")}
    assert set(spec.segments) == {"code", "chat"}  # json sets router knobs only
    assert app.engine_config(False).spec is None
    rc = app.router_config()
    assert rc.knobs("chat") == (4, 9, "auto") and set(rc.segments) == {"code", "chat", "json"}
    # placement separate: a segment may set its K, and name the global drafter
    sep = AppConfig(placement="separate", drafter="ngram",
                    router={"segments": {"chat": {"num_draft_tokens": 2, "drafter": "ngram"}}})
    assert sep.kvsync_limits().max_draft_tokens == 6


@pytest.mark.parametrize("args,needle", [
    ({"router": {"segments": {"chat": {"drafter": "self:x"}}}}, "router.segments.chat.drafter"),
    ({"router": {"segments": {"chat": {"drafter": ""}}}}, "drafter"),
    ({"router": {"segments": {"chat": {"num_draft_tokens": 17}}}}, "num_draft_tokens"),
    ({"router": {"segments": {"chat": {"num_draft_tokens": "some"}}}}, "num_draft_tokens"),
    ({"drafter": "none", "router": {"segments": {"chat": {"num_draft_tokens": 2}}}},
     "router.segments.chat: drafter / num_draft_tokens need a SpecEngine"),
    ({"placement": "separate", "drafter": "ngram", "router": {"segments": {"code": {"drafter": "suffix"}}}},
     "router.segments.code.drafter 'suffix': placement 'separate'"),
])
def test_bad_per_segment_engine_settings_are_refused(args, needle):
    with pytest.raises(ValidationError) as e:
        AppConfig(**args)
    assert needle in str(e.value)
