"""`specserve client`'s request from its flags (the calls themselves, against a real Serve app:
tests/deployments/test_service_fake.py)."""
import pytest

from cluster.cli import build_parser
from cluster.commands.client import build_request


def parse(*flags: str):
    return build_parser().parse_args(["client", *flags, "hello"])


def test_flags_become_request_fields():
    req = build_request(parse("--max-tokens", "5", "--temperature", "0.5", "--mode", "plain", "--chat",
                              "--presence-penalty", "0.5", "--frequency-penalty", "-1.5",
                              "--logit-bias", "42:-100, 7:5.5", "--logprobs", "3", "--min-tokens", "2",
                              "--stop-token-ids", "9,11", "--prompt-logprobs", "0", "--repetition-penalty", "1.25",
                              "--min-p", "0.05"))
    assert (req.max_tokens, req.temperature, req.mode) == (5, 0.5, 2)
    assert req.messages[0].content == "hello" and req.prompt == ""
    assert (req.presence_penalty, req.frequency_penalty) == (0.5, -1.5)
    assert dict(req.logit_bias) == {42: -100.0, 7: 5.5} and req.logprobs == 3
    assert (req.min_tokens, list(req.stop_token_ids)) == (2, [9, 11])
    assert req.HasField("prompt_logprobs") and req.prompt_logprobs == 0
    assert req.HasField("repetition_penalty") and req.repetition_penalty == 1.25 and req.min_p == pytest.approx(0.05)
    plain = build_request(parse())
    assert plain.prompt == "hello" and not plain.logit_bias and plain.presence_penalty == 0
    assert plain.min_tokens == 0 and not plain.stop_token_ids  # unset: not sent (an older server ignores none)
    assert not plain.HasField("logprobs")  # unset: not asked (0 asks for each token's own value)
    assert not plain.HasField("prompt_logprobs")
    assert not plain.HasField("repetition_penalty") and plain.min_p == 0


@pytest.mark.parametrize("bad", ["42", "a:1", "42:x", "1:2:3"])
def test_a_malformed_logit_bias_is_a_usage_error(bad, capsys):
    with pytest.raises(SystemExit) as e:
        parse("--logit-bias", bad)
    assert e.value.code == 2 and "expected ID:BIAS" in capsys.readouterr().err


def test_malformed_token_ids_are_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        parse("--stop-token-ids", "1,x")
    assert "expected ID[,ID...]" in capsys.readouterr().err


def test_tokenize_is_a_flag():
    assert parse("--tokenize").tokenize and not parse().tokenize


def test_constraint_flags_and_a_grammar_from_a_file(tmp_path):
    assert build_request(parse("--regex", "[a-z]+")).regex == "[a-z]+"
    assert build_request(parse("--grammar", 'start: "a"+')).grammar == 'start: "a"+'
    path = tmp_path / "list.lark"
    path.write_text('start: "[" NUM "]"\nNUM: /[0-9]+/\n')
    req = build_request(parse("--grammar", f"@{path}"))
    assert req.grammar == path.read_text() and req.json_schema == req.regex == ""
