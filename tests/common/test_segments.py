"""Segment labels bounded per Router: the first max_segments kept, the rest folded into 'other';
segments the config names are always kept."""
import threading

import pytest

from cluster.common.segments import OTHER_SEGMENT, SegmentLabels


def test_first_labels_kept_then_folded():
    s = SegmentLabels(3)
    assert [s.label(x) for x in ("code", "chat", "code", "json")] == ["code", "chat", "code", "json"]
    assert s.label("req-1234") == OTHER_SEGMENT and s.label("req-5678") == OTHER_SEGMENT
    assert s.label("chat") == "chat"  # admitted labels stay theirs
    assert s.admitted() == {"code", "chat", "json"}
    with pytest.raises(ValueError):
        SegmentLabels(0)


def test_configured_segments_are_kept_beside_the_cap():
    s = SegmentLabels(1, configured={"json"})
    assert [s.label(x) for x in ("code", "chat", "json")] == ["code", OTHER_SEGMENT, "json"]
    assert s.admitted() == {"code"}  # json does not take the one free place


def test_bounded_under_concurrent_unique_labels():
    s = SegmentLabels(32)
    out: list[str] = []
    lock = threading.Lock()

    def client(i):
        got = [s.label(f"user-{i}-{n}") for n in range(200)]
        with lock:
            out.extend(got)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(s.admitted()) == 32
    assert sum(x != OTHER_SEGMENT for x in out) == 32 and len(out) == 1600
