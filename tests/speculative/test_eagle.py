"""The eagle drafter through the engine on a tiny model: greedy output equals plain decoding and
HF generate (ragged batch, some sequences without speculation in the same steps), sampled and
seeded requests verify their q without fallbacks, all draft state is freed; the drafter choice
is parsed, accepted in both placements (separate: tests/kvsync/test_drafters.py) and refused
where it cannot run (no head, another target)."""
from __future__ import annotations

import pytest
import torch

from cluster.common.config import EngineConfig, SpecConfig
from cluster.common.request import GenerationRequest, SamplingParams, SpecMode
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.speculation import build_spec_controller
from cluster.models.load import load_model
from cluster.speculative.eagle import EagleProposer
from cluster.speculative.eagle_head import EagleConfig, EagleHead, EagleTargetMismatch, save_head
from cluster.speculative.proposer import DrafterChoice, DrafterKind, parse_drafter_choice
from tests.conftest import make_tiny_model_dir
from tests.engine.helpers import _collect, run_to_completion
from tests.reference import HFReference, check_greedy_match

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-eagle"), "llama", tokenizer_dir=default_model_dir,
                               num_hidden_layers=4)
    return path, load_model(str(path), EngineConfig(model=str(path)))


@pytest.fixture(scope="module")
def head_dir(tiny, tmp_path_factory):
    """An untrained head (random weights, random draft vocabulary): losslessness cannot depend
    on the drafts being good."""
    _, model = tiny
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(model.runner.model, 96))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
        head.draft_to_target.copy_(torch.randperm(model.runner.vocab_size)[:96].sort().values)
    out = tmp_path_factory.mktemp("head")
    save_head(head, out)
    return out


def engine(model, drafter: str | None, k=3, num_blocks: int | None = None, prefix_caching: bool = True,
           proposer=None, **cfg) -> LLMEngine:
    """A tiny-model engine (own KV pool); with ``proposer``, the drafter's proposer given (a DraftServer's client)."""
    spec = SpecConfig(drafter=drafter, num_draft_tokens=k) if drafter else None
    config = EngineConfig(model="tiny", spec=spec, max_num_seqs=8, prefix_caching=prefix_caching, **cfg)
    m = model.with_fresh_kv(config, num_blocks)
    return LLMEngine(config, m, build_spec_controller(config, m, proposer) if spec else None)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (3, 17, 8, 30, 1, 12)]


def requests(params_for) -> list[GenerationRequest]:
    reqs = [GenerationRequest(f"r{i}", p, params_for(i)) for i, p in enumerate(prompts())]
    for r in reqs[::3]:  # decode plainly in the same steps (K = 0 rows)
        r.mode = SpecMode.PLAIN
    return reqs


@pytest.mark.parametrize("k", [3, "auto"])
def test_greedy_with_eagle_equals_plain_and_hf(tiny, head_dir, k):
    path, model = tiny
    params = lambda i: SamplingParams(max_tokens=MAX_TOKENS)  # noqa: E731
    plain = run_to_completion(engine(model, None), requests(params))
    eng = engine(model, f"eagle:{head_dir}", k)
    assert isinstance(eng.spec.proposer, EagleProposer)
    got = run_to_completion(eng, requests(params))
    for rid in plain:
        assert got[rid]["ids"] == plain[rid]["ids"], rid
    ref = HFReference(path, model.eos_token_ids)
    for i, p in enumerate(prompts()):
        check_greedy_match(got[f"r{i}"]["ids"], ref.greedy(p, MAX_TOKENS))  # equal, or a reference near-tie
    drafted = sum(got[r]["spec"].draft_tokens for r in got if got[r]["spec"] is not None)
    assert drafted > 0
    assert eng.spec.draft_fallbacks == 0
    assert not eng.spec.proposer._seqs  # every sequence's features and head K/V released
    assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks


