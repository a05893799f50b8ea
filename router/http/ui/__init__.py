"""The operators' live page at /ui: a static page polling /ui/state (see state.py for its data)."""

from router.http.ui.routes import ui_router
from router.http.ui.state import fleet_state

__all__ = ["fleet_state", "ui_router"]
