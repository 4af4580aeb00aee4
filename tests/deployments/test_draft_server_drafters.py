"""The DraftServer deployment's drafter factory: every drafter kind builds for placement
``separate`` from the app config (no Ray needed: the factory is plain code)."""
import pytest

from cluster.speculative.proposer import DrafterKind
from deployments.app_config import AppConfig
from deployments.draft_server import build_proposer


@pytest.mark.parametrize("drafter,kind", [("ngram", DrafterKind.NGRAM), ("suffix", DrafterKind.SUFFIX),
                                          ("suffix:cold", DrafterKind.SUFFIX), ("portfolio", DrafterKind.PORTFOLIO)])
def test_model_free_drafters_are_vocabulary_agnostic(drafter, kind):
    proposer, vocab = build_proposer(AppConfig(drafter=drafter, placement="separate"))
    assert proposer.kind is kind and vocab == 0
    members = {m.name: m.proposer for m in getattr(proposer, "members", [])}
    suffix = proposer if kind is DrafterKind.SUFFIX else members.get("suffix")
    assert suffix is None or suffix.corpus is None  # no target here to check a corpus by: traffic only


def test_a_suffix_corpus_is_refused_by_the_draft_server():
    """``suffix:FILE`` is checked against the target that wrote it, which the DraftServer does not
    load: AppConfig refuses it for placement separate, and the factory too if handed one."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="does not load"):
        AppConfig(drafter="suffix:/corpora/x.npz", placement="separate")
    assert AppConfig(drafter="suffix:/corpora/x.npz", placement="shared").drafter == "suffix:/corpora/x.npz"
    assert build_proposer(AppConfig(drafter="suffix: Cold", placement="separate"))[0].corpus is None  # as parsed
    app = AppConfig(drafter="suffix", placement="separate")
    object.__setattr__(app, "drafter", "suffix:/corpora/x.npz")  # past the config's own check
    with pytest.raises(ValueError, match="traffic only"):
        build_proposer(app)


def test_a_suffix_corpus_setting_is_refused_by_the_draft_server_and_passed_on_in_shared():
    """``suffix_corpus: FILE`` (the corpus of ``suffix`` and the portfolio's suffix member) is
    refused for placement separate as ``suffix:FILE`` is; ``cold`` is what the DraftServer does
    anyway; with no SpecEngine it would be read by nothing: refused."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="does not load"):
        AppConfig(drafter="portfolio", placement="separate", suffix_corpus="/corpora/x.npz")
    assert build_proposer(AppConfig(drafter="suffix", placement="separate", suffix_corpus="Cold"))[0].corpus is None
    shared = AppConfig(drafter="portfolio", placement="shared", suffix_corpus="/corpora/x.npz")
    assert shared.spec_config().suffix_corpus == "/corpora/x.npz"
    with pytest.raises(ValidationError, match="no SpecEngine runs"):
        AppConfig(drafter="none", suffix_corpus="cold")
    with pytest.raises(ValidationError, match="no drafter configured drafts with it"):
        AppConfig(drafter="ngram", suffix_corpus="/corpora/x.npz")
    app = AppConfig(drafter="suffix", placement="separate")
    object.__setattr__(app, "suffix_corpus", "/corpora/x.npz")  # past the config's own check
    with pytest.raises(ValueError, match="learn from traffic only"):
        build_proposer(app)


def test_a_portfolio_holding_a_head_is_refused_by_the_draft_server():
    """``portfolio:DIR`` drafts beside the target; AppConfig refuses it for placement separate, and
    the factory too if handed one (its portfolio is model-free)."""
    app = AppConfig(drafter="portfolio", placement="separate")
    object.__setattr__(app, "drafter", "portfolio:/heads/v4")  # past the config's own check
    with pytest.raises(ValueError, match="serves the model-free portfolio only"):
        build_proposer(app)


def test_self_layers_run_as_a_draft_model_with_their_own_kv():
    app = AppConfig(drafter="self:4", placement="separate", draft_server={"kv_cache_memory_mb": 8})
    proposer, vocab = build_proposer(app)
    assert proposer.kind is DrafterKind.SELF and vocab == 49152  # SmolLM2's vocabulary
    assert proposer.runner.model.arch.num_layers == 4 and len(proposer.runner.k_cache) == 4
    assert proposer.runner.kv.num_free_blocks == proposer.runner.kv.num_blocks


from tests.speculative.test_eagle import head_dir, tiny  # noqa: E402,F401 (fixtures)


def test_eagle_head_builds_with_the_target_embedding_and_sizes_the_limits_for_features(tiny, head_dir):
    from cluster.kvsync.server import PROTOCOL_VERSION, DraftServerCore

    path, model = tiny
    app = AppConfig(model=str(path), drafter=f"eagle:{head_dir}", placement="separate")
    proposer, vocab = build_proposer(app)
    assert proposer.kind is DrafterKind.EAGLE and vocab == model.runner.vocab_size
    core = DraftServerCore(proposer, vocab_size=vocab, drafter=app.drafter, limits=app.kvsync_limits(vocab))
    width = len(proposer.feature_layers) * model.runner.model.arch.hidden_size
    assert core.feature_width == core.limits.feature_width == width
    assert core.limits.request_bytes > app.kvsync_limits(vocab).request_bytes  # room for the rows
    info = core.info()
    assert (list(info.feature_layers), info.feature_width, info.protocol_version) == \
        (list(proposer.feature_layers), width, PROTOCOL_VERSION)
