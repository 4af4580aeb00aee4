"""``bench spec``'s drafter goals: ratios to the n-gram auto row of the same run, the paired
comparison beside them, and the table that shows both."""
from __future__ import annotations

from cluster.bench import spec_goals


def test_drafter_goals_are_ratios_to_ngram_in_the_same_run():
    def row(speedup, alpha=None):
        return {"speedup": speedup, "alpha_by_position": alpha or []}

    segments = {
        "chat": {"ngram/auto": row(1.0), "portfolio/auto": row(1.3), "eagle/k3": row(1.2, [0.65, 0.5])},
        "json": {"ngram/auto": row(1.2), "portfolio/auto": row(1.44)},
        "code": {"ngram/auto": row(1.0), "portfolio/auto": row(1.05)},
        "edit": {"ngram/auto": row(2.0), "portfolio/auto": row(1.9)},
    }
    g = spec_goals.drafter_goals(segments)
    assert g["portfolio_over_ngram"]["measured"] == {"chat": 1.3, "json": 1.2, "code": 1.05, "edit": 0.95}
    assert set(g["portfolio_over_ngram"]["failing"]) == {"json", "code", "edit"}
    assert not g["portfolio_over_ngram"]["pass"]
    assert g["eagle_alpha_position_1_chat"] == {"goal": g["eagle_alpha_position_1_chat"]["goal"],
                                                "measured": {"eagle/k3": 0.65}, "pass": True}
    segments["chat"]["eagle/k3"] = row(1.2, [0.55])
    assert not spec_goals.drafter_goals(segments)["eagle_alpha_position_1_chat"]["pass"]
    assert spec_goals.drafter_goals({"chat": {"ngram/auto": row(1.0)}}) == {}  # rows not run: no goal
    assert "portfolio_over_ngram_paired" not in g  # rows without per-prompt walls: no paired ratio


def test_the_portfolio_is_also_compared_with_ngram_prompt_by_prompt():
    """Beside the goal (a ratio of the two rows' median speedups) the summary gives the median of
    the per-prompt ratios of the same two rows' wall-clocks (each prompt's runs back to back)."""
    segments = {"edit": {"ngram/auto": {"speedup": 2.0, "wall_s": [1.0, 3.0, 2.0]},
                         "portfolio/auto": {"speedup": 1.9, "wall_s": [0.5, 3.3, 2.0]}}}
    g = spec_goals.drafter_goals(segments)
    assert g["portfolio_over_ngram"]["measured"] == {"edit": 0.95}
    assert g["portfolio_over_ngram_paired"]["measured"] == {"edit": 1.0}  # ratios 2.0, 0.909, 1.0
    shown = spec_goals.format_table({"segments": {}, "plain": {}, "summary": g})
    assert "INFO  portfolio_over_ngram_paired" in shown and "FAIL  portfolio_over_ngram" in shown


def test_the_portfolio_is_also_compared_with_ngram_over_all_the_prompts_time_and_by_round():
    """Beside the goal, the ratio of the two rows' pooled speedups (all prompts' wall-clock), then
    each round's; rounds only where the rows pooled more than one."""
    segments = {"code": {"ngram/auto": {"speedup": 1.62, "pooled_speedup": 1.5, "pooled_speedup_by_round": [1.5, 1.4, 1.6]},
                         "portfolio/auto": {"speedup": 1.58, "pooled_speedup": 1.65, "pooled_speedup_by_round": [1.6, 1.68, 1.6]}},
                "edit": {"ngram/auto": {"speedup": 2.0, "pooled_speedup": 2.0, "pooled_speedup_by_round": [2.0]},
                         "portfolio/auto": {"speedup": 1.9, "pooled_speedup": 1.9, "pooled_speedup_by_round": [1.9]}}}
    g = spec_goals.drafter_goals(segments)
    assert g["portfolio_over_ngram"]["measured"] == {"code": 0.975, "edit": 0.95}  # the goal's ratio is unchanged
    assert g["portfolio_over_ngram_pooled"]["measured"] == {"code": [1.1, 1.067, 1.2, 1.0], "edit": [0.95]}
    assert "pass" not in g["portfolio_over_ngram_pooled"]  # shown beside the goal, not one
    assert "INFO  portfolio_over_ngram_pooled" in spec_goals.format_table({"segments": {}, "plain": {}, "summary": g})
    assert "portfolio_over_ngram_pooled" not in spec_goals.drafter_goals(
        {"chat": {"ngram/auto": {"speedup": 1.0}, "portfolio/auto": {"speedup": 1.1}}})  # rows without pooled speedups


def test_goals_not_measured_in_the_run_are_left_out_not_failed():
    """A run of chat alone without HF peers (``--segments chat --no-hf``) measured nothing for
    n-gram's 2x on summarize / edit or the HF comparison: those goals are absent, not FAIL."""
    row = {"k": "auto", "speedup": 1.2, "pooled_speedup": 1.2, "predicted_speedup": 1.1, "vs_hf": None}
    g = spec_goals.goals({"chat": {"ngram/auto": row, "portfolio/auto": {**row, "speedup": 1.5}}}, "ngram/auto")
    assert "ngram_summarize_edit_2x" not in g and "faster_than_hf_same_method" not in g
    assert "measured_vs_predicted" not in g  # no fixed-K row
    assert g["auto_k_never_3pct_slower"]["pass"] and g["portfolio_over_ngram"]["measured"] == {"chat": 1.25}
    shown = spec_goals.format_table({"segments": {}, "plain": {}, "summary": g})
    assert "FAIL" not in shown and "PASS  portfolio_over_ngram" in shown
    fixed = {**row, "k": 4, "vs_hf": 1.1}
    g = spec_goals.goals({"edit": {"ngram/k4": {**fixed, "speedup": 1.9}}}, "ngram/k4")
    assert not g["ngram_summarize_edit_2x"]["pass"] and g["ngram_summarize_edit_2x"]["measured"] == {"edit": 1.9}
    assert not g["faster_than_hf_same_method"]["pass"] and g["measured_vs_predicted"]["pass"]