def test_preempted_sequences_draft_again_from_fresh_features(tiny, head_dir):
    """A tiny KV pool preempts sequences (their features and head K/V released, recorded again
    by the re-prefill): output still equals plain decoding."""
    _, model = tiny
    params = lambda i: SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)  # noqa: E731
    plain = run_to_completion(engine(model, None), requests(params))
    longest = max(len(p) for p in prompts()) + MAX_TOKENS
    blocks = -(-longest // 16) + 2  # the longest fits alone, two together barely
    eng = engine(model, f"eagle:{head_dir}", 3, num_blocks=blocks)
    got = run_to_completion(eng, requests(params))
    assert eng.scheduler.num_preemptions > 0
    for rid in plain:
        assert got[rid]["ids"] == plain[rid]["ids"], rid
    assert sum(got[r]["spec"].draft_tokens for r in got if got[r]["spec"] is not None) > 0
    assert not eng.spec.proposer._seqs


def test_sampled_and_seeded_requests_verify_their_q(tiny, head_dir):
    _, model = tiny
    eng = engine(model, f"eagle:{head_dir}", 3)
    params = lambda i: SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_k=50,  # noqa: E731
                                      seed=i if i % 2 else None, ignore_eos=True)
    got = run_to_completion(eng, requests(params))
    assert all(len(got[r]["ids"]) == MAX_TOKENS for r in got)
    assert sum(got[r]["spec"].draft_tokens for r in got if got[r]["spec"] is not None) > 0
    assert eng.spec.draft_fallbacks == 0  # every q was [K, V], finite, non-negative
    seeded = run_to_completion(engine(model, None), [r for r in requests(params) if r.params.seed is not None])
    for rid, res in seeded.items():  # seeded sampling: same tokens with and without drafts
        assert got[rid]["ids"] == res["ids"], rid


def test_drafter_choice_is_parsed_and_refused_where_it_cannot_run(tiny, head_dir, tmp_path, monkeypatch):
    assert parse_drafter_choice(f"eagle:{head_dir}").kind is DrafterKind.EAGLE
    monkeypatch.setattr("cluster.speculative.proposer.SHIPPED_EAGLE_HEAD", head_dir)
    assert parse_drafter_choice("eagle") == DrafterChoice(DrafterKind.EAGLE, model=str(head_dir))
    monkeypatch.setattr("cluster.speculative.proposer.SHIPPED_EAGLE_HEAD", tmp_path / "none")
    with pytest.raises(ValueError, match="shipped head .* is missing"):
        parse_drafter_choice("eagle")
    with pytest.raises(ValueError, match="eagle:DIR"):
        parse_drafter_choice("eagle:")
    from deployments.app_config import AppConfig

    for placement in ("shared", "separate"):  # separate: the DraftServer hosts the head
        assert AppConfig(drafter=f"eagle:{head_dir}", placement=placement).drafter.startswith("eagle:")
    other_path = make_tiny_model_dir(tmp_path / "other", "llama", tokenizer_dir=tiny[0], num_hidden_layers=3)
    other = load_model(str(other_path), EngineConfig(model=str(other_path)))
    with pytest.raises(EagleTargetMismatch, match="trained for another target"):
        engine(other, f"eagle:{head_dir}")
    with pytest.raises(Exception, match="not an EAGLE head directory"):
        engine(tiny[1], f"eagle:{tmp_path}")


def test_portfolio_holds_the_eagle_head_trained_for_its_target(tiny, head_dir, tmp_path, monkeypatch):
    """``portfolio`` adds the shipped head as member ``eagle`` when it was trained for the target
    (here a head for the tiny model stands in for the shipped one): it drafts for some steps, the
    output equals plain decoding, its state is freed; another target's portfolio leaves it out."""
    monkeypatch.setattr("cluster.engine.drafters.SHIPPED_EAGLE_HEAD", head_dir)
    _, model = tiny
    params = lambda i: SamplingParams(max_tokens=MAX_TOKENS)  # noqa: E731
    plain = run_to_completion(engine(model, None), requests(params))
    eng = engine(model, "portfolio", "auto")
    members = {m.name: m for m in eng.spec.proposer.members}
    assert list(members) == ["ngram", "suffix", "eagle"]
    assert isinstance(members["eagle"].proposer, EagleProposer) and 0 < members["eagle"].cost < 1
    got = run_to_completion(eng, requests(params))
    for rid in plain:
        assert got[rid]["ids"] == plain[rid]["ids"], rid
    assert eng.spec.proposer.drafter_stats()["eagle"]["steps"] > 0
    assert not members["eagle"].proposer._seqs
    other_path = make_tiny_model_dir(tmp_path / "other", "llama", tokenizer_dir=tiny[0], num_hidden_layers=3)
    other = load_model(str(other_path), EngineConfig(model=str(other_path)))
    assert [m.name for m in engine(other, "portfolio", "auto").spec.proposer.members] == ["ngram", "suffix"]


