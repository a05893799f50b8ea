"""The real programs some tests run (Debian's prometheus, promtool and chromium): found, or the
test skips with the reason printed; under CI (CI=true) such a skip is a failure instead."""

from __future__ import annotations

import os
import shutil

import pytest

__all__ = ["require_program"]


def require_program(name: str, package: str) -> str:
    """The program's path, or skip (fail under CI) saying which Debian package brings it."""
    if path := shutil.which(name):
        return path
    reason = (f"{name} is not installed (Debian package {package!r}); `make test` installs it when run as root "
              "with apt-get (scripts/test-tools.sh)")
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true and {reason}")
    pytest.skip(reason)
