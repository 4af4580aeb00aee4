"""Training an EAGLE head on the target's own features (``specserve train-draft``).

Owns: ``TrainConfig`` (the recipe), the run directory layout (``data/samples.jsonl``,
``checkpoint.pt``, ``train_log.jsonl``, the head files), the held-out split (every
``heldout_every``-th prompt), the draft vocabulary (the most frequent tokens of the training
outputs, plus EOS; fine-tuning a head with a larger one trims it to its most frequent tokens, and
``epochs`` 0 only trims and evaluates), packing samples into rows, the target pass over a row
(features of the chosen layers and logits at every position, one forward, inference only), the
training-time-test loss, resumable checkpoints, the ``--minutes`` deadline, and α by draft
position on the held-out greedy samples, overall and by corpus source.

Training-time test (TTT), over a packed row of samples (row position t = anchor t: the pair of
target feature t and token t+1, predicting token t+2):
- step 0 feeds fc(target features); step k feeds the head's own step k-1 output at the same
  anchor together with token t+1+k (teacher forced), so the head learns from its own features;
- step k attends to step-0 keys causally within the same sample, and to the keys of steps
  1..k at the same anchor only (what drafting step k sees at inference);
- loss: soft cross-entropy against the target's distribution at row t+1+k restricted to the draft
  vocabulary and renormalised, over anchors whose predicted token is an output token, weighted
  ``step_decay ** k``.
α by position (held out, greedy samples): draft token k of an anchor is correct when it equals the
sample's token (the target's greedy token); α_k = P(draft k correct | drafts 1..k-1 correct), at
every anchor and at the anchors a greedy engine drafting ``ttt_steps`` tokens starts its steps
from (``chain_step_anchors``; what ``bench spec`` measures, lower: a step starts after a rejection
or a bonus token).
Ignores: generating the data (``cluster.training.self_distill``), the command line
(``cluster.commands.train_draft``).
"""
from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from cluster.common.errors import InvalidRequestError
from cluster.models.runner import ModelRunner, SeqChunk
from cluster.speculative.eagle_head import (EagleConfig, EagleHead, EagleTargetMismatch, load_head, save_head,
                                            target_identity, trim_vocabulary)
from cluster.training.self_distill import Sample, extend_samples

CHECKPOINT = "checkpoint.pt"
SAMPLES = "data/samples.jsonl"
LOG = "train_log.jsonl"


