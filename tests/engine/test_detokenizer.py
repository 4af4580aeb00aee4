"""Incremental detokenization and stop strings on the real default tokenizer."""
import pytest

from cluster.engine.detokenizer import Detokenizer


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


def test_deltas_concatenate_to_full_decode(tok):
    text = "Héllo, wörld! 你好，世界 — ünïcode ✓ and code: def f(x): return x**2\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    d = Detokenizer(tok)
    out = "".join(d.add(t)[0] for t in ids) + d.flush()
    assert out == tok.decode(ids, skip_special_tokens=True) == text


def test_stop_string_cuts_and_never_streams_part_of_it(tok):
    ids = tok("alpha beta STOP gamma", add_special_tokens=False)["input_ids"]
    d = Detokenizer(tok, stop=("STOP",))
    streamed, hit = "", False
    for t in ids:
        delta, hit = d.add(t)
        streamed += delta
        assert "ST" not in streamed or hit
        if hit:
            break
    assert hit and streamed == "alpha beta " and d.text == "alpha beta "
