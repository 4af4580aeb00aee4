"""OpenAI's Responses API end to end on a real Serve app (the fake engine: its output repeats the
prompt, so what the model was fed shows in the answer), through the official ``openai`` client:
a response is the chat endpoint's answer to the same messages, stored responses are retrieved,
continued (``previous_response_id``) and deleted, a stream is OpenAI's event sequence ending in
the stored response, and what is not done is refused (the real model: test_openai_service.py)."""
import json

import openai
import pytest
import requests

from tests.deployments.harness import FAKE, SHARED_ENV, Client, fake_args

pytestmark = pytest.mark.ray
TOKEN = SHARED_ENV["SPECSERVE_RESP_TOKEN"]


@pytest.fixture(scope="module")
def addrs(serve_shared):
    apps = {"resp": fake_args(auth={"token_env": "SPECSERVE_RESP_TOKEN"},
                              limits={"max_tokens": 64, "max_prompt_tokens": 256, "max_message_bytes": 8192},
                              http={"stored_responses": 3},
                              engine_impl={**FAKE, "options": {"token_delay_s": 0.005}}),
            "nostore": fake_args(http={"stored_responses": 0})}
    with serve_shared.apps(apps, timeout_s=300) as a:
        Client(a.grpc, "resp", TOKEN).wait_ready()
        Client(a.grpc, "nostore").wait_ready()
        yield a


@pytest.fixture(scope="module")
def client(addrs):
    return openai.OpenAI(base_url=f"{addrs.http}/resp/v1", api_key=TOKEN, max_retries=0, timeout=60)


def chat_answer(client, messages: list[dict], n: int) -> tuple[str, int]:
    r = client.chat.completions.create(model="fake", messages=messages, max_tokens=n, temperature=0)
    return r.choices[0].message.content, r.usage.prompt_tokens