def test_portfolio_dir_holds_the_head_in_dir_and_refuses_one_for_another_target(tiny, head_dir, tmp_path):
    """``portfolio:DIR``: the head in DIR is the portfolio's ``eagle`` member (no shipped head for
    this target), drafts for some steps, output equals plain; a segment naming ``eagle:DIR`` beside
    it shares that head (one per target runner); a head for another target, an empty DIR and
    placement ``separate`` (whose DraftServer's portfolio is model-free) are refused."""
    from deployments.app_config import AppConfig

    _, model = tiny
    assert parse_drafter_choice(f"portfolio:{head_dir}") == DrafterChoice(DrafterKind.PORTFOLIO, model=str(head_dir))
    with pytest.raises(ValueError, match="portfolio:DIR"):
        parse_drafter_choice("portfolio: ")
    params = lambda i: SamplingParams(max_tokens=MAX_TOKENS)  # noqa: E731
    plain = run_to_completion(engine(model, None), requests(params))
    eng = engine(model, f"portfolio:{head_dir}", "auto")
    members = {m.name: m for m in eng.spec.proposer.members}
    assert list(members) == ["ngram", "suffix", "eagle"] and isinstance(members["eagle"].proposer, EagleProposer)
    assert 0 < members["eagle"].cost < 1
    got = run_to_completion(eng, requests(params))
    for rid in plain:
        assert got[rid]["ids"] == plain[rid]["ids"], rid
    assert eng.spec.proposer.drafter_stats()["eagle"]["steps"] > 0

    config = EngineConfig(model="tiny", spec=SpecConfig(drafter=f"portfolio:{head_dir}", num_draft_tokens="auto",
                                                        segments={"chat": {"drafter": f"eagle:{head_dir}"}}))
    m = model.with_fresh_kv(config, 64)
    union = build_spec_controller(config, m).proposer
    assert [mm.name for mm in union.members] == ["ngram", "suffix", f"eagle:{head_dir}"]
    assert union.routes.candidates("chat") == (f"eagle:{head_dir}",)
    assert m.runner.feature_tap is union.members[2].proposer

    other_path = make_tiny_model_dir(tmp_path / "other", "llama", tokenizer_dir=tiny[0], num_hidden_layers=3)
    other = load_model(str(other_path), EngineConfig(model=str(other_path)))
    with pytest.raises(EagleTargetMismatch, match="trained for another target"):
        engine(other, f"portfolio:{head_dir}", "auto")
    assert AppConfig(drafter=f"portfolio:{head_dir}").drafter.startswith("portfolio:")
    with pytest.raises(ValueError, match="placement 'separate' serves the model-free 'portfolio'"):
        AppConfig(drafter=f"portfolio:{head_dir}", placement="separate")