@dataclass(slots=True)
class TrainConfig:
    tokens: int = 300_000  # self-distillation data: prompt + output tokens
    epochs: int = 2
    draft_vocab_size: int = 8192
    ttt_steps: int = 3
    step_decay: float = 0.8
    lr: float = 5e-4
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decay after warm-up to lr * this at the last step of the last epoch
    grad_clip: float = 0.5
    row_tokens: int = 512  # packed row length (one optimizer step)
    max_prompt_tokens: int = 192
    max_new_tokens: int = 160
    temperature: float = 0.8  # odd prompts are sampled at this temperature (even ones greedy); 0: all greedy
    heldout_every: int = 20  # every n-th prompt is held out for α by position
    max_prompts: int | None = None
    self_prompts: int = 0  # requests the target writes itself, taken in turn with the other sources' prompts
    self_prompt_openers: tuple[str, ...] = ()  # their first words, in turn (none: the bare user turn)
    self_prompt_temperature: float = 1.0  # what the requests are sampled at
    prompts: str | None = None  # an operator's prompt file (or directory), taken in turn with the others
    corpus: bool = True  # the built-in prompt corpus (False: --prompts and / or --self-prompts only)
    gen_batch_size: int = 16  # sequences generated together (free on resume: the samples made are kept)
    checkpoint_every_s: float = 120.0
    seed: int = 0
    init_from: str | None = None  # a head directory to start from (its weights and draft vocabulary)

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.epochs < 0 or self.ttt_steps < 1 or self.row_tokens < 8:
            raise ValueError("tokens and ttt_steps must be >= 1, epochs >= 0, row_tokens >= 8")
        if self.epochs == 0 and not self.init_from:
            raise ValueError("epochs 0 (no training: trim and evaluate a trained head) needs init_from")
        if self.draft_vocab_size < 1 or self.max_new_tokens < 1 or self.lr <= 0:
            raise ValueError("draft_vocab_size and max_new_tokens must be >= 1, lr > 0")
        if not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be >= 0 (0: every sample greedy), got {self.temperature}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.self_prompts < 0:
            raise ValueError(f"self_prompts must be >= 0, got {self.self_prompts}")
        if self.self_prompt_openers and not self.self_prompts:
            raise ValueError("self_prompt_openers start self-written requests: give self_prompts too")
        if any(not o.strip() for o in self.self_prompt_openers):
            raise ValueError("a self-prompt opener must have words in it")
        if not 0.0 < self.self_prompt_temperature < math.inf:
            raise ValueError(f"self_prompt_temperature must be > 0, got {self.self_prompt_temperature}")
        if not (self.corpus or self.prompts or self.self_prompts):
            raise ValueError("without the corpus, give prompts (--prompts) or self-written ones (--self-prompts)")
        if self.gen_batch_size < 1:
            raise ValueError(f"gen_batch_size must be >= 1, got {self.gen_batch_size}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.heldout_every < 2:
            raise ValueError("heldout_every must be >= 2 (some prompts must be trained on)")


@dataclass(slots=True)
class TrainResult:
    finished: bool  # all epochs done (False: the deadline stopped it; run again to resume)
    steps: int
    train_tokens: int
    heldout: "AcceptanceCounts"  # on every held-out greedy sample
    # corpus source (chat, docs, ...) -> its held-out samples' counts; empty when the prompts came
    # without sources
    by_source: dict[str, "AcceptanceCounts"] = field(default_factory=dict)

    @property
    def alpha_by_position(self) -> list[float]:
        return self.heldout.alphas

    @property
    def heldout_anchors(self) -> int:
        return self.heldout.den[0]


class _Collect:
    """A feature tap keeping the last forward's features."""

    def __init__(self, layers: tuple[int, ...]) -> None:
        self.feature_layers = layers
        self.features: torch.Tensor | None = None

    def record(self, chunks: list[SeqChunk], features: torch.Tensor) -> None:
        self.features = features

    def forget(self, seq_id: str) -> None:
        pass  # holds one forward's features, of no sequence in particular


def draft_vocabulary(samples: list[Sample], size: int, vocab_size: int, eos_ids: frozenset[int],
                     within: torch.Tensor | None = None) -> torch.Tensor:
    """The ``size`` most frequent output tokens (EOS always kept; ties and the remainder filled
    with the lowest ids), sorted; ``within`` (ids, e.g. a trained head's draft vocabulary): chosen
    among those only. # [Vd] int64"""
    allowed = range(vocab_size) if within is None else sorted(set(within.tolist()))
    allowed_set = set(allowed)
    size = min(size, len(allowed_set))
    counts = Counter(t for s in samples for t in s.output_ids if t in allowed_set)
    keep = [t for t in sorted(eos_ids) if t in allowed_set][:size]
    for t, _ in counts.most_common():
        if len(keep) >= size:
            break
        if t not in keep:
            keep.append(t)
    fill = iter(allowed)
    chosen = set(keep)
    while len(keep) < size:
        t = next(fill)
        if t not in chosen:
            keep.append(t)
            chosen.add(t)
    return torch.tensor(sorted(keep), dtype=torch.int64)


def pack_rows(samples: list[Sample], row_tokens: int) -> list[list[Sample]]:
    """Greedy packing of samples (each truncated to ``row_tokens``) into rows."""
    rows: list[list[Sample]] = []
    cur: list[Sample] = []
    used = 0
    for s in samples:
        n = min(len(s.token_ids), row_tokens)
        if cur and used + n > row_tokens:
            rows.append(cur)
            cur, used = [], 0
        cur.append(s)
        used += n
    if cur:
        rows.append(cur)
    return rows


@dataclass(slots=True)
class _Row:
    ids: torch.Tensor  # [T] int64
    doc: torch.Tensor  # [T] int64 sample number within the row
    pos: torch.Tensor  # [T] int64 position within its sample
    is_output: torch.Tensor  # [T] bool
    features: torch.Tensor  # [T, |layers| * H] float32
    target_logits: torch.Tensor  # [T, Vd] float32 target logits over the draft vocabulary


def target_row(runner: ModelRunner, samples: list[Sample], row_tokens: int, d2t: torch.Tensor,
               layers: tuple[int, ...]) -> _Row:
    """One target pass over a packed row: each sample is its own sequence in one ragged batch."""
    chunks, docs, poss, outs = [], [], [], []
    for j, s in enumerate(samples):
        ids = s.token_ids[:row_tokens]
        chunks.append(SeqChunk(f"row{j}", ids, 0, len(ids)))
        docs += [j] * len(ids)
        poss += list(range(len(ids)))
        outs += [i >= len(s.prompt_ids) for i in range(len(ids))]
    tap = _Collect(layers)
    runner.feature_tap = tap
    try:
        logits = runner.forward(chunks)  # [T, V] on the target's device
    finally:
        runner.feature_tap = None
        for c in chunks:
            runner.free(c.seq_id)
    dev = logits.device
    return _Row(torch.tensor([t for c in chunks for t in c.token_ids], device=dev), torch.tensor(docs, device=dev),
                torch.tensor(poss, device=dev), torch.tensor(outs, device=dev), tap.features.clone(),
                logits[:, d2t.to(dev)].clone())


def row_runner(model, row_tokens: int) -> ModelRunner:
    """A private runner over the target's weights with KV room for one packed row of
    ``row_tokens`` (16-token blocks, twice over, plus slack)."""
    bs = 16
    return ModelRunner(model, 2 * (-(-row_tokens // bs)) + 64, bs)


def ttt_unroll(head: EagleHead, embed: torch.Tensor, row: _Row, steps: int):
    """Yield (k, draft logits [T, Vd], valid [T] bool, src [T]) for k = 0..steps-1: at step k
    anchor t feeds token src = t+1+k, and counts (valid) when the token it predicts, t+2+k, is
    an output token of the same sample; the target's distribution for it is at row src."""
    T = row.ids.shape[0]
    idx = torch.arange(T, device=row.ids.device)
    same_doc = row.doc[:, None] == row.doc[None, :]
    mask0 = same_doc & (idx[None, :] <= idx[:, None])  # [T, T] step-0 keys: causal in the sample
    eye = torch.eye(T, dtype=torch.bool, device=row.ids.device)
    hidden = head.fuse(row.features)[None]  # [1, T, H]
    past_k = past_v = None
    for k in range(steps):
        src = (idx + 1 + k).clamp(max=T - 1)
        nxt = (idx + 2 + k).clamp(max=T - 1)
        valid = (idx + 2 + k < T) & (row.doc[nxt] == row.doc) & row.is_output[nxt]
        emb = embed[row.ids[src]].float()[None]  # [1, T, H]
        positions = (row.pos + 1 + k)[None]  # [1, T]
        mask = torch.cat([mask0] + [eye] * k, dim=1)[None, None]  # [1, 1, T, T * (k + 1)]
        out, nk, nv = head.layer(hidden, emb, positions, past_k, past_v, mask)
        yield k, head.draft_logits(out[0]), valid, src
        past_k = nk if past_k is None else torch.cat([past_k, nk], dim=2)
        past_v = nv if past_v is None else torch.cat([past_v, nv], dim=2)
        hidden = out


def ttt_loss(head: EagleHead, embed: torch.Tensor, row: _Row, cfg: TrainConfig) -> tuple[torch.Tensor, float]:
    """-> (weighted soft cross-entropy, step-0 top-1 agreement with the target on valid anchors)."""
    total = torch.zeros((), device=row.ids.device)
    acc0 = float("nan")
    for k, logits, valid, src in ttt_unroll(head, embed, row, cfg.ttt_steps):
        if not bool(valid.any()):
            continue
        p = torch.softmax(row.target_logits[src][valid], dim=-1)  # [n, Vd] target at row t+1+k
        logq = torch.log_softmax(logits[valid], dim=-1)
        total = total + (cfg.step_decay ** k) * -(p * logq).sum(-1).mean()
        if k == 0:
            acc0 = float((logits[valid].argmax(-1) == p.argmax(-1)).float().mean())
    return total, acc0


@dataclass(slots=True)
class AcceptanceCounts:
    """Correct drafts / drafts asked per draft position, counted twice: at every anchor, and at the
    anchors a greedy engine drafting chains of ``steps`` tokens starts its steps from (its first
    step after the prompt's last position; each next one after the accepted drafts and the
    target's own token). A step starts after a rejection or a bonus token, where drafting is
    harder than on average, so the second α is lower; it is what ``bench spec`` measures."""

    num: list[int]
    den: list[int]  # den[k]: anchors with drafts 1..k correct and draft k+1 inside a sample
    step_num: list[int]
    step_den: list[int]

    @classmethod
    def zeros(cls, steps: int) -> "AcceptanceCounts":
        return cls([0] * steps, [0] * steps, [0] * steps, [0] * steps)

    def add(self, other: "AcceptanceCounts") -> "AcceptanceCounts":
        pairs = zip((self.num, self.den, self.step_num, self.step_den),
                    (other.num, other.den, other.step_num, other.step_den))
        return AcceptanceCounts(*([a + b for a, b in zip(mine, theirs)] for mine, theirs in pairs))

    @property
    def alphas(self) -> list[float]:
        return _alphas(self.num, self.den)

    @property
    def step_alphas(self) -> list[float]:
        return _alphas(self.step_num, self.step_den)


@torch.no_grad()
def alpha_by_position(head: EagleHead, embed: torch.Tensor, rows: list[_Row], steps: int) -> tuple[list[float], int]:
    """Conditional acceptance per draft position on greedy samples -> (α_1..α_steps, anchors).
    Teacher forcing equals drafting on the anchors that count: while drafts 1..k-1 are correct,
    the tokens fed are the drafts themselves."""
    counts = acceptance_counts(head, embed, rows, steps)
    return counts.alphas, counts.den[0]


def _alphas(num: list[int], den: list[int]) -> list[float]:
    return [n / d if d else float("nan") for n, d in zip(num, den)]


@torch.no_grad()
def acceptance_counts(head: EagleHead, embed: torch.Tensor, rows: list[_Row], steps: int) -> AcceptanceCounts:
    """What ``alpha_by_position`` divides, at every anchor and at a greedy chain's steps, to pool."""
    out = AcceptanceCounts.zeros(steps)
    for row in rows:
        T = row.ids.shape[0]
        ok = torch.ones(T, dtype=torch.bool, device=row.ids.device)
        asked_k, ok_k = [], []
        for k, logits, valid, src in ttt_unroll(head, embed, row, steps):
            truth = row.ids[(src + 1).clamp(max=T - 1)]  # token t+2+k
            asked = ok & valid
            ok = asked & (head.draft_to_target[logits.argmax(-1)] == truth)
            out.den[k] += int(asked.sum())
            out.num[k] += int(ok.sum())
            asked_k.append(asked.tolist())
            ok_k.append(ok.tolist())
        for t in chain_step_anchors(row, asked_k[0], ok_k):
            for k in range(steps):
                out.step_den[k] += asked_k[k][t]
                out.step_num[k] += ok_k[k][t]
    return out


def chain_step_anchors(row: _Row, asked0: list[bool], ok_k: list[list[bool]]) -> list[int]:
    """The anchors (row positions) a greedy engine drafting chains of ``len(ok_k)`` tokens starts
    its steps from: per sample, the prompt's last position (its first output token comes from the
    prefill), then after each step the accepted drafts and one more (the target's token)."""
    out = []
    doc, is_output = row.doc.tolist(), row.is_output.tolist()
    first_output: dict[int, int] = {}
    for t, (d, o) in enumerate(zip(doc, is_output)):
        if o and d not in first_output:
            first_output[d] = t
    for first in first_output.values():
        t = first - 1
        while 0 <= t < len(asked0) and asked0[t]:
            out.append(t)
            accepted = 0
            while accepted < len(ok_k) and ok_k[accepted][t]:
                accepted += 1
            t += accepted + 1
    return out


class Trainer:
    """One train-draft run directory: data, checkpoint, head, log."""

    def __init__(self, out_dir: Path, model, eos_ids: frozenset[int], cfg: TrainConfig,
                 progress: Callable[[str], None] = print) -> None:
        self.out = Path(out_dir)
        self.model = model  # the target LlamaModel (frozen)
        self.eos_ids = eos_ids
        self.cfg = cfg
        self.progress = progress
        self.identity = target_identity(model)
        self.device = model.device  # where the target runs, and so the head: data, training, evaluation

    def _log(self, **row) -> None:
        with open(self.out / LOG, "a") as f:
            f.write(json.dumps(row) + "\n")

    def run(self, prompts: list[tuple[int, list[int]]], deadline: float,
            sources: dict[int, str] | None = None) -> TrainResult | None:
        """Data, then training, then evaluation (overall, and by ``sources``: prompt index -> its
        corpus source); None when the deadline stopped the data stage."""
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        ckpt = self._load_checkpoint()
        samples, complete = extend_samples(
            self.out / SAMPLES, self.model, prompts, token_budget=cfg.tokens, deadline=deadline,
            progress=self.progress, max_new_tokens=cfg.max_new_tokens, eos_ids=self.eos_ids,
            temperature=cfg.temperature, sample_odd=True, seed=cfg.seed, batch_size=cfg.gen_batch_size)
        if not complete:
            self.progress("data: stopped by --minutes; run the same command again to continue")
            return None
        if sources:
            mix = Counter(sources.get(s.index, "unlabelled") for s in samples)
            self.progress("data: samples by source: " + ", ".join(f"{n} {src}" for src, n in sorted(mix.items())))
        held_idx = {i for i, _ in prompts if i % cfg.heldout_every == 0}
        train = [s for s in samples if s.index not in held_idx]
        held = [s for s in samples if s.index in held_idx and s.greedy]
        if not train:
            raise InvalidRequestError("no training samples: raise --tokens or give more prompts")
        start = self._initial_head() if ckpt is None and cfg.init_from else None
        if start is not None and start.cfg.draft_vocab_size > cfg.draft_vocab_size:
            keep = draft_vocabulary(train, cfg.draft_vocab_size, self.model.arch.vocab_size, self.eos_ids,
                                    within=start.draft_to_target)
            start = trim_vocabulary(start, keep)
            self.progress(f"draft vocabulary trimmed to the {len(keep)} most frequent of the head's own tokens "
                          "in this run's outputs")
        if start is not None:
            d2t = start.draft_to_target.clone()
        else:
            d2t = (ckpt["draft_to_target"] if ckpt else
                   draft_vocabulary(train, cfg.draft_vocab_size, self.model.arch.vocab_size, self.eos_ids))
        if ckpt is not None:  # an older checkpoint has no feature_layers: the default ones
            layers = ckpt.get("feature_layers")
        else:
            layers = start.cfg.feature_layers if start is not None else None
        head = EagleHead(EagleConfig.for_target(self.model, len(d2t), tuple(layers) if layers else None))
        head.draft_to_target.copy_(d2t)
        if start is not None:  # fine-tune a trained head: its weights, a fresh optimizer and schedule
            head.load_state_dict(start.state_dict())
        elif ckpt is None:  # start from the target's own output rows of the draft vocabulary
            with torch.no_grad():
                head.lm_head.weight.copy_(self.model.lm_head.weight()[:, d2t.to(self.device)].t().float())
        head.to(self.device)
        opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        state = {"step": 0, "epoch": 0, "cursor": 0, "train_tokens": 0, "seconds": 0.0}
        if ckpt is not None:
            head.load_state_dict(ckpt["head"])
            opt.load_state_dict(ckpt["optimizer"])
            state.update(ckpt["state"])
            self.progress(f"resumed at step {state['step']} (epoch {state['epoch'] + 1}/{cfg.epochs})")
        finished = self._train(head, opt, train, d2t, state, deadline)
        save_head(head, self.out, extra={"training": {**asdict(cfg), **state, "finished": finished}})
        counts = self._evaluate(head, held, d2t, sources or {})
        pooled = AcceptanceCounts.zeros(cfg.ttt_steps)
        for c in counts.values():
            pooled = pooled.add(c)
        by_source = {src: c for src, c in sorted(counts.items()) if src}  # "": unlabelled
        self._log(event="eval", **_eval_fields(pooled), by_source={src: _eval_fields(c) for src, c in by_source.items()},
                  finished=finished, **state)
        return TrainResult(finished, state["step"], state["train_tokens"], pooled, by_source)

    def _initial_head(self) -> EagleHead:
        """The head ``init_from`` names: for this target (else EagleTargetMismatch), with at least
        the draft vocabulary size asked for (a larger one is trimmed once the data is known)."""
        start = load_head(Path(self.cfg.init_from), self.model)
        if start.cfg.draft_vocab_size < self.cfg.draft_vocab_size:
            raise InvalidRequestError(
                f"--init-from {self.cfg.init_from} has a draft vocabulary of {start.cfg.draft_vocab_size} tokens, "
                f"fewer than --draft-vocab {self.cfg.draft_vocab_size}; pass --draft-vocab "
                f"{start.cfg.draft_vocab_size} or less (a smaller one keeps the head's most frequent tokens)")
        self.progress(f"starting from the head in {self.cfg.init_from} (its weights and draft vocabulary)")
        return start

    def _runner(self) -> ModelRunner:
        return row_runner(self.model, self.cfg.row_tokens)

    def _train(self, head: EagleHead, opt, train: list[Sample], d2t: torch.Tensor, state: dict,
               deadline: float) -> bool:
        cfg = self.cfg
        runner = self._runner()
        embed = self.model.embed
        layers = head.cfg.feature_layers
        last_ckpt = t_start = time.monotonic()
        seconds0 = state["seconds"]
        while state["epoch"] < cfg.epochs:
            order = list(train)
            random.Random(cfg.seed + state["epoch"]).shuffle(order)
            rows = pack_rows(order, cfg.row_tokens)
            while state["cursor"] < len(rows):
                if time.monotonic() >= deadline:
                    state["seconds"] = seconds0 + time.monotonic() - t_start
                    self._save_checkpoint(head, opt, d2t, state)
                    self.progress("train: stopped by --minutes; run the same command again to resume")
                    return False
                row = target_row(runner, rows[state["cursor"]], cfg.row_tokens, d2t, layers)
                lr = learning_rate(cfg, state["step"], cfg.epochs * len(rows))
                for g in opt.param_groups:
                    g["lr"] = lr
                head.train()
                loss, acc0 = ttt_loss(head, embed, row, cfg)
                opt.zero_grad()
                if loss.requires_grad:
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
                    opt.step()
                state["step"] += 1
                state["cursor"] += 1
                state["train_tokens"] += int(row.ids.shape[0])
                elapsed = seconds0 + time.monotonic() - t_start
                if state["step"] % 10 == 0 or state["cursor"] == len(rows):
                    done = state["epoch"] * len(rows) + state["cursor"]
                    total = cfg.epochs * len(rows)
                    rate = state["train_tokens"] / max(elapsed, 1e-9)
                    eta = (total - done) * elapsed / max(done, 1)
                    self.progress(f"train: epoch {state['epoch'] + 1}/{cfg.epochs} row {state['cursor']}/{len(rows)} "
                                  f"step {state['step']} loss {loss.item():.3f} top1@1 {acc0:.2f} "
                                  f"{rate:.0f} tok/s elapsed {elapsed / 60:.1f} min eta {eta / 60:.1f} min")
                    self._log(event="step", step=state["step"], loss=loss.item(), top1=acc0, lr=lr,
                              tokens=state["train_tokens"], seconds=round(elapsed, 1))
                if time.monotonic() - last_ckpt >= cfg.checkpoint_every_s:
                    state["seconds"] = elapsed
                    self._save_checkpoint(head, opt, d2t, state)
                    last_ckpt = time.monotonic()
            state["epoch"] += 1
            state["cursor"] = 0
        state["seconds"] = seconds0 + time.monotonic() - t_start
        self._save_checkpoint(head, opt, d2t, state)
        return True

    def _evaluate(self, head: EagleHead, held: list[Sample], d2t: torch.Tensor,
                  sources: dict[int, str]) -> dict[str, AcceptanceCounts]:
        """source -> acceptance counts of its held-out samples (one group, "", without sources;
        a sample is its own sequence in a packed row, so grouping does not change its drafts)."""
        head.eval()
        runner = self._runner()
        groups: dict[str, list[Sample]] = {}
        for s in held:
            groups.setdefault(sources.get(s.index, ""), []).append(s)
        out = {}
        for src, samples in groups.items():
            rows = [target_row(runner, r, self.cfg.row_tokens, d2t, head.cfg.feature_layers)
                    for r in pack_rows(samples, self.cfg.row_tokens)]
            out[src] = acceptance_counts(head, self.model.embed, rows, self.cfg.ttt_steps)
        return out or {"": AcceptanceCounts.zeros(self.cfg.ttt_steps)}

    # -- checkpoints -------------------------------------------------------------------------------
    def _save_checkpoint(self, head: EagleHead, opt, d2t: torch.Tensor, state: dict) -> None:
        tmp = self.out / (CHECKPOINT + ".tmp")
        torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(), "draft_to_target": d2t,
                    "feature_layers": list(head.cfg.feature_layers),
                    "state": dict(state), "config": asdict(self.cfg), "target": asdict(self.identity)}, tmp)
        tmp.replace(self.out / CHECKPOINT)

    def _load_checkpoint(self) -> dict | None:
        path = self.out / CHECKPOINT
        if not path.is_file():
            return None
        ckpt = torch.load(path, weights_only=True, map_location="cpu")  # a run may resume on another device
        if ckpt["target"] != asdict(self.identity):
            raise EagleTargetMismatch(
                f"{self.out} holds a checkpoint for another target (fingerprint {ckpt['target']['fingerprint']}, "
                f"this one {self.identity.fingerprint}); use another --out")
        # more epochs: train a finished head further; another generation batch: the samples made are kept
        free = ("checkpoint_every_s", "epochs", "gen_batch_size")
        recipe = {k: v for k, v in ckpt["config"].items() if k not in free}
        mine = {k: v for k, v in asdict(self.cfg).items() if k not in free}
        defaults = asdict(TrainConfig())  # a key an older run lacks: the default, what it did before the option
        diff = sorted(k for k in mine if recipe.get(k, defaults[k]) != mine[k])
        if diff:
            raise InvalidRequestError(f"{self.out} was started with another recipe (differs in {diff}); "
                             "resume with the same options or use another --out")
        return ckpt


def _eval_fields(counts: AcceptanceCounts) -> dict:
    """The log's fields for one group of held-out samples (strict JSON: no NaN)."""
    strict = lambda xs: [None if math.isnan(a) else a for a in xs]  # noqa: E731
    return {"alpha_by_position": strict(counts.alphas), "anchors": counts.den[0],
            "step_alpha_by_position": strict(counts.step_alphas), "steps_counted": counts.step_den[0]}


def learning_rate(cfg: TrainConfig, step: int, total_steps: int) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio`` at
    ``total_steps`` (epochs x rows; raising ``--epochs`` on resume stretches the rest of the decay)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def expected_tokens_per_round(alphas: list[float]) -> float:
    """Committed tokens per verification with a chain of len(alphas) drafts: 1 + Σ_k Π_{j<=k} α_j."""
    total, run = 1.0, 1.0
    for a in alphas:
        if math.isnan(a):
            break
        run *= a
        total += run
    return total
