"""What the parent of a split host hands its children, and what the fronts tell each other.

- The settings: the parent resolves them once (environment and command-line flags, the port it
  holds, the number of fronts) and writes that one object to its run directory; the engine and
  every front read it back (`--settings PATH`) instead of resolving their own from what the
  parent happened to pass on. A flag therefore reaches every process, the ones added later too.
- The ports: `hold_port` binds a port for the fronts to share, after checking that no other
  process has it: with SO_REUSEPORT a second server of the same user could otherwise join the
  port silently and take a share of its connections.
- The listeners: each front marks itself listening once its HTTP and gRPC sockets are; the host
  is ready (`ListeningFronts.all_listening`) only when every front has been.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from router.config import ServerSettings
from router.errors import ConfigError

__all__ = ["ListeningFronts", "hold_port", "read_settings", "write_settings"]


def write_settings(settings: ServerSettings, path: Path) -> None:
    """`settings` as JSON at `path`, readable by this user only (it holds the keys)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        file.write(settings.model_dump_json())


def read_settings(path: Path) -> ServerSettings:
    """The settings the parent resolved; the environment is not read again."""
    try:
        return ServerSettings.model_validate_json(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not the settings of a split host: {exc}") from None


def hold_port(host: str, port: int, setting: str) -> socket.socket:
    """A socket bound to `host:port` with SO_REUSEPORT that never listens (the fronts' sockets
    do), so the port stays this host's while a front restarts. ConfigError naming `setting` if
    another process has the port, whether or not it set SO_REUSEPORT itself."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if port:  # an exclusive bind first: it fails on any socket that listens there
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections in TIME_WAIT do not count
            _bind(probe, host, port, setting)
    holder = socket.socket(family, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        _bind(holder, host, port, setting)
    except ConfigError:
        holder.close()
        raise
    return holder


def _bind(sock: socket.socket, host: str, port: int, setting: str) -> None:
    try:
        sock.bind((host, port))
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot listen on {host}:{port}: {exc.strerror or exc}; another process has "
                          f"the port: stop it or choose another port") from None


class ListeningFronts:
    """The fronts of one host that have started listening: a file each in `directory`. Once all
    `count` have, it stays so: a front that restarts later leaves its share to the others."""

    def __init__(self, directory: Path, count: int) -> None:
        self.directory = directory
        self.count = count
        self._all = False

    def mark(self, front: int) -> None:
        """Front `front` listens on every port it serves."""
        self.directory.mkdir(exist_ok=True)
        (self.directory / f"front-{front}").touch()

    def all_listening(self) -> bool:
        if not self._all:
            self._all = all((self.directory / f"front-{i}").exists() for i in range(1, self.count + 1))
        return self._all
