"""A TCP proxy in front of a test server (the moto S3 server) that can be switched, mid-run, to act out
an outage: ``forward`` (healthy), ``stall`` (connections are accepted and read, never answered: a hung
endpoint) or ``refuse`` (new connections are closed at once: an endpoint that is gone)."""

from __future__ import annotations

import select
import socket
import threading

from tests.conftest import free_port


class OutageProxy:
    """Listens on 127.0.0.1:``port`` and forwards to ``target_port`` while :attr:`mode` is ``forward``."""

    def __init__(self, target_port: int):
        self.target_port, self.port, self.mode = target_port, free_port(), "forward"
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._stopped = threading.Event()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def switch(self, mode: str) -> None:
        """Change what happens to traffic from now on; open connections are cut so clients reconnect."""
        assert mode in ("forward", "stall", "refuse"), mode
        self.mode = mode
        for connection in list(self._open):
            connection.close()

    def close(self) -> None:
        self._stopped.set()
        self._listener.close()
        self.switch("refuse")

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.mode == "refuse":
                client.close()
                continue
            self._open.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = None
        try:
            if self.mode == "forward":
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
                self._open.append(upstream)
            while not self._stopped.is_set():
                ready, _, _ = select.select([client] + ([upstream] if upstream else []), [], [], 0.2)
                for source in ready:
                    data = source.recv(65536)
                    if not data:
                        return
                    if source is client and upstream is not None and self.mode == "forward":
                        upstream.sendall(data)
                    elif source is upstream:
                        client.sendall(data)
                    # stall: what the client sends is read and dropped; nothing ever comes back
        except (OSError, ValueError):  # a socket switch() closed: fileno -1, which select refuses with ValueError
            return
        finally:
            for connection in (client, upstream):
                if connection is not None:
                    connection.close()
                    if connection in self._open:
                        self._open.remove(connection)
