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


def test_a_stop_string_ending_under_min_tokens_is_text(tok):
    """``check_stop=False`` (the output is under min_tokens): a stop string that ends there is kept
    as text, and only one ending later stops the output."""
    ids = tok("a STOP b STOP c", add_special_tokens=False)["input_ids"]
    first_end = next(i for i in range(len(ids)) if "STOP" in tok.decode(ids[: i + 1]))
    d = Detokenizer(tok, stop=("STOP",))
    out, hit = "", False
    for i, t in enumerate(ids):
        delta, hit = d.add(t, check_stop=i > first_end)  # min_tokens reaches past the first STOP
        out += delta
        if hit:
            break
    assert hit and out == "a STOP b "