def test_sampled_drafts_follow_the_returned_q(tiny, head_dir):
    """Draft tokens of a sampling request are draws from the q the drafter returns (chi-square over
    q's support), q is the same on every call for the same committed tokens, and zero outside the
    head's draft vocabulary."""
    from scipy.stats import chisquare

    from cluster.models.runner import SeqChunk
    from cluster.speculative.types import ProposeInput

    _, model = tiny
    m = model.with_fresh_kv(EngineConfig(model="tiny"))
    proposer = EagleProposer.from_dir(head_dir, m.runner)
    ids = prompts()[3]
    m.runner.forward([SeqChunk("s", ids[:-1], 0, 1)])
    params = SamplingParams(temperature=3.0, top_k=4, max_tokens=8)
    gen = torch.Generator().manual_seed(0)
    counts: dict[int, int] = {}
    q0 = None
    n = 600
    for _ in range(n):
        out = proposer.propose([ProposeInput("s", ids, 1, params, gen)])
        tok, q = out.draft_token_ids[0][0], out.draft_probs[0][0]  # q [V]
        q0 = q if q0 is None else q0
        torch.testing.assert_close(q, q0)
        counts[tok] = counts.get(tok, 0) + 1
    support = q0.nonzero().flatten().tolist()
    assert len(support) == 4 and set(counts) <= set(support)
    assert set(support) <= set(proposer.head.draft_to_target.tolist())
    observed = [counts.get(t, 0) for t in support]
    mass = sum(float(q0[t]) for t in support)  # 1 up to float32 rounding
    expected = [float(q0[t]) / mass * n for t in support]
    assert min(expected) > 20, expected  # the test has power on every category
    assert chisquare(observed, expected).pvalue > 1e-3, (observed, expected)


@pytest.mark.parametrize("max_raw_rows", [1, 4, 10**6])
def test_recorded_features_are_fused_later_exactly_as_when_each_forward_ran(tiny, head_dir, max_raw_rows):
    """Features are fused in batches (before a propose, or once max_raw_rows are held raw): every
    position ends up with the fused row of the last forward that wrote it (a verification's
    rejected positions are rewritten), a growing sequence keeps its earlier rows, and a released
    sequence's pending rows never land in a new sequence of the same id — nor are they fused."""
    from cluster.models.runner import SeqChunk

    _, model = tiny
    runner = model.with_fresh_kv(EngineConfig(model="tiny")).runner
    prop = EagleProposer.from_dir(head_dir, runner)
    prop.max_raw_rows = max_raw_rows
    fuse, fused_rows = prop.head.fuse, []
    prop.head.fuse = lambda x: fused_rows.append(x.shape[0]) or fuse(x)
    g = torch.Generator().manual_seed(3)
    expected: dict[str, dict[int, torch.Tensor]] = {}
    forwards = [
        [SeqChunk("a", [1] * 5, 0, 1), SeqChunk("b", [2] * 3, 0, 1)],  # prefills
        [SeqChunk("a", [1] * 4, 5, 4)],  # a verification: positions 5..8
        [SeqChunk("a", [3] * 2, 6, 2), SeqChunk("b", [2] * 70, 3, 1)],  # a rewrites 6, 7; b grows past 64
        "release b",
        [SeqChunk("b", [4] * 6, 0, 1)],  # a new sequence under the old id
        [SeqChunk("a", [5], 8, 1)],
    ]
    for fwd in forwards:
        if fwd == "release b":
            prop.release("b")
            expected.pop("b")
            continue
        feats = torch.randn(sum(len(c.token_ids) for c in fwd), prop.feature_width, generator=g)
        with torch.inference_mode():
            fused = fuse(feats)
        row = 0
        for c in fwd:
            for i in range(len(c.token_ids)):
                expected.setdefault(c.seq_id, {})[c.start_pos + i] = fused[row + i]
            row += len(c.token_ids)
        prop.record(fwd, feats)
        assert prop._pending_rows < max_raw_rows  # held raw only up to max_raw_rows
    prop.propose([])  # a propose fuses what is pending
    assert prop._pending_rows == 0
    if max_raw_rows == 10**6:  # all fused at the propose: the released b's 73 rows were dropped raw
        assert fused_rows == [5 + 4 + 2 + 6 + 1]
    for seq_id, rows in expected.items():
        st = prop._seqs[seq_id]
        assert st.filled == max(rows) + 1
        for pos, want in rows.items():
            torch.testing.assert_close(st.feats[pos], want, rtol=1e-5, atol=1e-5, msg=f"{seq_id} position {pos}")


