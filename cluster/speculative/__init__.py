"""Speculative decoding: proposers (draft model, n-gram prompt lookup, layer-skip self-draft),
lossless verification (rejection sampler), adaptive K, and safety gates (vocabulary, MoE).

Vocabulary (arXiv 2211.17192), used everywhere: the drafter proposes K *draft tokens*; the target
verifies all K+1 positions in one forward pass; the longest agreeing prefix are the *accepted
tokens*; then one more token comes from the target: the *recovered token* (sampled from the
residual at the first rejection) or, when all K were accepted, the *bonus token*. The *committed
length* is the number of tokens (prompt + output) both target and draft KV agree on. The
*acceptance rate* α = accepted / drafted; the *mean acceptance length* = tokens committed per
verification step (accepted + 1).
"""
