"""Target features over KVSync: what a DraftServer hosting an EAGLE head (``eagle:DIR``) needs
from the target, which runs in the SpecEngine (placement ``separate``).

Owns: the wire form of ``TargetFeatures`` (rows [N, width] for positions [start, start + N), in
float32, float16 or bfloat16 bytes; ``encode_features`` / ``check_features`` / ``decode_features``),
whether this engine can give what a DraftServer's Info asks for (``feature_request_refusal``: a
native target runner, the target the head was trained for, the width) and ``FeatureBuffer``, the engine side's
feature tap: installed on the target runner, it keeps per
sequence the features of every position a committed target forward ran (in the wire dtype), so
that a Propose sends the positions the draft side lacks and a resync resends them from position 0;
under prefix caching it keeps the rows of every prefix block the target's KV cache indexes and
gives them to a sequence that shares the block (``keep_prefix`` / ``adopt_prefix``, a block the
same step writes borrowed from its writer's rows), so the draft side gets a shared prefix's
features as if the target had run it.
It records nothing until the DraftServer names its feature layers (``want``); a sequence whose
prefill ran before that has no features from position 0 and is not drafted (never a draft from
missing features). Memory: one row per position of each running sequence, freed when the runner
frees the sequence or the proposer releases it.
Ignores: which positions the draft side holds (``cluster.kvsync.client`` / ``server``), drafting.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.api import stubs
from cluster.models.kv_cache import CachedBlock
from cluster.models.runner import SeqChunk
from cluster.speculative.prefix_features import PrefixFeatureStore

# wire dtype name -> (FeatureDtype value in kvsync.proto, torch dtype)
FEATURE_DTYPES = {"float32": (1, torch.float32), "float16": (2, torch.float16), "bfloat16": (3, torch.bfloat16)}
_BY_CODE = {code: dtype for code, dtype in FEATURE_DTYPES.values()}


def encode_features(rows: torch.Tensor, start_pos: int, dtype: str):
    """rows [N, width] (any float dtype) -> ``TargetFeatures`` for positions [start_pos, start_pos + N)."""
    code, torch_dtype = FEATURE_DTYPES[dtype]
    data = rows.to(torch_dtype).contiguous().view(torch.uint8).numpy().tobytes()
    return stubs.kvsync_pb2().TargetFeatures(start_pos=start_pos, num_positions=rows.shape[0],
                                            width=rows.shape[1], dtype=code, data=data)


def check_features(msg, width: int) -> None:
    """Refuse (ValueError) a ``TargetFeatures`` that is not [num_positions, width] of a known dtype."""
    dtype = _BY_CODE.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"unknown feature dtype {msg.dtype}")
    if msg.width != width:
        raise ValueError(f"features are {msg.width} wide; this drafter reads {width} values per position")
    if msg.num_positions == 0:
        raise ValueError("features with no positions")
    expected = msg.num_positions * width * dtype.itemsize
    if len(msg.data) != expected:
        raise ValueError(f"{len(msg.data)} bytes of features, expected {expected} "
                         f"({msg.num_positions} positions x {width} x {dtype.itemsize})")


def decode_features(msg) -> torch.Tensor:  # [num_positions, width] float32
    """A ``TargetFeatures`` that passed ``check_features``, as float32 rows."""
    rows = torch.frombuffer(bytearray(msg.data), dtype=_BY_CODE[msg.dtype])
    return rows.view(msg.num_positions, msg.width).float()


def feature_request_refusal(info, buffer: "FeatureBuffer | None") -> str | None:
    """Why this engine cannot feed the drafter an ``InfoResponse`` describes (None: it can, or
    the drafter reads no features). buffer: the engine's tap (None: its runner gives no features)."""
    layers = tuple(info.feature_layers)
    if not layers:
        return None
    if buffer is None:
        return (f"draft server runs {info.drafter!r}, which reads the target's features, but this "
                f"engine's target runner gives none (not the native runner)")
    if info.feature_target and info.feature_target != buffer.fingerprint:
        return (f"draft server runs {info.drafter!r}, trained for target {info.feature_target}; this "
                f"engine's target is {buffer.fingerprint}")
    if info.feature_width != len(layers) * buffer.hidden_size:
        return (f"draft server reads {info.feature_width} feature values per position; this target "
                f"gives {len(layers)} x {buffer.hidden_size}")
    return None


@dataclass(slots=True)
class _Rows:
    feats: torch.Tensor  # [capacity, width] in the wire dtype, by position
    filled: int = 0  # positions [0, filled) were written by committed target forwards