def test_the_head_tells_how_far_behind_it_is_and_what_it_caught_up(tiny, head_dir):
    """``positions_behind`` is what the next propose feeds before drafting (all but the last
    token at first, then the positions committed since the last draft, a rolled-back suffix
    again), ``last_caught_up`` what the last propose fed; the engine hands both to adaptive K
    (a CatchUpProposer; a portfolio prices its members itself)."""
    from cluster.models.runner import SeqChunk
    from cluster.speculative.proposer import CatchUpProposer
    from cluster.speculative.types import ProposeInput

    _, model = tiny
    m = model.with_fresh_kv(EngineConfig(model="tiny"))
    prop = EagleProposer.from_dir(head_dir, m.runner)
    assert isinstance(prop, CatchUpProposer)
    ids = prompts()[3]  # 30 tokens
    m.runner.forward([SeqChunk("s", ids, 0, 1)])
    params = SamplingParams(max_tokens=8)
    assert prop.positions_behind("s", ids) == 29 and prop.positions_behind("unknown", ids[:5]) == 4
    drafts = prop.propose([ProposeInput("s", ids + [7], 2, params)]).draft_token_ids[0]
    assert prop.last_caught_up == 30 and len(drafts) == 2
    grown = ids + [7, 8, 9]
    m.runner.forward([SeqChunk("s", [7, 8], 30, 1)])
    assert prop.positions_behind("s", grown) == 2  # drafted at 31 tokens, 33 now
    assert prop.positions_behind("s", ids[:10] + [1, 2]) == 2  # diverged after 10 tokens: back to 9 anchors
    prop.propose([ProposeInput("s", grown, 1, params)])
    assert prop.last_caught_up == 2
    prop.propose([ProposeInput("s", grown, 0, params)])  # nothing asked: nothing fed
    assert prop.last_caught_up == 0
    config = EngineConfig(model="tiny", spec=SpecConfig(drafter=f"eagle:{head_dir}", num_draft_tokens="auto"))
    fresh = model.with_fresh_kv(config)
    assert build_spec_controller(config, fresh)._catch_up is not None


def _drafts_from_scratch(prop: EagleProposer, seq_id: str, token_ids: list[int], k: int) -> list[int]:
    """Greedy drafts recomputed with nothing kept: every pair (feature t, token t + 1) of the
    sequence through the head at once (causal), then k - 1 draft steps over all of their K/V."""
    head, n = prop.head, len(token_ids)
    feats = prop._seqs[seq_id].feats[: n - 1].unsqueeze(0)  # [1, n-1, H] fused target features
    tokens = torch.tensor([token_ids[1:]])
    positions = torch.arange(1, n).unsqueeze(0)
    mask = torch.ones(n - 1, n - 1, dtype=torch.bool).tril().view(1, 1, n - 1, n - 1)
    with torch.inference_mode():
        out, keys, values = head.layer(feats, prop.embed[tokens].float(), positions, None, None, mask)
        hidden, drafts = out[:, -1:], []
        for step in range(k):
            t = int(head.to_target_logits(head.draft_logits(hidden[:, 0])).argmax(-1))
            drafts.append(t)
            emb = prop.embed[torch.tensor([[t]])].float()
            hidden, nk, nv = head.layer(hidden, emb, torch.tensor([[n + step]]), keys, values, None)
            keys, values = torch.cat([keys, nk], dim=2), torch.cat([values, nv], dim=2)
    return drafts


