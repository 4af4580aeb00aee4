"""EAGLE drafter (``eagle:DIR``): a trained head that drafts from the target's own features, read
from the target's forward passes (no extra target work). Placement ``shared``: it is the target
runner's feature tap. Placement ``separate``: a DraftServer hosts it and feeds ``record`` with the
features the SpecEngine sends over KVSync (``cluster.kvsync.features``).

Owns: ``EagleProposer`` (DrafterKind.EAGLE). It is the target runner's feature tap: every
committed target forward (prefill, plain decode, verification) hands it the features of the fed
tokens; they are fused (``fc``) in batches of positions, or before a propose, and kept per sequence by
position. To propose for a sequence with committed tokens
x_0..x_{n-1} (features known for positions 0..n-2; the last token is the one the target has not
run yet) it
- catches up: runs the pairs (feature t, token t+1) for the anchors t it has not run yet
  (rolled back to the longest common prefix with what it ran before) into its own persistent KV;
- drafts: the last catch-up output gives draft token 1; draft step j feeds the head's own output
  and the embedding of draft token j, with temporary K/V dropped after the round (only K/V from
  target features at committed positions persist);
over a ragged batch (padding masks), greedy, seeded or sampled through ``draft_rounds``, with q over
the full target vocabulary (zero outside the trimmed draft vocabulary). Under prefix caching it
keeps the fused features of every prefix block the target's KV cache indexes (by physical block,
with the block's prefix key) and hands them to a sequence that shares the block, which the
target never runs over that prefix (``keep_prefix`` / ``adopt_prefix``); a block the same step
writes for another sequence (shared in the step it is filled) is borrowed: the sharer's features
there are that sequence's rows of the same forward, written when the forward is recorded.
Ignores: verification, K, training (``cluster.training``), transport (``cluster.kvsync``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.models.kv_cache import CachedBlock
from cluster.models.runner import ModelRunner, SeqChunk
from cluster.speculative.drafting import draft_rounds
from cluster.speculative.eagle_head import EagleHead
from cluster.speculative.head_formats import load_any_head
from cluster.speculative.prefix_features import PrefixFeatureStore
from cluster.speculative.proposer import DrafterKind
from cluster.speculative.types import DraftProposal, ProposeInput


@dataclass(slots=True)
class _SeqState:
    feats: torch.Tensor  # [capacity, H] fused target features by position (written by _fuse_pending)
    filled: int = 0  # positions [0, filled) were written by some committed target forward
    # head K/V by anchor, [Hkv, capacity, D]: anchors [0, held) persist (computed from target
    # features of committed tokens); a propose writes its catch-up after them and its draft
    # rounds' K/V after that (scratch, overwritten by the next propose)
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    held: int = 0
    tokens: list[int] | None = None  # the committed tokens the persistent K/V was computed from
    length: int = 0  # during a propose: the anchors' K/V written so far (held, catch-up, drafts)

    def reserve(self, rows: int, kv_heads: int, head_dim: int) -> None:
        """Room for ``rows`` anchors' K/V (doubling: a round appends one row)."""
        have = 0 if self.k is None else self.k.shape[1]
        if rows <= have:
            return
        cap = max(64, 2 * have, rows)
        k, v = torch.empty(kv_heads, cap, head_dim), torch.empty(kv_heads, cap, head_dim)
        if self.k is not None:
            k[:, :have], v[:, :have] = self.k, self.v
        self.k, self.v = k, v


