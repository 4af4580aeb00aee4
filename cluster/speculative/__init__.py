"""Speculative decoding: proposers (draft model, n-gram prompt lookup, layer-skip self-draft,
suffix, portfolio, a trained EAGLE head), lossless verification (rejection sampler), adaptive K,
and safety gates (vocabulary, MoE).

Vocabulary (arXiv 2211.17192), used everywhere: the drafter proposes K *draft tokens*; the target
verifies all K+1 positions in one forward pass; the longest agreeing prefix are the *accepted
tokens*; then one more token comes from the target: the *recovered token* (sampled from the
residual at the first rejection) or, when all K were accepted, the *bonus token*. The *committed
length* is the number of tokens (prompt + output) both target and draft KV agree on. *α* is the
per-position acceptance probability, estimated as accepted / (accepted + rejections) — a
*rejection* is a verification step that rejected one of its drafts — the unit of the cost model
and of every gate; the *acceptance rate* = accepted / drafted is a different, lower number
(``cluster.speculative.acceptance``). The *mean acceptance length* = tokens committed per
verification step (accepted + 1).

K has one name from the request to the kernel: ``num_draft_tokens`` — the config knob (an integer
or "auto"), a scheduled sequence's draft slots, a KVSync ProposeSeq field, the per-row list in
``SpecBatchMetadata``, the metric label and trace attribute; its bound is ``max_draft_tokens`` (the
config's cap on adaptive K, and the largest K of one verification batch). Only arithmetic calls it
``k`` (as shapes say ``[B, K+1, V]``). "spec" always means speculative (SpecConfig, SpecEngine,
SpecStats); a model string is a *source*, a parsed ``--drafter`` string a ``DrafterChoice``.
"""