def test_drafts_equal_a_head_run_from_scratch_as_sequences_grow_roll_back_and_batch(tiny, head_dir):
    """What the drafter keeps between proposes (its K/V buffers, rolled back to the tokens still
    committed; each draft round's K/V written after them and dropped) changes nothing: alone
    or in a ragged batch, after growth and after a rollback, every greedy draft equals the head
    run from scratch over the whole sequence (lossless tests cannot see this: a wrong draft is
    only rejected)."""
    from cluster.models.runner import SeqChunk
    from cluster.speculative.types import ProposeInput

    _, model = tiny
    m = model.with_fresh_kv(EngineConfig(model="tiny"))
    prop = EagleProposer.from_dir(head_dir, m.runner)
    params = SamplingParams(max_tokens=8)
    g = torch.Generator().manual_seed(11)
    seqs = {"a": torch.randint(0, 49152, (90,), generator=g).tolist(),  # past the buffers' first 64 rows
            "b": torch.randint(0, 49152, (9,), generator=g).tolist()}
    m.runner.forward([SeqChunk(s, ids, 0, 1) for s, ids in seqs.items()])

    def check(batch: dict[str, tuple[list[int], int]]) -> None:
        got = prop.propose([ProposeInput(s, ids, k, params) for s, (ids, k) in batch.items()]).draft_token_ids
        for (s, (ids, k)), drafts in zip(batch.items(), got):
            assert list(drafts) == _drafts_from_scratch(prop, s, ids, k), s

    check({"a": (seqs["a"][:40], 3)})  # alone: catches up 39 pairs, then drafts
    check({"a": (seqs["a"][:44], 2), "b": (seqs["b"], 4)})  # ragged batch: a 4 pairs behind, b 8
    check({"a": (seqs["a"][:30] + [5, 6], 3)})  # rolled back to 30 tokens, two new ones
    check({"a": (seqs["a"], 1), "b": (seqs["b"][:6], 3)})  # a grows past 64 anchors; b rolls back
    check({"b": (seqs["b"], 2)})


def test_prefix_blocks_keep_their_features_for_the_sequences_that_share_them(tiny, head_dir):
    """Under prefix caching the target never runs a shared prefix, so its features come from the
    blocks' kept ones: equal to those the sequence that computed them recorded, for the leading
    blocks kept under the same prefix key (a block re-indexed for another prefix is not one),
    outliving that sequence; the shared sequence's own forwards extend them."""
    from cluster.models.runner import SeqChunk

    _, model = tiny
    runner = model.with_fresh_kv(EngineConfig(model="tiny")).runner
    runner.kv.enable_prefix_caching()
    prop = EagleProposer.from_dir(head_dir, runner)
    bs = runner.kv.block_size
    a = prompts()[3] + prompts()[1]  # 47 tokens: two full blocks
    runner.forward([SeqChunk("a", a, 0, 1)])
    indexed = runner.kv.cache_prefix("a", a, len(a))
    assert [(b.start, b.end) for b in indexed] == [(0, bs), (bs, 2 * bs)]
    prop.keep_prefix("a", indexed)
    want = prop._seqs["a"].feats[: 2 * bs].clone()
    prop.release("a")
    runner.kv.free("a")
    b = a[: 2 * bs] + [5, 6, 7]
    assert runner.kv.match_prefix("b", b) == 2 * bs
    assert prop.adopt_prefix("b", runner.kv.prefix_blocks("b")) == 2
    st = prop._seqs["b"]
    assert st.filled == 2 * bs and torch.equal(st.feats[: 2 * bs], want)
    runner.forward([SeqChunk("b", b[2 * bs :], 2 * bs, 1)])
    prop.propose([])  # fuses what is pending
    assert prop._seqs["b"].filled == len(b)
    # a block kept under another key (its K/V reused for another prefix) is not handed out
    blocks = runner.kv.prefix_blocks("b")
    stale = [blocks[0], type(blocks[1])(blocks[1].block, b"another prefix", bs, 2 * bs)]
    assert prop.adopt_prefix("c", stale) == 1 and prop._seqs["c"].filled == bs
    assert prop.adopt_prefix("c", stale[1:]) == 0 and "c" not in prop._seqs