def test_a_response_is_the_chat_answer_to_the_same_messages_and_is_stored(client):
    r = client.responses.create(model="fake", input="Hello there", max_output_tokens=12, temperature=0,
                                instructions="Be brief.", metadata={"k": "v"})
    text, prompt_tokens = chat_answer(client, [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Hello there"}], 12)
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == text
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # the budget ended it
    assert (r.usage.input_tokens, r.usage.output_tokens) == (prompt_tokens, 12)
    assert r.usage.total_tokens == prompt_tokens + 12 and r.metadata == {"k": "v"} and r.store is True
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    again = client.responses.retrieve(r.id)
    assert again.model_dump() == r.model_dump()


def test_a_continuation_is_fed_the_previous_input_and_output_not_its_instructions(client):
    first = client.responses.create(model="fake", input="one two", max_output_tokens=4, temperature=0,
                                    instructions="Only the first.")
    second = client.responses.create(model="fake", input=[{"role": "user", "content": "three"}],
                                     previous_response_id=first.id, max_output_tokens=40, temperature=0)
    messages = [{"role": "user", "content": "one two"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "three"}]
    text, prompt_tokens = chat_answer(client, messages, 40)
    assert second.output_text == text and second.usage.input_tokens == prompt_tokens
    assert second.previous_response_id == first.id and "Only the first." not in second.output_text
    third = client.responses.create(model="fake", input="four", previous_response_id=second.id,
                                    max_output_tokens=2, temperature=0)
    _, prompt_tokens = chat_answer(client, messages + [{"role": "assistant", "content": second.output_text},
                                                       {"role": "user", "content": "four"}], 2)
    assert third.usage.input_tokens == prompt_tokens  # the whole chain


def test_input_items_list_what_a_response_was_sent_page_by_page(client, addrs):
    first = client.responses.create(model="fake", input="one", max_output_tokens=2, temperature=0)
    (item,) = client.responses.input_items.list(first.id).data
    assert (item.type, item.role, item.content[0].text) == ("message", "user", "one")
    sent = [{"role": "developer", "content": "short"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
            {"role": "user", "content": [{"type": "input_text", "text": "two"}]}]
    second = client.responses.create(model="fake", input=sent, previous_response_id=first.id, max_output_tokens=2,
                                     temperature=0)
    newest_first = client.responses.input_items.list(second.id)  # OpenAI's default order: desc
    assert [i.type for i in newest_first.data] == ["message", "function_call_output", "function_call", "message"]
    assert newest_first.data[0].content[0].text == "two" and newest_first.data[1].output == "42"
    assert newest_first.data[3].role == "developer"  # only this response's input: not the earlier turn
    pages = client.responses.input_items.list(second.id, order="asc", limit=1)
    walked = [i.id for i in pages]  # the client follows after= from page to page
    assert walked == [i.id for i in reversed(newest_first.data)] and len(set(walked)) == 4
    r = requests.get(f"{addrs.http}/resp/v1/responses/{second.id}/input_items", params={"limit": 500},
                     headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")
    gone = client.responses.create(model="fake", input="x", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(gone.id)


def test_a_record_stored_without_input_items_and_cancel_are_refused_clearly(client):
    from ray import serve
    old = client.responses.create(model="fake", input="stored long ago", max_output_tokens=1)
    store = serve.get_deployment_handle("ResponseStore", app_name="resp")
    record = store.get.remote(old.id).result()
    del record["input_items"]  # as a version before input_items were kept stored it
    store.put.remote(old.id, record, 1000).result()
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.input_items.list(old.id)
    assert "were not stored" in e.value.body["message"], e.value.body
    assert client.responses.retrieve(old.id).id == old.id  # the response itself still is
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(old.id)
    assert "only a background response" in e.value.body["message"], e.value.body
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")
    assert client.responses.retrieve(old.id).status == old.status  # a refused cancel changed nothing


def test_delete_store_false_and_eviction(client):
    kept = client.responses.create(model="fake", input="keep me", max_output_tokens=2)
    gone = client.responses.create(model="fake", input="not me", max_output_tokens=2, store=False)
    assert gone.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="fake", input="x", previous_response_id=gone.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id" and "not found" in e.value.body["message"]
    deleted = client.responses.delete(kept.id) if hasattr(client.responses, "delete") else None
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    ids = [client.responses.create(model="fake", input=f"r{i}", max_output_tokens=1).id for i in range(4)]
    with pytest.raises(openai.NotFoundError):  # http.stored_responses is 3: the oldest went first
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


def test_a_stream_is_openais_event_sequence_ending_in_the_stored_response(client):
    events = list(client.responses.create(model="fake", input="stream this please", max_output_tokens=9,
                                          temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == deltas == events[-4].text
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()
    unary = client.responses.create(model="fake", input="stream this please", max_output_tokens=9, temperature=0)
    assert unary.output_text == deltas


def test_logprobs_when_include_asks_unary_streamed_and_stored(client):
    args = dict(model="fake", input="log me", max_output_tokens=6, temperature=0,
                include=["message.output_text.logprobs"], top_logprobs=2)
    r = client.responses.create(**args)
    entries = r.output[0].content[0].logprobs
    assert len(entries) == r.usage.output_tokens == 6 and "".join(e.token for e in entries) == r.output_text
    assert all(e.logprob == -0.25 and len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
               for e in entries)  # the fake engine's stand-ins (the values' contract: tests/sampling)
    events = list(client.responses.create(**args, stream=True))
    streamed = [x for e in events if e.type == "response.output_text.delta" for x in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [x.token for x in streamed] == [x.token for x in done.logprobs] == [e.token for e in entries]
    assert client.responses.retrieve(r.id).output[0].content[0].logprobs == entries
    assert client.responses.create(**{**args, "include": []} | {"top_logprobs": None}).output[0].content[0].logprobs == []


@pytest.mark.parametrize("kwargs,param,needle", [
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]), "input",
     "input[0].content[0].type 'input_image' is not supported"),
    (dict(tools=[{"type": "web_search"}]), "tools", "function tools only"),
    (dict(reasoning={"effort": "high"}), "reasoning", "reasoning is not supported"),
    (dict(truncation="auto"), "truncation", "truncation may only be 'disabled'"),
    (dict(background=True), "background", "background responses are not supported"),
    (dict(include=["file_search_call.results"]), "include", "include may only list 'message.output_text.logprobs'"),
    (dict(top_logprobs=2), "top_logprobs", "top_logprobs needs include"),
    (dict(input=[{"type": "item_reference", "id": "x"}]), "input", "'item_reference' is not supported"),
    (dict(input=[{"type": "function_call_output", "call_id": "c9", "output": "x"}]), "messages",
     "answers no earlier tool call"),  # the chat endpoint's rule, on the converted messages
    (dict(extra_body={"min_p": 0.1}), "min_p", "unrecognized request argument supplied: min_p"),
    (dict(model="gpt-5"), "model", "does not exist"),
])
def test_what_is_not_done_is_refused(client, kwargs, param, needle):
    args = {"model": "fake", "input": "hi", "max_output_tokens": 2, **kwargs}
    with pytest.raises(openai.APIStatusError) as e:
        client.responses.create(**args)
    assert e.value.status_code in (400, 404) and needle in e.value.body["message"], e.value.body
    assert e.value.body["param"] == param


def test_auth_and_a_server_that_stores_nothing(addrs, client):
    url = f"{addrs.http}/resp/v1/responses"
    r = requests.post(url, json={"model": "fake", "input": "hi"}, timeout=30)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    kept = client.responses.create(model="fake", input="mine", max_output_tokens=1)
    assert requests.get(f"{url}/{kept.id}", timeout=30).status_code == 401
    assert requests.delete(f"{url}/{kept.id}", timeout=30).status_code == 401
    assert requests.get(f"{url}/{kept.id}/input_items", timeout=30).status_code == 401
    assert client.responses.retrieve(kept.id).id == kept.id  # still there
    bare = f"{addrs.http}/nostore/v1/responses"
    r = requests.post(bare, json={"model": "fake", "input": "hi", "max_output_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "store"
    r = requests.post(bare, json={"model": "fake", "input": "hi", "max_output_tokens": 1, "store": False}, timeout=60)
    assert r.status_code == 200 and r.json()["store"] is False
    assert json.loads(r.text)["output"][0]["content"][0]["text"]
