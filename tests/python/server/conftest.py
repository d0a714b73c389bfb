"""Fixtures shared by the server tests."""
import pytest

from server_harness import Scripted


@pytest.fixture
def scripted(tmp_path):
    """scripted(**config) -> a Scripted server (server_harness); every one made is stopped afterwards."""
    servers = []

    def make(**kw):
        s = Scripted(tmp_path / str(len(servers)), **kw)
        servers.append(s)
        return s

    yield make
    for s in servers:
        if s.srv.engine.is_running:
            s.srv.wait_idle()
        s.stop()
