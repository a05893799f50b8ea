"""The rule for tests that need a real program: skip with the reason, except under CI."""

from __future__ import annotations

import pytest

from tests.tools import require_program


def test_a_missing_program_skips_with_its_package_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="Debian package 'prometheus'.*scripts/test-tools.sh"):
        require_program("no-such-program-here", "prometheus")


def test_under_ci_a_missing_program_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true and no-such-program-here is not installed"):
        require_program("no-such-program-here", "chromium")
