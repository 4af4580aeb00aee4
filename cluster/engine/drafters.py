"""Building the drafter a SpecEngine's speculation controller asks: one drafter from its string,
or — when segments have drafters of their own (``SpecConfig.segments``) — the union of every
drafter configured as one segment-routed portfolio (``PortfolioProposer`` with ``SegmentRoutes``:
each sequence drafts with its segment's drafter, segments without one with the global drafter; a
``portfolio`` segment chooses among the portfolio's members, each member built once and shared
with the segments that name it alone — a target runner feeds one EAGLE head).

Owns: drafter string -> ``Proposer`` (n-gram, suffix — with ``SpecConfig.suffix_corpus``, by
default the shipped suffix corpus where it fits the target, ``suffix:FILE``'s, or none —,
portfolio — with the shipped EAGLE head as a member when it fits the target, or ``portfolio:DIR``'s head —,
eagle, layer skip, draft model with
its vocabulary check), the per-segment union (each distinct member drafter built once, a failure naming the segments that
asked for it), and the draft-cost prior (``draft_cost_ratio``) of a drafter before
any round is timed. Ignores: remote drafters (the replica injects a KVSync proposer; per-segment
drafters are refused there by the app config), K, verification.
"""
from __future__ import annotations

from cluster.common.config import COLD_SUFFIX, EngineConfig, SpecConfig
from cluster.common.errors import ModelLoadError
from cluster.speculative.proposer import (
    MODEL_FREE, SHIPPED_EAGLE_HEAD, DrafterKind, DrafterChoice, LocalModelProposer, Proposer, parse_drafter_choice,
)


def build_drafters(spec_cfg: SpecConfig, config: EngineConfig, model) -> tuple[Proposer, float | None]:
    """(the proposer, the global drafter's draft-cost prior) for ``spec_cfg``: its one drafter, or
    the segment-routed union when segments name drafters of their own."""
    wanted = spec_cfg.drafters()  # drafter -> segments naming it (the global drafter first)
    if len(wanted) == 1:
        proposer = build_proposer(parse_drafter_choice(spec_cfg.drafter), spec_cfg, config, model)
        return proposer, draft_cost_ratio(proposer, model.runner)
    from cluster.speculative.portfolio import Member, PortfolioProposer, SegmentRoutes

    # a ``portfolio`` segment chooses among the portfolio's members; each member drafter is built
    # once and shared with segments that name it alone (one EAGLE head per target runner)
    choices = {name: parse_drafter_choice(name) for name in wanted}
    members_of = {name: (portfolio_member_names(model, choice.model) if choice.kind is DrafterKind.PORTFOLIO
                         else (name,)) for name, choice in choices.items()}
    built: dict[str, Proposer] = {}
    for name, segments in wanted.items():
        for member in members_of[name]:
            if member in built:
                continue
            try:
                built[member] = build_proposer(parse_drafter_choice(member), spec_cfg, config, model)
            except Exception as exc:
                if not segments:
                    raise
                where = ", ".join(f"router.segments.{s}.drafter" for s in segments)
                raise ModelLoadError(f"{where} {name!r} cannot run in this SpecEngine: {type(exc).__name__}: "
                                     f"{exc} (drafters: ngram, suffix, portfolio, eagle, self[:L], or a draft "
                                     "model sharing the target's vocabulary)") from exc
    members = [Member(name, proposer, member_cost(proposer, model.runner)) for name, proposer in built.items()]
    routes = SegmentRoutes(_route(members_of[spec_cfg.drafter]),
                           {s: _route(members_of[name]) for name, segs in wanted.items() for s in segs})
    union = PortfolioProposer(members, routes=routes, horizon=spec_cfg.max_draft_tokens)
    global_members = members_of[spec_cfg.drafter]  # a portfolio's prior is model-free's, as on its own
    return union, draft_cost_ratio(built[global_members[0]], model.runner) if len(global_members) == 1 else 0.0