def test_a_continued_conversation_shares_its_prefix_under_eagle_and_changes_no_token(tiny, head_dir):
    """A request that continues an earlier one prefills only what is new (its prefix's blocks and
    their features come from the cache), drafts with the head, and decodes exactly what an engine
    without prefix caching and Hugging Face generate do."""
    path, model = tiny
    first = GenerationRequest("first", prompts()[3] + prompts()[1], SamplingParams(max_tokens=MAX_TOKENS))
    eng = engine(model, f"eagle:{head_dir}", 3)
    done = run_to_completion(eng, [first])
    continued = first.prompt_token_ids + done["first"]["ids"] + prompts()[2]
    later = [GenerationRequest("continued", continued, SamplingParams(max_tokens=MAX_TOKENS)),
             GenerationRequest("other", first.prompt_token_ids[:20] + prompts()[0], SamplingParams(max_tokens=MAX_TOKENS))]
    got = run_to_completion(eng, later)
    bs = eng.runner.kv.block_size
    assert got["continued"]["cached"] == (len(first.prompt_token_ids) + len(done["first"]["ids"]) - 1) // bs * bs > 0
    assert got["other"]["cached"] == bs
    assert got["continued"]["spec"].draft_tokens > 0
    plain = run_to_completion(engine(model, f"eagle:{head_dir}", 3, prefix_caching=False), later)
    ref = HFReference(path, model.eos_token_ids)
    for r in later:
        assert plain[r.request_id]["cached"] == 0
        assert got[r.request_id]["ids"] == plain[r.request_id]["ids"], r.request_id
        check_greedy_match(got[r.request_id]["ids"], ref.greedy(r.prompt_token_ids, MAX_TOKENS))
    assert not eng.spec.proposer._seqs and eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks


def test_requests_admitted_in_one_step_borrow_the_features_of_the_prefix_it_writes(tiny, head_dir):
    """Requests added together share a prefix in the step that writes it: the first prefills it,
    the others take its blocks at once and their features from its rows of the same forward (no
    gap, so the head drafts for them), and every output is what an engine without prefix caching
    and Hugging Face generate decode."""
    path, model = tiny
    prefix = prompts()[3] + prompts()[1]  # 47 tokens: two full blocks
    together = [GenerationRequest(f"r{i}", prefix + prompts()[j], SamplingParams(max_tokens=MAX_TOKENS))
                for i, j in enumerate((0, 2, 5))]
    eng = engine(model, f"eagle:{head_dir}", 3)
    prop, bs = eng.spec.proposer, eng.runner.kv.block_size
    for r in together:
        eng.add_request(r)
    first = eng.step()  # the three prefills, in one forward
    prop._fuse_pending()
    lender = prop._seqs["r0"]
    for sharer in ("r1", "r2"):
        st = prop._seqs[sharer]
        assert st.filled == len(together[int(sharer[1])].prompt_token_ids)  # no gap: it can draft
        assert torch.equal(st.feats[: 2 * bs], lender.feats[: 2 * bs])  # the lender's rows
    assert not prop._prefix._borrow
    got: dict[str, dict] = {}
    for out in first:
        _collect(got, out)
    while eng.has_work():
        for out in eng.step():
            _collect(got, out)
    plain = run_to_completion(engine(model, f"eagle:{head_dir}", 3, prefix_caching=False), together)
    ref = HFReference(path, model.eos_token_ids)
    for r in together:
        assert got[r.request_id]["ids"] == plain[r.request_id]["ids"], r.request_id
        check_greedy_match(got[r.request_id]["ids"], ref.greedy(r.prompt_token_ids, MAX_TOKENS))
    for r in together[1:]:
        assert got[r.request_id]["cached"] == 2 * bs and got[r.request_id]["spec"].draft_tokens > 0
    assert got["r0"]["cached"] == 0
    assert not prop._seqs and eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks


