"""`isolation: process` (router/serving/isolation.py) with a real child process: a child that dies
is reaped and reported, its calls fail 503; a child that stops is timed out and then refused at
once, without holding the caller's thread, and is served again once it runs."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from router_testkit.scripted import ScriptedOptions, ScriptedPlugin

from router.errors import ExecutionTimeout, InstanceLost, ModelUnavailable
from router.sdk.plugin import Payload, PluginContext
from router.serving.isolation import RemotePlugin, exit_reason

ASK = Payload(b'{"id": "a"}', "application/json")


@pytest.fixture
def remote(tmp_path: Path) -> Iterator[RemotePlugin]:
    plugin = RemotePlugin(ScriptedPlugin, ScriptedOptions(), PluginContext("m", tmp_path), call_timeout_s=0.5)
    plugin.load("cpu")
    try:
        yield plugin
    finally:
        plugin.unload()


def test_a_child_that_dies_is_reaped_reported_once_and_its_calls_fail_503(remote: RemotePlugin) -> None:
    told: list[str] = []
    remote.on_exit = told.append
    pid = remote.pid
    assert pid is not None and remote.preprocess(ASK) == "a"
    child = psutil.Process(pid)
    child.send_signal(signal.SIGSTOP)  # a call left waiting when it dies
    waiting = remote.start_call("preprocess", ASK)
    child.kill()
    with pytest.raises(InstanceLost) as lost:
        waiting.result(timeout=10)
    assert lost.value.status_code == 503 and lost.value.headers["Retry-After"] == "1"
    assert told == [f"its instance process {pid} died (killed by SIGKILL)"]
    assert not child.is_running(), "left a zombie"
    with pytest.raises(InstanceLost, match="is restarting"):
        remote.preprocess(ASK)
    remote.load("cpu")  # a restart: a fresh child
    assert remote.pid not in (None, pid) and remote.preprocess(ASK) == "a"


async def test_a_stopped_child_is_timed_out_then_refused_at_once_then_served_again(remote: RemotePlugin) -> None:
    pid = remote.pid
    assert pid is not None
    child = psutil.Process(pid)
    child.suspend()
    try:
        with pytest.raises(ExecutionTimeout, match="did not answer preprocess within 0.5 s"):
            await remote.acall("preprocess", ASK)
        await asyncio.sleep(0.1)  # the unanswered call is now older than the call timeout
        with pytest.raises(ModelUnavailable, match="has not answered a call"):
            await remote.acall("preprocess", ASK)
    finally:
        child.resume()
    for _ in range(100):  # once it has answered what it was sent, it is served again
        try:
            assert await remote.acall("preprocess", ASK) == "a"
            break
        except ModelUnavailable:
            await asyncio.sleep(0.05)
    else:
        pytest.fail("the child was not served again after it resumed")


@pytest.mark.parametrize(("returncode", "words"), [(-9, "killed by SIGKILL"), (3, "exit code 3"), (None, "still running")])
def test_exit_reasons_read_as_words(returncode: int | None, words: str) -> None:
    assert exit_reason(returncode) == words
