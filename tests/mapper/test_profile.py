"""Phase 1 through the engine protocol (FakeEngine, no model): per segment × drafter rows, output
lengths, and a row the engine refuses recorded and skipped instead of ending the phase."""
from __future__ import annotations

import json

from cluster.mapper.profile import run_profile
from cluster.mapper.progress import Budget
from cluster.mapper.traffic import load_traffic
from deployments.app_config import AppConfig
from tests.deployments.harness import FAKE


def test_profile_on_fake_engine_skips_a_refused_row(tmp_path):
    rows = [{"id": "ok-1", "segment": "code", "prompt": "abcabcabc", "max_tokens": 10},
            {"id": "too-long", "segment": "code", "prompt": "abc", "max_tokens": 5000},  # > max_model_len
            {"id": "ok-2", "segment": "code", "prompt": "xyzxyz", "max_tokens": 6},
            {"id": "chat-1", "segment": "chat", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 8}]
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    app = AppConfig(model="fake", engine_impl={**FAKE, "options": {"token_delay_s": 0.001,
                                                                   "acceptance_rate_by_segment": {"code": 0.5, "chat": 0.0}}})
    result: dict = {}
    run_profile(app, load_traffic(f), ["ngram"], 2, None, Budget(None, show=False), result)
    assert result["row_errors"] == ["too-long: prompt (3) + max_tokens (5000) exceeds max_model_len 2048"]
    code, chat = result["segments"]["code"], result["segments"]["chat"]
    assert code["rows"] == 2 and code["output_tokens"]["values"] == [6, 10]
    ng = code["drafters"]["ngram"]
    assert ng["alpha_by_position"] == [1.0, 0.0] and ng["acceptance_rate"] == 0.5  # 1 of 2 every step
    assert chat["drafters"]["ngram"]["acceptance_rate"] == 0.0 and chat["drafters"]["ngram"]["best_num_draft_tokens"] == 0
    assert "stopped" not in result
