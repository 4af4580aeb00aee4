"""Model drafters hosted by a DraftServer (placement ``separate``): built from a ``DrafterChoice``
without a target engine next to them.

Owns: ``build_remote_proposer`` -> (proposer, vocabulary size) for the model drafters.
``EAGLE``: the head (checked against the target it was trained for) over the target's embedding;
the target's features of the committed tokens come with each Propose (``cluster.kvsync.features``)
and feed the head's ``record`` on the server (``cluster.kvsync.server``).
``DRAFT_MODEL``: load the draft model (own runner, own KV pool), check its tokenizer against the
target's (``require_vocab_compatible``, refused unless forced), optional trimmed LM head.
``SELF``: layer skip without the target's KV. In the shared placement layer skip reads the
target's own cached K/V; a DraftServer has none, so it hosts the target's first L layers
(+ embedding, final norm and LM head; the deeper layers' weights are dropped after loading) as an
independent draft model with its own L-layer KV pool (``first_layers``), wrapped in
``DraftModelProposer``. Greedy drafts are the tokens the shared layer-skip drafter proposes:
layers < L compute the same K/V from the same committed tokens.
Ignores: the model-free drafters (``NGRAM``, ``SUFFIX``, ``PORTFOLIO``: the DraftServer deployment builds them), serving
(``cluster.kvsync.server``), verification, K.
"""
from __future__ import annotations

import copy
import dataclasses

from cluster.common.config import EngineConfig
from cluster.common.errors import ModelLoadError
from cluster.models.llama import LlamaModel
from cluster.models.runner import ModelRunner
from cluster.speculative.draft_model import DraftModelProposer, TrimmedHead, frequent_ids
from cluster.speculative.layer_skip import default_self_layers
from cluster.speculative.proposer import DrafterChoice, DrafterKind, Proposer

_MIN_BLOCKS = 2  # KV pool of a model loaded only for its weights (the draft gets its own pool)


def first_layers(model: LlamaModel, num_layers: int) -> LlamaModel:
    """A ``LlamaModel`` made of the first ``num_layers`` layers of ``model`` plus its embedding,
    final norm and LM head. Tensors are shared (no copy); the arch says L layers, so a
    ``ModelRunner`` over it allocates K/V for L layers only."""
    total = model.arch.num_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"self:L needs 1 <= L < {total} (the target's layers), got {num_layers}")
    draft = copy.copy(model)  # shallow: same weight tensors, RoPE tables, dtype
    draft.arch = dataclasses.replace(model.arch, num_layers=num_layers)
    draft.layers = list(model.layers[:num_layers])
    return draft


def self_draft_proposer(target: LlamaModel, num_layers: int | None, *, block_size: int = 16,
                        kv_cache_memory_mb: int = 512) -> DraftModelProposer:
    """Layer skip as an independent draft model: the first L target layers with their own KV."""
    layers = num_layers or default_self_layers(target.arch.num_layers)
    runner = ModelRunner(first_layers(target, layers), None, block_size, kv_cache_memory_mb)
    proposer = DraftModelProposer(runner)
    proposer.kind = DrafterKind.SELF  # what it drafts like; the KV it owns is its own
    return proposer


def build_remote_proposer(choice: DrafterChoice, target_model: str, dtype: str, *,
                          force_vocab_mismatch: bool = False, draft_vocab_trim: int | None = None,
                          kv_cache_memory_mb: int = 512, block_size: int = 16,
                          target=None) -> tuple[Proposer, int]:
    """(proposer, vocabulary size) for a model drafter served by a DraftServer.

    target_model: the target's model source (SELF loads its weights; DRAFT_MODEL its tokenizer).
    target: an already loaded target ``LoadedModel`` to take weights/tokenizer from (tests, or a
    process that holds the target anyway); it is not modified.
    """
    if choice.kind is DrafterKind.EAGLE:
        from cluster.speculative.eagle import EagleProposer

        # the head reads the target's embedding (and is checked against the target's identity);
        # its features arrive over KVSync, so this runner over the target weights never runs
        runner = ModelRunner(_target_llama(target, target_model, dtype, block_size), _MIN_BLOCKS, block_size)
        return EagleProposer.from_dir(choice.model, runner), runner.vocab_size
    if choice.kind is DrafterKind.SELF:
        model = _target_llama(target, target_model, dtype, block_size)
        proposer = self_draft_proposer(model, choice.self_layers, block_size=block_size,
                                       kv_cache_memory_mb=kv_cache_memory_mb)
        return proposer, proposer.vocab_size
    if choice.kind is DrafterKind.DRAFT_MODEL:
        from cluster.models.load import load_model
        from cluster.speculative.vocab_check import require_vocab_compatible

        config = EngineConfig(model=choice.model, dtype=dtype, block_size=block_size,
                              kv_cache_memory_mb=kv_cache_memory_mb)
        draft = load_model(choice.model, config)
        require_vocab_compatible(_target_tokenizer(target, target_model), draft.tokenizer,
                                 force=force_vocab_mismatch)
        if not isinstance(draft.runner, ModelRunner):  # the HF fallback runner has no KV rollback here
            raise ModelLoadError(f"draft model {choice.model!r} is not in the Llama family; "
                                 f"a DraftServer needs the native runner")
        trimmed = None
        if draft_vocab_trim:
            trimmed = TrimmedHead(draft.runner, frequent_ids(draft.tokenizer, draft_vocab_trim))
        return DraftModelProposer(draft.runner, trimmed), draft.runner.vocab_size
    raise ValueError(f"build_remote_proposer builds model drafters (draft model, self, eagle), "
                     f"not {choice.kind.value}")


def _target_llama(target, target_model: str, dtype: str, block_size: int) -> LlamaModel:
    if target is None:
        from cluster.models.load import load_model

        # only the weights are wanted: the smallest KV pool, dropped with the LoadedModel
        target = load_model(target_model, EngineConfig(model=target_model, dtype=dtype,
                                                       block_size=block_size), num_blocks=_MIN_BLOCKS)
    if not isinstance(target.runner, ModelRunner):
        raise ModelLoadError("the self (layer-skip) and eagle drafters need a Llama-family target")
    return target.runner.model


def _target_tokenizer(target, target_model: str):
    if target is not None:
        return target.tokenizer
    from cluster.models.loader import resolve_model
    from cluster.models.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(target_model).path)
