"""TokenHistory: the engine's token list for a sequence is appended to, not copied, step by step;
a list that does not extend the history is refused (the drafter starts a new one)."""
from __future__ import annotations

import numpy as np

from cluster.speculative.token_history import TokenHistory


def test_a_growing_list_is_appended_and_anything_else_refused():
    h = TokenHistory.of([5, 6, 7], np.int32)
    assert h.tokens.dtype == np.int32 and h.tokens.tolist() == [5, 6, 7]
    assert h.follow([5, 6, 7]) is False  # nothing new
    ids = [5, 6, 7] + list(range(200))  # past the spare capacity: the buffer grows
    assert h.follow(ids) is True and h.tokens.tolist() == ids and h.buf.shape[0] >= len(ids)
    assert h.follow(ids[:50]) is None  # shorter: a preempted sequence
    assert h.follow([9] + ids[1:] + [1]) is None  # another first token: a reused id
    assert h.follow(ids[:-1] + [-3, 4]) is None  # the last token seen changed
    assert h.tokens.tolist() == ids  # a refused list leaves the history as it was
    assert TokenHistory.of([]).follow([1]) is None  # an empty history is never extended
