"""Deprecated import path: use `router.sdk`. Kept for plugins written against 0.1; removed in 0.3."""

import warnings

from router.sdk.plugin import *  # noqa: F403
from router.sdk.plugin import __all__  # noqa: F401

warnings.warn("router.plugin is deprecated; import from router.sdk instead", DeprecationWarning, stacklevel=2)
