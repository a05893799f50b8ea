"""The pytest plugin the router installs (entry point `pytest11`): the `plugin_contract` fixture.

    def test_my_plugin_keeps_the_contract(plugin_contract):
        plugin_contract("my-model", options={"threshold": 0.5})

It runs `router.plugin_kit.check_plugin` with the test's `tmp_path` as the default model store
and turns a broken contract into a test failure that names the step and the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

__all__ = ["plugin_contract"]


@pytest.fixture
def plugin_contract(tmp_path: Path) -> Callable[..., Any]:
    from router.plugin_kit import ContractFailure, check_plugin  # imported when used: pytest starts as fast as before

    def run(name: str, **kwargs: Any) -> Any:
        kwargs.setdefault("store", tmp_path)
        try:
            return check_plugin(name, **kwargs)
        except ContractFailure as exc:
            pytest.fail(str(exc), pytrace=False)

    return run
