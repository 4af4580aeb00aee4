"""SpecConfig's per-segment drafter and K policy (``SegmentSpeculation``): what is in force for a segment
(its own, else the global one), the union of drafters the engine builds, max_draft_tokens covering every
fixed K, and bad K policies refused with the segment named."""
from __future__ import annotations

import pytest

from cluster.common.config import SegmentSpeculation, SpecConfig


def test_segment_settings_fall_back_to_the_global_ones():
    cfg = SpecConfig(drafter="ngram", num_draft_tokens=3,
                     segments={"code": {"drafter": "suffix"}, "chat": SegmentSpeculation(num_draft_tokens="auto"),
                               "json": {"num_draft_tokens": "2"}})
    table = [  # segment -> (drafter in force, K policy in force)
        ("code", "suffix", 3), ("chat", "ngram", "auto"), ("json", "ngram", 2), ("other", "ngram", 3),
    ]
    for seg, drafter, k in table:
        assert (cfg.drafter_for(seg), cfg.k_policy(seg)) == (drafter, k), seg
    assert cfg.drafters() == {"ngram": [], "suffix": ["code"]}
    assert cfg.adaptive  # chat plans adaptively though the global K is fixed
    assert not SpecConfig(num_draft_tokens=3, segments={"a": {"num_draft_tokens": 1}}).adaptive


def test_max_draft_tokens_covers_every_fixed_k():
    assert SpecConfig().max_draft_tokens == 6
    assert SpecConfig(segments={"code": {"num_draft_tokens": 9}}).max_draft_tokens == 9
    assert SpecConfig(num_draft_tokens=2, segments={"code": {"num_draft_tokens": 0}}).max_draft_tokens == 6


@pytest.mark.parametrize("segments,needle", [
    ({"chat": {"num_draft_tokens": 17}}, r"router.segments.chat.num_draft_tokens must be in \[0, 16\]"),
    ({"chat": {"num_draft_tokens": -1}}, "router.segments.chat.num_draft_tokens"),
    ({"chat": {"num_draft_tokens": "many"}}, "router.segments.chat.num_draft_tokens must be an integer or 'auto'"),
    ({"chat": {"num_draft_tokens": True}}, "router.segments.chat.num_draft_tokens"),
    ({"chat": {"drafter": "none"}}, "router.segments.chat.drafter"),
    ({"chat": {"k": 3}}, "unexpected keyword"),
])
def test_bad_segment_settings_are_refused(segments, needle):
    with pytest.raises((ValueError, TypeError), match=needle):
        SpecConfig(segments=segments)


def test_segment_settings_survive_the_trip_to_an_engine_core_process():
    import pickle

    from cluster.common.config import EngineConfig

    cfg = EngineConfig(spec=SpecConfig(segments={"code": {"drafter": " suffix ", "num_draft_tokens": 3}}))
    back = pickle.loads(pickle.dumps(cfg))  # ProcessEngine sends its config pickled
    assert back.spec.segments == {"code": SegmentSpeculation("suffix", 3)} and back.spec.k_policy("code") == 3


def test_draft_stop_confidence_is_a_probability_below_one():
    assert SpecConfig().draft_stop_confidence == 0.2 and SpecConfig(draft_stop_confidence=0.0).draft_stop_confidence == 0
    for bad in (1.0, -0.1, float("nan"), True):
        with pytest.raises(ValueError, match="draft_stop_confidence must be in"):
            SpecConfig(draft_stop_confidence=bad)


def test_the_suffix_corpus_is_refused_where_no_drafter_reads_it():
    """``suffix_corpus`` is the corpus of ``suffix`` and of the portfolio's suffix member: named
    where neither is configured, it would be ignored, so it is refused; 'cold' in any case is cold."""
    assert SpecConfig(drafter="suffix", suffix_corpus=" COLD ").suffix_corpus == "cold"
    assert SpecConfig(drafter="portfolio:/heads/v4", suffix_corpus="c.npz").suffix_corpus == "c.npz"
    assert SpecConfig(drafter="ngram", suffix_corpus="c.npz",
                      segments={"chat": {"drafter": "portfolio"}}).suffix_corpus == "c.npz"
    for drafter in ("ngram", "eagle", "suffix:own.npz", "suffix:cold"):  # suffix:X names its own corpus
        with pytest.raises(ValueError, match="no drafter configured drafts with it"):
            SpecConfig(drafter=drafter, suffix_corpus="c.npz")
    for bad in ("", "  "):
        with pytest.raises(ValueError, match="suffix_corpus must be a corpus file"):
            SpecConfig(drafter="suffix", suffix_corpus=bad)
