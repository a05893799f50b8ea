"""What a split host's parent hands its children: the settings whole, ports no one else has, and
which fronts listen."""

from __future__ import annotations

import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.config import ServerSettings
from router.errors import ConfigError
from router.host.front_main import listening_socket
from router.host.handover import ListeningFronts, hold_port, read_settings, write_settings


def test_the_settings_cross_whole_and_readable_by_the_user_only(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    settings = ServerSettings(port=9000, grpc_port=0, host="::1", max_headers=20, api_keys="k1,k2", workers=2)
    path = tmp_path / "settings.json"
    write_settings(settings, path)
    monkeypatch.setenv("MODEL_ROUTER_GRPC_PORT", "8001")  # the environment is not read again
    assert read_settings(path) == settings
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_unreadable_settings_are_a_config_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    path.write_text('{"port": "many"}', encoding="utf-8")
    with pytest.raises(ConfigError, match="settings.json"):
        read_settings(path)


@pytest.fixture(params=[False, True], ids=["plain", "reuseport"])
def taken(request: pytest.FixtureRequest) -> Iterator[int]:
    """A port another server listens on, with or without SO_REUSEPORT."""
    with socket.socket() as sock:
        if request.param:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_a_port_another_server_listens_on_is_refused_naming_it(taken: int) -> None:
    with pytest.raises(ConfigError, match=f"MODEL_ROUTER_GRPC_PORT: cannot listen on 127.0.0.1:{taken}"):
        hold_port("127.0.0.1", taken, "MODEL_ROUTER_GRPC_PORT")


def test_a_held_port_is_shared_by_the_fronts_and_by_no_one_else() -> None:
    with hold_port("127.0.0.1", 0, "port") as holder:
        port = int(holder.getsockname()[1])
        with listening_socket("127.0.0.1", port), socket.socket() as stranger, pytest.raises(OSError):  # a front joins
            stranger.bind(("127.0.0.1", port))


def test_the_host_listens_once_every_front_has_and_stays_so(tmp_path: Path) -> None:
    fronts, other = ListeningFronts(tmp_path / "listening", 2), ListeningFronts(tmp_path / "listening", 2)
    fronts.mark(1)
    assert not fronts.all_listening() and not other.all_listening()
    other.mark(2)
    assert fronts.all_listening() and other.all_listening()
    (tmp_path / "listening" / "front-2").unlink()  # a front's later restart leaves readiness alone
    assert fronts.all_listening()
