import pytest

from cluster.api import stubs
from cluster.api.server_fields import FIELDS_OF_EVERY_SERVER, UnsupportedField, check_request_fields, implemented_fields

pb2 = stubs.generation_pb2()
SCOPED = pb2.GenerateRequest(prompt="a", segment="chat", draft_scope="tenant-7")


def test_a_server_older_than_the_list_is_taken_to_implement_the_first_release_only():
    old = pb2.ModelInfoResponse(model="old")  # no request_fields
    assert implemented_fields(old) == FIELDS_OF_EVERY_SERVER
    with pytest.raises(UnsupportedField, match=r"does not implement draft_scope \(it predates"):
        check_request_fields(SCOPED, old)
    # the first release's fields, set to anything, go through
    check_request_fields(pb2.GenerateRequest(prompt="a", segment="chat", ignore_eos=True, max_tokens=3,
                                             regex="[a-z]", mode=1, seed=3, stop=["."]), old)
    # every field but draft_scope, prediction, logprobs, the penalties, logit_bias, stop_token_ids,
    # min_tokens, prompt_logprobs, grammar, repetition_penalty and min_p is one of the first release's
    assert {f.name for f in pb2.GenerateRequest.DESCRIPTOR.fields} - FIELDS_OF_EVERY_SERVER == {
        "draft_scope", "prediction", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
        "stop_token_ids", "min_tokens", "prompt_logprobs", "grammar", "repetition_penalty", "min_p"}
    with pytest.raises(UnsupportedField, match=r"does not implement prediction"):
        check_request_fields(pb2.GenerateRequest(prompt="a", prediction="b"), old)
    with pytest.raises(UnsupportedField, match=r"does not implement logprobs"):  # 0 is set: it asks for them
        check_request_fields(pb2.GenerateRequest(prompt="a", logprobs=0), old)


def test_a_listing_server_is_held_to_its_list():
    listed = pb2.ModelInfoResponse(request_fields=[f.name for f in pb2.GenerateRequest.DESCRIPTOR.fields])
    check_request_fields(SCOPED, listed)
    narrower = pb2.ModelInfoResponse(request_fields=["prompt", "max_tokens"])
    with pytest.raises(UnsupportedField, match=r"does not implement segment, draft_scope \(its ModelInfo"):
        check_request_fields(SCOPED, narrower)
    # a field left at its default is not sent, so not checked
    check_request_fields(pb2.GenerateRequest(prompt="a", draft_scope=""), narrower)
