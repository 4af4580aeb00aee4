"""The ResponseStore's bounded memory: least recently used out first, by count and by characters
(no Ray: the deployment is a dictionary behind a handle; end to end: test_responses_http.py)."""
from deployments.response_store import StoredResponses


def test_count_and_characters_bound_it_least_recently_used_out_first():
    s = StoredResponses(max_responses=3, max_chars=100)
    for i in range(3):
        s.put(f"r{i}", {"n": i}, 10)
    assert s.get("r0") == {"n": 0}  # r0 used: r1 is now the oldest
    s.put("r3", {"n": 3}, 10)
    assert s.get("r1") is None and [s.get(f"r{i}") is not None for i in (0, 2, 3)] == [True, True, True]
    s.put("big", {"n": 9}, 85)  # 115 characters: out go the oldest until it fits
    assert len(s) == 2 and s.chars == 95 and s.get("big") and s.get("r3")
    s.put("huge", {}, 500)  # over the cap alone: kept, alone (a response is never refused after the fact)
    assert len(s) == 1 and s.chars == 500
    assert s.delete("huge") and not s.delete("huge") and s.chars == 0 and len(s) == 0


def test_a_put_again_replaces_and_zero_keeps_nothing():
    s = StoredResponses(max_responses=2, max_chars=100)
    s.put("a", {"v": 1}, 10)
    s.put("a", {"v": 2}, 20)
    assert s.get("a") == {"v": 2} and s.chars == 20 and len(s) == 1
    off = StoredResponses(max_responses=0, max_chars=100)
    off.put("a", {}, 1)
    assert off.get("a") is None and len(off) == 0