def test_a_block_its_writer_began_in_an_earlier_step_is_borrowed_whole(tiny, head_dir):
    """A chunked prefill ends a block it began a step before (positions 16..23, then 24..31); a
    request admitted in that step shares the block: its features there are the writer's rows of
    the earlier forward and of this one, and it decodes what Hugging Face generate does."""
    path, model = tiny
    writer_ids = prompts()[3] + prompts()[2] + [7, 9]  # 40 tokens: chunks of 24 and 16
    writer = GenerationRequest("writer", writer_ids, SamplingParams(max_tokens=MAX_TOKENS))
    sharer = GenerationRequest("sharer", writer_ids[:34] + prompts()[5], SamplingParams(max_tokens=MAX_TOKENS))
    eng = engine(model, f"eagle:{head_dir}", 3, max_num_batched_tokens=24)
    prop, bs = eng.spec.proposer, eng.runner.kv.block_size
    got: dict[str, dict] = {}
    eng.add_request(writer)
    for out in eng.step():  # the writer's first 24 prompt tokens
        _collect(got, out)
    eng.add_request(sharer)
    for out in eng.step():  # the writer's last 16, the sharer admitted onto blocks 0 and 1
        _collect(got, out)
    prop._fuse_pending()
    assert prop._seqs["sharer"].filled >= 2 * bs + 1
    assert torch.equal(prop._seqs["sharer"].feats[: 2 * bs], prop._seqs["writer"].feats[: 2 * bs])
    while eng.has_work():
        for out in eng.step():
            _collect(got, out)
    assert got["sharer"]["cached"] == 2 * bs and got["sharer"]["spec"].draft_tokens > 0
    ref = HFReference(path, model.eos_token_ids)
    for r in (writer, sharer):
        check_greedy_match(got[r.request_id]["ids"], ref.greedy(r.prompt_token_ids, MAX_TOKENS))


def random_schedule(tiny, head_dir, seed: int, proposer=None) -> LLMEngine:
    """Run a seeded random schedule on the eagle head (``proposer``: a DraftServer's client) with
    a pool small enough to preempt and chunked prefills: requests under two shared prefixes arrive
    at random steps (several in one step: same-step borrowing), four are aborted while they run
    (lenders among them). Asserts that it preempted, aborted, shared and drafted, and that every
    request that finished decodes what Hugging Face generate does; returns the engine."""
    import random

    path, model = tiny
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (37, 50)]
    eng = engine(model, f"eagle:{head_dir}", 3, num_blocks=14, max_num_batched_tokens=40, proposer=proposer)
    pending = [GenerationRequest(f"q{i}", rnd.choice(prefixes) + torch.randint(0, 49152, (rnd.randint(1, 9),),
                                                                             generator=g).tolist(),
                                 SamplingParams(max_tokens=MAX_TOKENS)) for i in range(14)]
    prompt_of = {r.request_id: r.prompt_token_ids for r in pending}
    doomed = {r.request_id: rnd.randint(1, 8) for r in rnd.sample(pending, 4)}  # aborted this many steps in
    got: dict[str, dict] = {}
    age: dict[str, int] = {}
    aborted: set[str] = set()
    while pending or eng.has_work():
        for _ in range(rnd.choice((0, 0, 1, 2, 3))):  # arrivals, several at once now and then
            if pending:
                r = pending.pop(0)
                eng.add_request(r)
                age[r.request_id] = 0
        for rid in list(age):
            age[rid] += 1
            if doomed.get(rid) == age[rid] and got.get(rid, {}).get("finish") is None:
                eng.abort(rid)
                aborted.add(rid)
        for out in eng.step():
            _collect(got, out)
    finished = [rid for rid in got if got[rid]["finish"] is not None and rid not in aborted]
    assert aborted and eng.scheduler.num_preemptions > 0, (aborted, eng.scheduler.num_preemptions)
    assert sum(got[r]["cached"] for r in finished) > 0 and sum(got[r]["spec"].draft_tokens for r in finished) > 0
    assert len(finished) + len(aborted) == len(prompt_of)  # every request answered or aborted
    ref = HFReference(path, model.eos_token_ids)
    for rid in finished:
        check_greedy_match(got[rid]["ids"], ref.greedy(list(prompt_of[rid]), MAX_TOKENS))
    assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks
    return eng


@pytest.mark.parametrize("seed", [1, 2])
def test_random_arrivals_aborts_and_preemption_under_shared_prefixes_change_no_token(tiny, head_dir, seed):
    """``random_schedule`` on the engine's own head: afterwards no head state or pending borrow is
    left behind (placement separate: tests/kvsync/test_drafters.py)."""
    prop = random_schedule(tiny, head_dir, seed).spec.proposer
    assert not prop._seqs and not prop._prefix._borrow
