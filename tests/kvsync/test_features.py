"""Target features on the wire and the engine side's feature buffer: rows round-trip in each
dtype, the buffer keeps rows by position (contiguous from 0 only), drops rows of other layers and
forgets a sequence."""
import pytest
import torch

from cluster.kvsync.features import FEATURE_DTYPES, FeatureBuffer, check_features, decode_features, encode_features
from cluster.models.runner import SeqChunk


@pytest.mark.parametrize("dtype", sorted(FEATURE_DTYPES))
def test_rows_round_trip_in_each_dtype(dtype):
    rows = torch.randn(5, 6)
    msg = encode_features(rows, 3, dtype)
    check_features(msg, 6)
    assert (msg.start_pos, msg.num_positions, msg.width) == (3, 5, 6)
    assert len(msg.data) == 5 * 6 * FEATURE_DTYPES[dtype][1].itemsize
    torch.testing.assert_close(decode_features(msg), rows.to(FEATURE_DTYPES[dtype][1]).float(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="reads 7 values"):
        check_features(msg, 7)


def test_buffer_keeps_contiguous_rows_by_position_and_forgets():
    buf = FeatureBuffer(hidden_size=2, fingerprint="t", dtype="float32")
    assert buf.feature_layers == () and buf.width == 0
    buf.want((0, 3))
    assert buf.width == 4
    pos = lambda a, b: torch.arange(a, b).float().view(-1, 1).repeat(1, 4)  # noqa: E731 row p is all p
    # a prefill of a (positions 0..2) and a verification of b whose prefill ran before want()
    buf.record([SeqChunk("a", [1, 2, 3], 0, 1), SeqChunk("b", [7, 8], 5, 2)], torch.cat([pos(0, 3), pos(5, 7)]))
    assert buf.covers("a", 3) and not buf.covers("a", 4)
    assert not buf.covers("b", 1) and buf.covers("b", 0)  # no rows from position 0: never drafted
    buf.record([SeqChunk("a", [4] * 100, 2, 1)], pos(2, 102))  # grows past its capacity
    assert buf.covers("a", 102)
    msg = buf.encode("a", 1, 101)
    torch.testing.assert_close(decode_features(msg), pos(1, 101))
    buf.forget("a")
    assert not buf.covers("a", 1) and buf.num_sequences == 1
    buf.want((1, 2))  # rows of other layers are useless
    assert buf.num_sequences == 0
    with pytest.raises(ValueError, match="wide"):
        buf.record([SeqChunk("a", [1], 0, 1)], torch.zeros(1, 3))


def test_buffer_gives_a_sharing_sequence_the_rows_of_its_cached_prefix():
    """Kept rows of an indexed block, and rows borrowed from the block's writer in the same
    forward: the sharer covers its prefix as if the target had run it; before the draft side names
    its layers every block is shared (nothing is recorded for anyone)."""
    from cluster.models.kv_cache import CachedBlock

    buf = FeatureBuffer(hidden_size=2, fingerprint="t", dtype="float32")
    blocks = [CachedBlock(7, b"k0", 0, 4), CachedBlock(8, b"k1", 4, 8)]
    assert buf.adopt_prefix("early", blocks) == 2 and not buf.covers("early", 1)
    buf.want((0, 3))
    pos = lambda a, b: torch.arange(a, b).float().view(-1, 1).repeat(1, 4)  # noqa: E731 row p is all p
    buf.record([SeqChunk("a", [1] * 6, 0, 1)], pos(0, 6))
    buf.keep_prefix("a", blocks)  # block 8 (positions 4..7) is not covered: not kept
    assert buf.adopt_prefix("b", blocks) == 1 and buf.covers("b", 4) and not buf.covers("b", 5)
    # "c" shares block 7 (kept) and block 8, which "a" began (4..5) and ends in this step (6..7)
    assert buf.adopt_prefix("c", blocks, {8: "a"}) == 2 and not buf.covers("c", 5)
    buf.record([SeqChunk("a", [2, 2, 2], 6, 1), SeqChunk("c", [3, 3], 8, 1)],
               torch.cat([pos(6, 9), pos(8, 10) + 100]))
    assert buf.covers("c", 10)
    torch.testing.assert_close(decode_features(buf.encode("c", 0, 10)),
                               torch.cat([pos(0, 6), pos(6, 8), pos(8, 10) + 100]))
    assert buf.adopt_prefix("d", [CachedBlock(7, b"another prefix", 0, 4)]) == 0


def test_feature_requests_this_engine_cannot_serve_are_refused_with_the_reason():
    from cluster.api import stubs
    from cluster.kvsync.features import feature_request_refusal

    info = stubs.kvsync_pb2().InfoResponse(drafter="eagle:h", feature_layers=[0, 3], feature_width=4,
                                           feature_target="t")
    buf = FeatureBuffer(hidden_size=2, fingerprint="t")
    assert feature_request_refusal(info, buf) is None
    assert feature_request_refusal(stubs.kvsync_pb2().InfoResponse(drafter="ngram"), None) is None
    assert "gives none" in feature_request_refusal(info, None)
    assert "trained for target t" in feature_request_refusal(info, FeatureBuffer(2, fingerprint="u"))
    assert "4 feature values" in feature_request_refusal(info, FeatureBuffer(3, fingerprint="t"))