class EagleProposer:
    kind = DrafterKind.EAGLE
    # recorded target positions held raw (not fused yet) at most: ~28 MB of the default model's
    # 3 x 576 features; a propose fuses what is held first
    max_raw_rows = 4096

    def __init__(self, head: EagleHead, target_runner: ModelRunner) -> None:
        self.head = head.eval()
        head.pack_for_inference()  # drafting runs with autograd off: the engine's skinny-GEMM projections
        self.embed = target_runner.model.embed  # [V, H] the target's, frozen
        self.feature_layers = tuple(head.cfg.feature_layers)
        self.feature_width = len(self.feature_layers) * head.cfg.hidden_size  # values per position
        self.target_fingerprint = head.cfg.target.fingerprint  # the target it was trained for
        self.head_dir: Path | None = None  # where the head was loaded from (``from_dir``)
        self._seqs: dict[str, _SeqState] = {}
        self._round: dict[str, torch.Tensor] = {}  # per propose: seq -> last head output [H]
        # recorded forwards not fused yet: the (state, start, end) rows each wrote, its features
        self._pending: list[tuple[list[tuple[_SeqState, int, int]], torch.Tensor]] = []
        self._pending_rows = 0
        self.last_caught_up = 0  # committed positions the last propose ran (its feeds), all rows
        self._prefix = PrefixFeatureStore()  # fused features [bs, H] of the target's indexed prefix blocks
        if target_runner.feature_tap is not None:
            raise ValueError("the target runner already feeds another EAGLE drafter")
        target_runner.feature_tap = self

    @classmethod
    def from_dir(cls, head_dir, target_runner) -> "EagleProposer":
        from cluster.common.errors import ModelLoadError

        if not isinstance(target_runner, ModelRunner):
            raise ModelLoadError("the eagle drafter needs a Llama-family target (native runner)")
        proposer = cls(load_any_head(head_dir, target_runner.model), target_runner)  # any head format
        proposer.head_dir = Path(head_dir)
        return proposer

    def round_parameters(self) -> int:
        """Weights one draft round reads: the decoder layer and the trimmed LM head (fc runs once
        per committed token, in the catch-up)."""
        return sum(p.numel() for name, p in self.head.named_parameters() if not name.startswith("fc."))

    # -- feature tap -------------------------------------------------------------------------------
    @torch.inference_mode()
    def record(self, chunks: list[SeqChunk], features: torch.Tensor) -> None:
        """features [sum len(token_ids), |layers| * H] of a committed target forward. Kept raw and
        fused (``fc``) when a propose needs them, or once ``max_raw_rows`` are held: ``fc`` reads
        its weights once per call whatever the row count (fusing each decode step's one row cost
        as much as fusing 64), and a sequence the head never drafts for — parked by adaptive K,
        or one a portfolio drafts for with another member — never pays ``fc`` over its prompt
        (~1% of a long summarize request's time, 2 cores)."""
        features = features.to(torch.float32)
        borrowed = self._prefix.borrowed_rows(chunks)  # sharers' rows of blocks this forward wrote
        writes = []
        for c in chunks:
            end = c.start_pos + len(c.token_ids)
            st = self._seqs.get(c.seq_id)
            if st is None:
                st = self._seqs[c.seq_id] = _SeqState(torch.zeros(max(64, 2 * end), self.head.cfg.hidden_size))
            elif end > st.feats.shape[0]:
                grown = st.feats.new_zeros(max(2 * st.feats.shape[0], end), st.feats.shape[1])
                grown[: st.feats.shape[0]] = st.feats
                st.feats = grown
            for lender, start, split, stop, row in borrowed.get(c.seq_id, ()):
                src = self._seqs.get(lender)
                if start > st.filled or src is None or src.filled < split:
                    break
                if split > start:  # the lender ran these in an earlier forward: its fused rows
                    self._fuse_pending()
                    st.feats[start:split] = src.feats[start:split]
                if stop > split:
                    self._pending.append(([(st, split, stop)], features[row : row + stop - split]))
                    self._pending_rows += stop - split
                st.filled = stop
            st.filled = max(st.filled, end) if c.start_pos <= st.filled else st.filled
            writes.append((st, c.start_pos, end))
        self._pending.append((writes, features))  # handed over: kept as is
        self._pending_rows += features.shape[0]
        if self._pending_rows >= self.max_raw_rows:
            self._fuse_pending()

    def _fuse_pending(self) -> None:
        """Fuse the recorded rows not fused yet of the sequences still held, in one ``fc`` call,
        and write them in the order the forwards ran (a verification's rejected positions are
        overwritten later); rows of sequences released since are dropped unfused."""
        if not self._pending:
            return
        held = {id(st) for st in self._seqs.values()}  # (a released state in _pending stays alive: ids stay apart)
        parts, writes = [], []
        for forward_writes, features in self._pending:
            row = 0
            for st, start, end in forward_writes:
                if id(st) in held:
                    parts.append(features[row : row + end - start])
                    writes.append((st, start, end))
                row += end - start
        self._pending, self._pending_rows = [], 0
        if not parts:
            return
        fused = self.head.fuse(torch.cat(parts) if len(parts) > 1 else parts[0])  # [rows, H]
        row = 0
        for st, start, end in writes:
            st.feats[start:end] = fused[row : row + end - start]
            row += end - start

    # -- prefix caching ----------------------------------------------------------------------------
    @torch.inference_mode()
    def keep_prefix(self, seq_id: str, blocks: list[CachedBlock]) -> None:
        """The target's KV cache just indexed these full blocks of the sequence (committed
        positions): keep their fused features for a sequence that will share them."""
        st = self._seqs.get(seq_id)
        if st is None:
            return
        self._fuse_pending()
        self._prefix.keep(st.feats, st.filled, blocks)

    def adopt_prefix(self, seq_id: str, blocks: list[CachedBlock], in_flight: dict[int, str] | None = None) -> int:
        """A sequence starts with these cached blocks of the target (positions from 0; the
        target will not run them): its features there are the kept ones, for as many leading
        blocks as are kept under the same key, then those of the blocks the step being scheduled
        writes for another sequence (``in_flight``: block -> that sequence), borrowed from its
        rows when the forward is recorded. Returns how many."""
        num_blocks, feats, filled = self._prefix.adopt(seq_id, blocks, in_flight, self.head.cfg.hidden_size,
                                                       torch.float32)
        if num_blocks:
            self._seqs[seq_id] = _SeqState(feats, filled)
        else:
            self._seqs.pop(seq_id, None)  # (a state left by blocks given back at an earlier try)
        return num_blocks

    # -- drafting ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, inputs: list[ProposeInput]) -> DraftProposal:
        starts, feeds = [], []
        self._round = {}
        self._fuse_pending()
        for inp in inputs:
            n = len(inp.token_ids)
            st = self._seqs.get(inp.seq_id)
            # features of positions 0..n-2 must come from the target (recorded since its prefill)
            if st is None or n < 2 or st.filled < n - 1 or inp.num_draft_tokens <= 0:
                starts.append(0)
                feeds.append([])
                continue
            held = st.held = st.length = self._kept(st, inp.token_ids)  # the anchors not kept are dropped
            starts.append(held + 1)  # the pair of anchor t sits at position t + 1
            feeds.append(list(inp.token_ids[held + 1 :]))
        self.last_caught_up = sum(len(f) for f in feeds)
        proposal = draft_rounds(inputs, starts, feeds, self._forward)
        for inp, feed in zip(inputs, feeds):
            st = self._seqs.get(inp.seq_id)
            if feed and st is not None:  # keep the catch-up K/V (anchors 0..n-2), drop the drafts'
                st.held, st.tokens = len(inp.token_ids) - 1, list(inp.token_ids)
        self._round = {}
        return proposal

    def positions_behind(self, seq_id: str, token_ids: list[int]) -> int:
        """Pairs a draft for the sequence would feed first: those since its last draft (all but
        the last token on its first)."""
        st = self._seqs.get(seq_id)
        return max(0, len(token_ids) - 1 - (0 if st is None else self._kept(st, token_ids)))

    @staticmethod
    def _kept(st: _SeqState, token_ids: list[int]) -> int:
        """Anchors kept: those whose pair (tokens up to t + 1) is unchanged, and at most n - 2 so
        that at least one pair is fed (its output gives draft token 1)."""
        old = st.tokens or []
        limit = min(len(old), len(token_ids))
        if old[:limit] == token_ids[:limit]:  # the usual case, compared in C (asked every step)
            common = limit
        else:
            common = 0
            while old[common] == token_ids[common]:
                common += 1
        return max(0, min(st.held, common - 1, len(token_ids) - 2))

    def _forward(self, chunks: list[SeqChunk]) -> torch.Tensor:  # [len(chunks), V]
        """One draft round for a ragged batch: catch-up pairs for a sequence's first round (its
        feed starts at position held + 1), one draft pair after that. Each sequence's new K/V go
        into its own buffer after what it holds; one sequence attends to its buffer as is (no
        padded copy, no mask for a single pair), a batch to a padded copy with a padding mask."""
        head = self.head
        H, Hkv, D = head.cfg.hidden_size, head.cfg.num_kv_heads, head.cfg.head_dim
        B = len(chunks)
        q_lens = [len(c.token_ids) for c in chunks]
        Q = max(q_lens)
        states = [self._seqs[c.seq_id] for c in chunks]
        for c, st, n in zip(chunks, states, q_lens):
            st.reserve(st.length + n, Hkv, D)
        if B == 1:
            (c,), (st,) = chunks, states
            n, L = Q, st.length
            drafting = c.seq_id in self._round  # a draft step: the head's own output carries on
            rows = self._round[c.seq_id] if drafting else st.feats[c.start_pos - 1 : c.start_pos - 1 + n]
            hidden = rows.view(1, n, H)
            tokens = torch.tensor([c.token_ids])  # [1, n]
            positions = torch.arange(c.start_pos, c.start_pos + n).view(1, n)
            past_k, past_v = (st.k[None, :, :L], st.v[None, :, :L]) if L else (None, None)
            mask = None if n == 1 else torch.ones(1, 1, n, L + n, dtype=torch.bool).tril(L)  # causal over the new pairs
        else:
            hidden = torch.zeros(B, Q, H)
            tokens = torch.zeros(B, Q, dtype=torch.int64)
            positions = torch.zeros(B, Q, dtype=torch.int64)
            L = max(st.length for st in states)
            past_k = torch.zeros(B, Hkv, L, D)
            past_v = torch.zeros(B, Hkv, L, D)
            mask = torch.zeros(B, 1, Q, L + Q, dtype=torch.bool)
            causal = torch.ones(Q, Q, dtype=torch.bool).tril()
            for b, (c, st) in enumerate(zip(chunks, states)):
                n, lb = q_lens[b], st.length
                if c.seq_id in self._round:
                    hidden[b, 0] = self._round[c.seq_id]
                else:  # catch-up: anchors start-1 .. start+n-2 from the target's features
                    hidden[b, :n] = st.feats[c.start_pos - 1 : c.start_pos - 1 + n]
                tokens[b, :n] = torch.tensor(c.token_ids)
                positions[b, :n] = torch.arange(c.start_pos, c.start_pos + n)
                past_k[b, :, :lb], past_v[b, :, :lb] = st.k[:, :lb], st.v[:, :lb]
                mask[b, 0, :, :lb] = True
                mask[b, 0, :, L : L + n] = causal[:, :n]
        emb = self.embed[tokens].float()  # [B, Q, H]
        out, new_k, new_v = head.layer(hidden, emb, positions, past_k, past_v, mask)
        final = out[torch.arange(B), torch.tensor(q_lens) - 1]  # [B, H]
        for b, (c, st) in enumerate(zip(chunks, states)):
            n = q_lens[b]
            st.k[:, st.length : st.length + n] = new_k[b, :, :n]
            st.v[:, st.length : st.length + n] = new_v[b, :, :n]
            st.length += n
            self._round[c.seq_id] = final[b]
        return head.to_target_logits(head.draft_logits(final))  # [B, V]

    def release(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)
        self._prefix.forget(seq_id)

    forget = release  # the target runner freed the sequence (e.g. its start-up calibration run)
