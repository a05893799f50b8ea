"""Routing a name's requests between its versions, once for every front (`VersionRouter`)."""

from router.routing.versions import FALLBACK_MIN_S, VersionRouter, is_version_fault

__all__ = ["FALLBACK_MIN_S", "VersionRouter", "is_version_fault"]
