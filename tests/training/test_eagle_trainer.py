"""The EAGLE trainer's pieces: training-time test computes exactly what drafting computes at
inference (same anchors, same attention, same q), α by position is conditional, the draft
vocabulary keeps EOS and the most frequent output tokens, packing keeps samples whole."""
from __future__ import annotations

import pytest
import torch

from cluster.common.request import SamplingParams
from cluster.models.llama import LlamaModel
from cluster.models.runner import ModelRunner, SeqChunk
from cluster.speculative.eagle import EagleProposer
from cluster.speculative.eagle_head import EagleConfig, EagleHead
from cluster.speculative.types import ProposeInput
from cluster.training.eagle_trainer import (
    TrainConfig, draft_vocabulary, expected_tokens_per_round, learning_rate, pack_rows, target_row, ttt_loss,
    ttt_unroll,
)
from cluster.training.self_distill import Sample
from tests.conftest import make_tiny_model_dir


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("tiny4"), "llama", num_hidden_layers=4)
    return LlamaModel.load(path, torch.float32)


def random_head(model: LlamaModel, draft_vocab: int = 128, seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(EagleConfig.for_target(model, draft_vocab))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
        head.draft_to_target.copy_(torch.randperm(model.arch.vocab_size)[:draft_vocab].sort().values)
    return head.eval()


def test_training_time_test_equals_inference_drafting(target):
    """Sampled drafts with q: rebuild the sequence from those drafts, and TTT at that anchor
    gives the same q at every step; also after a catch-up that reuses persistent head K/V."""
    head = random_head(target)
    runner = ModelRunner(target, 64, 4)
    proposer = EagleProposer(head, runner)
    g = torch.Generator().manual_seed(3)
    committed = torch.randint(0, 512, (9,), generator=g).tolist()
    k = 3
    params = SamplingParams(temperature=1.0, max_tokens=64)
    runner.forward([SeqChunk("s", committed[:-1], 0, 1)])  # the target has run all but the last token
    for round_ in range(2):
        out = proposer.propose([ProposeInput("s", list(committed), k, params, torch.Generator().manual_seed(round_))])
        drafts, q = out.draft_token_ids[0], out.draft_probs[0]  # q [K, V]
        assert len(drafts) == k and q.shape == (k, 512)
        outside = torch.ones(512, dtype=torch.bool)
        outside[head.draft_to_target] = False
        assert float(q[:, outside].abs().sum()) == 0.0 and all(not outside[d] for d in drafts)
        seq = committed + drafts
        sample = Sample(0, seq[:2], seq[2:], True)
        row = target_row(ModelRunner(target, 64, 4), [sample], 64, head.draft_to_target, head.cfg.feature_layers)
        anchor = len(committed) - 2
        with torch.no_grad():
            for step, logits, _, _ in ttt_unroll(head, target.embed, row, k):
                want = torch.softmax(logits[anchor], dim=-1)
                torch.testing.assert_close(q[step, head.draft_to_target], want, atol=1e-5, rtol=1e-4)
        # verification accepted the first draft and added a bonus token: the target commits them
        bonus = int(torch.randint(0, 512, (1,), generator=g))
        runner.forward([SeqChunk("s", [committed[-1], drafts[0]], len(committed) - 1, 2)])
        drafted_from = len(committed)
        committed = committed + [drafts[0], bonus]
    assert proposer._seqs["s"].held == drafted_from - 1  # anchors 0..n-2 of the last round persist
    proposer.release("s")
    assert "s" not in proposer._seqs


def test_alpha_by_position_is_conditional(target, monkeypatch):
    """α_k counts only anchors whose drafts 1..k-1 were all correct (and still inside a sample)."""
    import cluster.training.eagle_trainer as trainer

    ids = torch.tensor([10, 11, 12, 13, 14, 15])
    row = trainer._Row(ids, torch.zeros(6, dtype=torch.int64), torch.arange(6), torch.ones(6, dtype=torch.bool),
                       torch.zeros(6, 1), torch.zeros(6, 1))
    head = random_head(target, draft_vocab=512)
    head.draft_to_target.copy_(torch.arange(512))
    wrong = 0
    predicted = {0: [12, 13, wrong, 15, wrong, wrong],  # anchors 0..3 valid: 3 of 4 correct
                 1: [13, wrong, 15, wrong, wrong, wrong]}  # anchors 0..2 valid; anchor 2 failed step 0

    def fake_unroll(head_, embed, row_, steps):
        idx = torch.arange(6)
        for k in range(steps):
            logits = torch.full((6, 512), -1.0)
            logits[idx, torch.tensor(predicted[k])] = 1.0
            yield k, logits, idx + 2 + k < 6, (idx + 1 + k).clamp(max=5)

    monkeypatch.setattr(trainer, "ttt_unroll", fake_unroll)
    alphas, anchors = trainer.alpha_by_position(head, target.embed, [row], 2)
    assert anchors == 4 and alphas == [0.75, 0.5]  # unconditional step-1 accuracy would be 2/3



def test_step_alpha_counts_the_anchors_a_greedy_engine_drafts_from(target, monkeypatch):
    """Two samples in a row (prompt 2 and 1 tokens): the engine's first step drafts from the
    prompt's last position, each next one after the accepted drafts and the target's token; α at
    those steps counts them only, α at every anchor counts all."""
    import cluster.training.eagle_trainer as trainer

    ids = torch.tensor([1, 2, 10, 11, 12, 13, 14, 15, 3, 20, 21, 22, 23])
    doc = torch.tensor([0] * 8 + [1] * 5)
    is_output = torch.tensor([False, False] + [True] * 6 + [False] + [True] * 4)
    row = trainer._Row(ids, doc, torch.zeros(13, dtype=torch.int64), is_output, torch.zeros(13, 1), torch.zeros(13, 1))
    head = random_head(target, draft_vocab=512)
    head.draft_to_target.copy_(torch.arange(512))
    T = 13
    truth = {k: [int(ids[min(t + 2 + k, T - 1)]) for t in range(T)] for k in range(2)}
    wrong = {(0, 4), (1, 1)}  # (step, anchor) pairs drafted wrong; every other draft is right

    def fake_unroll(head_, embed, row_, steps):
        idx = torch.arange(T)
        for k in range(steps):
            tokens = torch.tensor([0 if (k, t) in wrong else truth[k][t] for t in range(T)])
            logits = torch.full((T, 512), -1.0)
            logits[idx, tokens] = 1.0
            nxt = (idx + 2 + k).clamp(max=T - 1)
            valid = (idx + 2 + k < T) & (doc[nxt] == doc) & is_output[nxt]
            yield k, logits, valid, (idx + 1 + k).clamp(max=T - 1)

    monkeypatch.setattr(trainer, "ttt_unroll", fake_unroll)
    counts = trainer.acceptance_counts(head, target.embed, [row], 2)
    # every anchor: step 1 asked at 0-5 and 8-10 (its token inside the sample), wrong at 4; step 2
    # asked where step 1 was right and its token is inside: 0-3, 8, 9, wrong at 1
    assert (counts.den, counts.num) == ([9, 6], [8, 5]) and counts.alphas == [8 / 9, 5 / 6]
    # the steps: sample 0 starts at 1 (its prompt's last position; 1 accepted) -> 3 (2 accepted)
    # -> 6, whose draft would be past the sample's end; sample 1 starts at 8 (2 accepted) -> 11, past
    assert (counts.step_den, counts.step_num) == ([3, 3], [3, 2]) and counts.step_alphas == [1.0, 2 / 3]
    asked0 = [t in (0, 1, 2, 3, 4, 5, 8, 9, 10) for t in range(T)]
    ok = [[t in (0, 1, 2, 3, 5, 8, 9, 10) for t in range(T)], [t in (0, 2, 3, 8, 9) for t in range(T)]]
    assert trainer.chain_step_anchors(row, asked0, ok) == [1, 3, 8]
    ok[0][3] = False  # a rejected first draft: the next step starts one position on
    assert trainer.chain_step_anchors(row, asked0, ok) == [1, 3, 4, 5, 8]  # 4 rejects its first too

def test_ttt_loss_trains_and_masks_prompts(target):
    head = random_head(target)
    runner = ModelRunner(target, 64, 4)
    cfg = TrainConfig(ttt_steps=2, row_tokens=32)
    samples = [Sample(0, [1, 2, 3], [4, 5, 6, 7, 8], True), Sample(1, [9, 10], [11, 12, 13], False)]
    row = target_row(runner, samples, 32, head.draft_to_target, head.cfg.feature_layers)
    assert row.ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    valid0 = next(ttt_unroll(head, target.embed, row, 1))[2]
    # anchor t counts when token t+2 is an output token of the same sample
    assert valid0.tolist() == [False, True, True, True, True, True, False, False, True, True, True, False, False]
    head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    first = None
    for _ in range(15):
        loss, _ = ttt_loss(head, target.embed, row, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
    assert loss.item() < first


def test_draft_vocabulary_and_packing():
    samples = [Sample(i, [1] * 3, [5, 5, 9, 2], True) for i in range(3)]
    d2t = draft_vocabulary(samples, 4, 100, frozenset({2, 99}))
    assert d2t.tolist() == sorted(d2t.tolist()) and {2, 99, 5, 9} == set(d2t.tolist())
    assert draft_vocabulary(samples, 6, 100, frozenset({2})).tolist() == [0, 1, 2, 3, 5, 9]
    # within a trained head's vocabulary: its most frequent tokens there, EOS kept, filled from it
    within = torch.tensor([2, 7, 9, 40, 41])
    assert draft_vocabulary(samples, 2, 100, frozenset({2}), within=within).tolist() == [2, 9]
    assert draft_vocabulary(samples, 4, 100, frozenset({2, 99}), within=within).tolist() == [2, 7, 9, 40]
    assert draft_vocabulary(samples, 10, 100, frozenset({2}), within=within).tolist() == [2, 7, 9, 40, 41]
    rows = pack_rows([Sample(i, [1] * 4, [2] * n, True) for i, n in enumerate([2, 3, 20, 1])], 10)
    assert [[s.index for s in r] for r in rows] == [[0], [1], [2], [3]]
    assert [[s.index for s in r] for r in pack_rows([Sample(i, [1], [2], True) for i in range(5)], 4)] == [[0, 1], [2, 3], [4]]
    assert expected_tokens_per_round([0.5, 0.5]) == 1.75


def test_learning_rate_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [learning_rate(cfg, step, 110) for step in range(111)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))  # warm-up rises
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # then decays
    assert lrs[60] == pytest.approx(0.55e-3) and lrs[110] == pytest.approx(1e-4)
    assert learning_rate(cfg, 500, 110) == pytest.approx(1e-4)  # past the end: the floor
    with pytest.raises(ValueError, match="min_lr_ratio"):
        TrainConfig(min_lr_ratio=1.5)


def test_the_engine_drafts_as_well_as_train_draft_evaluates(default_model):
    """The α train-draft prints is what the engine gets: the shipped head on corpus prompts (never
    a workload's), α at draft position 1 through the engine (paged KV, native kernels, the head's
    bfloat16 rounds, catch-up between steps) against train-draft's teacher-forced evaluation of
    the same greedy outputs at the anchors the engine drafts from (its steps start after a
    rejection or a bonus token, harder than the average anchor: 0.515 there, equal to the engine's,
    against 0.570 at every anchor here). Features one position off, or a head fed the wrong
    layers, draft at α ≈ 0.05."""
    from cluster.bench.timed_run import engine_for, request_for, run_ours
    from cluster.common.config import SpecConfig
    from cluster.engine.drafters import SHIPPED_EAGLE_HEAD
    from cluster.models.tokenizer import chat_token_ids
    from cluster.speculative.eagle_head import load_head
    from cluster.training.eagle_trainer import acceptance_counts
    from cluster.training.prompt_corpus import build_prompts

    from tests.reference import WORKLOADS

    texts = build_prompts(WORKLOADS, limit=60)[::10]  # 6 corpus prompts of its four sources, none a workload's
    prompts = [chat_token_ids(default_model.tokenizer, [{"role": "user", "content": t}]) for t in texts]
    plain, spec = engine_for(default_model), engine_for(default_model, SpecConfig(drafter="eagle", num_draft_tokens=3))
    accepted = drafted = 0
    samples = []
    for i, ids in enumerate(prompts):
        run = run_ours(spec, request_for(f"s{i}", ids, 64, "chat"))
        accepted, drafted = accepted + run.accepted_per_position[0], drafted + run.drafted_per_position[0]
        reference = run_ours(plain, request_for(f"p{i}", ids, 64, "chat"))
        assert run.ids == reference.ids
        samples.append(Sample(i, list(ids), [t for t in reference.ids if t not in default_model.eos_token_ids], True))
    model = default_model.runner.model
    head = load_head(SHIPPED_EAGLE_HEAD, model).eval()
    runner = ModelRunner(model, 2 * (512 // 16) + 64, 16)
    rows = [target_row(runner, r, 512, head.draft_to_target, head.cfg.feature_layers) for r in pack_rows(samples, 512)]
    counts = acceptance_counts(head, model.embed, rows, 3)
    evaluated, at_steps, engine_alpha = counts.alphas[0], counts.step_alphas[0], accepted / drafted
    print(f"α at draft position 1: engine {engine_alpha:.3f} ({drafted} drafts), train-draft at the engine's steps "
          f"{at_steps:.3f} ({counts.step_den[0]}), at every anchor {evaluated:.3f} ({counts.den[0]})")
    assert drafted >= 60 and counts.den[0] >= 200
    assert evaluated > 0.4 and engine_alpha > 0.3, (engine_alpha, evaluated)
    # the same steps (the engine drafts at an EOS too, which the samples leave out), the same α
    # up to a near-tie or two between the engine's kernels and the training forward
    assert abs(counts.step_den[0] - drafted) <= len(samples) + 2, (counts.step_den[0], drafted)
    assert abs(at_steps - engine_alpha) <= 0.03, (engine_alpha, at_steps)