class FeatureBuffer:
    """The target runner's feature tap on the engine side of KVSync (``FeatureTap``)."""

    def __init__(self, hidden_size: int, fingerprint: str, dtype: str = "bfloat16") -> None:
        if dtype not in FEATURE_DTYPES:
            raise ValueError(f"feature dtype must be one of {sorted(FEATURE_DTYPES)}, got {dtype!r}")
        self.hidden_size = hidden_size
        self.fingerprint = fingerprint  # the target's identity (``eagle_head.target_identity``)
        self.dtype = dtype
        self.feature_layers: tuple[int, ...] = ()  # empty: the runner computes no features
        self._seqs: dict[str, _Rows] = {}
        self._prefix = PrefixFeatureStore()  # rows of the target's indexed prefix blocks

    @property
    def width(self) -> int:
        return len(self.feature_layers) * self.hidden_size

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def want(self, layers: tuple[int, ...]) -> None:
        """The draft side reads these layers from now on; rows recorded for others are dropped."""
        layers = tuple(layers)
        if layers != self.feature_layers:
            self.feature_layers = layers
            self._seqs.clear()
            self._prefix.clear()

    def record(self, chunks: list[SeqChunk], features: torch.Tensor) -> None:
        """features [sum len(token_ids), width] float32 of a committed target forward."""
        if features.shape[-1] != self.width:
            raise ValueError(f"features are {features.shape[-1]} wide, expected {self.width}")
        rows = features.to(FEATURE_DTYPES[self.dtype][1])
        borrowed = self._prefix.borrowed_rows(chunks)  # sharers' rows of blocks this forward wrote
        row = 0
        for c in chunks:
            n = len(c.token_ids)
            end = c.start_pos + n
            st = self._seqs.get(c.seq_id)
            if st is None:
                st = self._seqs[c.seq_id] = _Rows(rows.new_zeros(max(64, 2 * end), self.width))
            elif end > st.feats.shape[0]:
                grown = rows.new_zeros(max(2 * st.feats.shape[0], end), self.width)
                grown[: st.filled] = st.feats[: st.filled]
                st.feats = grown
            st.feats[c.start_pos : end] = rows[row : row + n]
            for lender, start, split, stop, r in borrowed.get(c.seq_id, ()):
                src = self._seqs.get(lender)
                if start > st.filled or src is None or src.filled < split:
                    break
                st.feats[start:split] = src.feats[start:split]  # the lender ran these in an earlier forward
                st.feats[split:stop] = rows[r : r + stop - split]
                st.filled = stop
            if c.start_pos <= st.filled:  # contiguous from 0 (a prefill that ran before want() is not)
                st.filled = max(st.filled, end)
            row += n

    def covers(self, seq_id: str, num_positions: int) -> bool:
        """Features of positions [0, num_positions) are held."""
        st = self._seqs.get(seq_id)
        return num_positions <= 0 or (st is not None and st.filled >= num_positions)

    def encode(self, seq_id: str, start: int, end: int):
        """``TargetFeatures`` of positions [start, end) (``covers(seq_id, end)`` must hold)."""
        rows = self._seqs[seq_id].feats[start:end]  # [end - start, width]
        return encode_features(rows, start, self.dtype)

    def keep_prefix(self, seq_id: str, blocks: list[CachedBlock]) -> None:
        """The target's KV cache just indexed these full blocks of the sequence: keep their rows."""
        st = self._seqs.get(seq_id)
        if st is not None:
            self._prefix.keep(st.feats, st.filled, blocks)

    def adopt_prefix(self, seq_id: str, blocks: list[CachedBlock], in_flight: dict[int, str] | None = None) -> int:
        """A sequence starts on these cached blocks (the target will not run them): its rows
        there are the kept ones, then those of blocks this step writes for another sequence
        (``in_flight``), borrowed from its rows when the forward is recorded; returns for how many
        leading blocks. Before the draft side named its layers nothing is recorded for anyone:
        every block is shared (the sequence is not drafted, as one prefilled then)."""
        if not self.feature_layers:
            self._seqs.pop(seq_id, None)
            return len(blocks)
        num_blocks, rows, filled = self._prefix.adopt(seq_id, blocks, in_flight, self.width,
                                                      FEATURE_DTYPES[self.dtype][1])
        if num_blocks:
            self._seqs[seq_id] = _Rows(rows, filled)
        else:
            self._seqs.pop(seq_id, None)
        return num_blocks

    def forget(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)
        self._prefix.forget(seq_id)