def _route(names: tuple[str, ...]) -> str | tuple[str, ...]:
    return names[0] if len(names) == 1 else names


def portfolio_member_names(model, head_dir: str | None = None) -> tuple[str, ...]:
    """The drafters ``portfolio`` chooses among on this target: n-gram, suffix, and the shipped
    EAGLE head when it was trained for this target; ``portfolio:DIR``: the head in DIR (refused
    when it does not fit the target, as ``eagle:DIR`` is)."""
    if head_dir:
        return ("ngram", "suffix", f"eagle:{head_dir}")
    return ("ngram", "suffix", "eagle") if shipped_head_fits(model) else ("ngram", "suffix")


def build_proposer(choice: DrafterChoice, spec_cfg: SpecConfig, config: EngineConfig, model) -> Proposer:
    if choice.kind is DrafterKind.NGRAM:
        from cluster.speculative.ngram import NgramProposer

        return NgramProposer(spec_cfg.ngram_min, spec_cfg.ngram_max)
    if choice.kind is DrafterKind.SUFFIX:
        from cluster.speculative.suffix import SuffixProposer

        return SuffixProposer(corpus=suffix_corpus_for(model, choice.model if choice.model is not None
                                                       else spec_cfg.suffix_corpus))
    if choice.kind is DrafterKind.PORTFOLIO:
        return build_portfolio(spec_cfg, model, choice.model)
    if choice.kind is DrafterKind.EAGLE:
        from cluster.speculative.eagle import EagleProposer

        return EagleProposer.from_dir(choice.model, model.runner)
    if choice.kind is DrafterKind.SELF:
        from cluster.models.runner import ModelRunner
        from cluster.speculative.layer_skip import LayerSkipProposer, default_self_layers

        if not isinstance(model.runner, ModelRunner):
            raise ModelLoadError("the self (layer-skip) drafter needs a Llama-family target")
        n = model.runner.model.arch.num_layers
        return LayerSkipProposer(model.runner, choice.self_layers or default_self_layers(n))
    return build_draft_model_proposer(choice.model, spec_cfg, config, model.tokenizer)


def build_portfolio(spec_cfg: SpecConfig, model, head_dir: str | None = None) -> Proposer:
    """``portfolio``: n-gram and suffix drafting, plus the EAGLE head shipped for the default model
    (member ``eagle``) when this target is the one it was trained for — a costly member, drafting
    only when chosen, at its draft-cost prior until measured. ``portfolio:DIR`` (``head_dir``): the
    head in DIR as that member instead, refused when it was trained for another target."""
    from cluster.speculative.portfolio import Member, default_portfolio

    extra = []
    if head_dir or shipped_head_fits(model):
        from cluster.speculative.eagle import EagleProposer

        eagle = EagleProposer.from_dir(head_dir or SHIPPED_EAGLE_HEAD, model.runner)
        extra.append(Member("eagle", eagle, member_cost(eagle, model.runner)))
    return default_portfolio(spec_cfg.ngram_min, spec_cfg.ngram_max, spec_cfg.max_draft_tokens, extra=extra,
                             suffix_corpus=suffix_corpus_for(model, spec_cfg.suffix_corpus))


def suffix_corpus_for(model, corpus: str | None):
    """The suffix drafter's corpus on ``model`` (a loaded target): None (``suffix`` with no
    ``suffix_corpus`` set) -> the corpus shipped for the default model where it was written by this
    target, else none; ``cold`` -> none; a file -> its corpus, refused (``SuffixCorpusMismatch``)
    when another target wrote it. Loaded once per process and file (read-only: engines share it)."""
    from cluster.speculative.suffix_corpus import SHIPPED_SUFFIX_CORPUS, cached_corpus, corpus_target

    if corpus == COLD_SUFFIX:
        return None
    identity = _native_identity(model)
    if corpus is None:
        fits = identity is not None and corpus_target(SHIPPED_SUFFIX_CORPUS) == identity
        return cached_corpus(SHIPPED_SUFFIX_CORPUS, identity) if fits else None
    return cached_corpus(corpus, identity)


