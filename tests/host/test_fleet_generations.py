"""A split host's fronts hold the fleet as the engine last described it (`Models`), swapped whole,
and know which generation of the fleet it is: a description older than the one a front holds is
not taken (it would bring back a model or a pipeline the fleet no longer has)."""

from __future__ import annotations

from pathlib import Path

from router.host.messages import Models
from router.serving.facade import Serving
from router.serving.verbs import DeletePipeline, PutModel, PutPipeline
from tests.test_request_rules import _split_host, ask

FLEET = """
models:
  m: {plugin: scripted, options: {fixed_ms: 1}}
"""


async def test_a_front_takes_each_change_with_its_generation_and_never_an_older_fleet(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(FLEET, encoding="utf-8")
    async with _split_host(path, tmp_path) as client:
        start = client._generation
        assert start > 0 and client.model_names() == ["m"]
        await client.call(PutModel("n", {"plugin": "scripted"}, "test"))
        added = client._generation
        assert added > start and sorted(client.model_names()) == ["m", "n"]
        await client.call(PutPipeline("p", {"steps": [{"model": "n"}]}, "test"))
        piped = client._generation
        assert piped > added and [plan.name for plan in client.pipelines()] == ["p"]

        client._on_message(Models((), generation=added))  # late news of the fleet before the pipeline
        assert client._generation == piped
        assert sorted(client.model_names()) == ["m", "n"] and [plan.name for plan in client.pipelines()] == ["p"]

        await client.call(DeletePipeline("p"))
        assert client._generation > piped and client.pipelines() == []
        assert (await Serving(client).submit("n", ask("after"))).output["id"] == "after"
