"""ResponseStore deployment: the Responses API's stored responses, shared by every Router replica.

Owns: ``/v1/responses`` records kept for ``store: true`` (OpenAI's default) — the response object
``GET /v1/responses/{id}`` answers and the conversation a response naming it as
``previous_response_id`` continues — in memory, bounded by count and by characters
(``http.stored_responses``, ``http.stored_response_chars``), least recently used out first. One
replica (the records live in it), no CPUs of its own: a dictionary behind a handle. A restart or
redeploy forgets every record: a later ``previous_response_id`` naming one is 400, as for one that
never existed.
Ignores: what a response is (``cluster.api.responses_api_output``), auth (the Router checks it).
"""
from __future__ import annotations

from collections import OrderedDict

from ray import serve


class StoredResponses:
    """The bounded LRU itself (no Ray: tested directly)."""

    def __init__(self, max_responses: int, max_chars: int) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self._records: OrderedDict[str, tuple[dict, int]] = OrderedDict()
        self.chars = 0

    def __len__(self) -> int:
        return len(self._records)

    def put(self, response_id: str, record: dict, chars: int) -> None:
        if self.max_responses == 0:
            return
        self.delete(response_id)
        self._records[response_id] = (record, chars)
        self.chars += chars
        while len(self._records) > 1 and (len(self._records) > self.max_responses or self.chars > self.max_chars):
            _, (_, gone) = self._records.popitem(last=False)
            self.chars -= gone

    def get(self, response_id: str) -> dict | None:
        if response_id not in self._records:
            return None
        self._records.move_to_end(response_id)
        return self._records[response_id][0]

    def delete(self, response_id: str) -> bool:
        if response_id not in self._records:
            return False
        _, chars = self._records.pop(response_id)
        self.chars -= chars
        return True


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class ResponseStore:
    def __init__(self, max_responses: int, max_chars: int) -> None:
        self.store = StoredResponses(max_responses, max_chars)

    async def put(self, response_id: str, record: dict, chars: int) -> None:
        self.store.put(response_id, record, chars)

    async def get(self, response_id: str) -> dict | None:
        return self.store.get(response_id)

    async def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)