def _native_identity(model):
    from cluster.models.runner import ModelRunner
    from cluster.speculative.eagle_head import target_identity

    runner = getattr(model, "runner", None)
    return target_identity(runner.model) if isinstance(runner, ModelRunner) else None


def shipped_head_fits(model) -> bool:
    """Whether the shipped EAGLE head was trained for ``model`` (a loaded target) and it runs natively."""
    import json

    from cluster.speculative.eagle_head import CONFIG_FILE, EagleConfig

    path = SHIPPED_EAGLE_HEAD / CONFIG_FILE
    identity = _native_identity(model)
    if identity is None or not path.is_file():
        return False
    return EagleConfig.from_json(json.loads(path.read_text())).target == identity


def build_draft_model_proposer(draft_source: str, spec_cfg: SpecConfig, config: EngineConfig,
                               target_tokenizer=None):
    """Load a draft model (own runner, own KV pool) and check its vocabulary against the target."""
    from cluster.models.load import load_model
    from cluster.speculative.draft_model import DraftModelProposer, TrimmedHead, frequent_ids
    from cluster.speculative.vocab_check import require_vocab_compatible

    draft = load_model(draft_source, config)
    if target_tokenizer is not None:
        require_vocab_compatible(target_tokenizer, draft.tokenizer, force=spec_cfg.force_vocab_mismatch)
    trimmed = None
    if spec_cfg.draft_vocab_trim:
        trimmed = TrimmedHead(draft.runner, frequent_ids(draft.tokenizer, spec_cfg.draft_vocab_trim))
    return DraftModelProposer(draft.runner, trimmed)


def member_cost(proposer, target_runner) -> float:
    """A portfolio member's prior cost of one draft round in target decode steps: its
    ``draft_cost_ratio``, else 0.1 for an EAGLE head (one decoder layer) and 1.0 for a drafter we
    cannot size (as dear as the target: chosen only once measured cheaper)."""
    cost = draft_cost_ratio(proposer, target_runner)
    if cost is not None and (cost > 0 or proposer.kind is not DrafterKind.EAGLE):
        return cost
    return 0.1 if proposer.kind is DrafterKind.EAGLE else 1.0


def draft_cost_ratio(proposer, target_runner) -> float | None:
    """Prior for one draft round relative to a target decode step, before any is timed: ngram
    (and suffix, and the model-free portfolio) ~0; self:L and local draft models their share of the weights a decode step reads (decoder
    layers + LM head); eagle its head's decoder layer + trimmed LM head over the target's
    parameters; None (absolute prior) for drafters we cannot size, e.g. remote ones."""
    kind = proposer.kind
    if kind in MODEL_FREE:
        return 0.0
    if kind is DrafterKind.EAGLE:  # one decoder layer + the trimmed LM head (parameters read per round)
        target_model = getattr(target_runner, "model", None)
        return None if target_model is None else (
            proposer.round_parameters() * target_model.embed.element_size() / target_model.weight_bytes())
    runner = proposer.runner if isinstance(proposer, LocalModelProposer) else None
    arch = getattr(getattr(runner, "model", None), "arch", None)
    if arch is None or kind not in (DrafterKind.SELF, DrafterKind.DRAFT_MODEL):
        return None

    def weights(a, layers: int) -> float:
        attn = a.hidden_size * a.head_dim * (2 * a.num_heads + 2 * a.num_kv_heads)
        return layers * (attn + 3 * a.hidden_size * a.intermediate_size) + a.vocab_size * a.hidden_size

    if kind is DrafterKind.SELF:
        return weights(arch, proposer.num_layers) / weights(arch, arch.num_layers)
    target_arch = getattr(getattr(target_runner, "model", None), "arch", None)
    return None if target_arch is None else weights(arch, arch.num_layers) / weights(target_arch, target_arch.num_layers)
