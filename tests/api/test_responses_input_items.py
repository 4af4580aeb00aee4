"""A response's input items in OpenAI's shape, and the pages a list request asks for."""
import pytest

from cluster.api.responses_api import ResponseRequest
from cluster.api.responses_input_items import input_items, item_page
from cluster.api.status import ServiceError


def body(**kw) -> ResponseRequest:
    return ResponseRequest.model_validate({"model": "m", **kw})


def test_each_input_becomes_an_item_with_an_id():
    (only,) = input_items(body(input="hello"), "resp_abc")
    assert only == {"id": "msg_abc_in0", "type": "message", "role": "user", "status": "completed",
                    "content": [{"type": "input_text", "text": "hello"}]}
    items = input_items(body(input=[
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "assistant", "id": "msg_earlier", "status": "completed",
         "content": [{"type": "output_text", "text": "Hi.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_earlier_0"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
    ]), "resp_abc")
    assert [i["id"] for i in items] == ["msg_abc_in0", "msg_earlier", "fc_earlier_0", "fco_abc_in3", "msg_abc_in4"]
    assert items[0]["role"] == "developer" and items[0]["content"] == [{"type": "input_text", "text": "be brief"}]
    assert items[1]["content"] == [{"type": "output_text", "text": "Hi.", "annotations": []}]
    assert (items[2]["name"], items[2]["arguments"], items[3]["output"]) == ("f", "{}", "42")
    assert [p["text"] for p in items[4]["content"]] == ["a", "b"]


def test_pages_follow_order_after_and_limit():
    items = [{"id": f"i{k}"} for k in range(5)]
    page = item_page(items, {})
    assert [i["id"] for i in page["data"]] == ["i4", "i3", "i2", "i1", "i0"]  # desc by default, as OpenAI's
    assert (page["object"], page["first_id"], page["last_id"], page["has_more"]) == ("list", "i4", "i0", False)
    page = item_page(items, {"order": "asc", "limit": "2"})
    assert [i["id"] for i in page["data"]] == ["i0", "i1"] and page["has_more"]
    page = item_page(items, {"order": "asc", "limit": "2", "after": page["last_id"]})
    assert [i["id"] for i in page["data"]] == ["i2", "i3"] and page["has_more"]
    page = item_page(items, {"order": "asc", "after": "i3"})
    assert [i["id"] for i in page["data"]] == ["i4"] and not page["has_more"]
    assert item_page(items, {"after": "i0"})["data"] == []


@pytest.mark.parametrize("query, param", [
    ({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"), ({"limit": "ten"}, "limit"),
    ({"order": "newest"}, "order"), ({"after": "nope"}, "after"), ({"include": "message.input_image.image_url"}, "include"),
    ({"before": "i1"}, "before"),
])
def test_a_bad_query_is_refused_naming_its_parameter(query, param):
    with pytest.raises(ServiceError) as e:
        item_page([{"id": "i0"}, {"id": "i1"}], query)
    assert e.value.param == param and e.value.code.name == "INVALID_ARGUMENT"
