"""A held port: nothing else can bind it until it is closed, but a rank's TCPStore can."""

from __future__ import annotations

import errno
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from rltrain.ports import HeldPort


def _plain_bind(port: int) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_a_held_port_refuses_other_binds_and_is_free_after_close():
    held = HeldPort("127.0.0.1")
    with pytest.raises(OSError) as refused:
        _plain_bind(held.port)
    assert refused.value.errno == errno.EADDRINUSE
    held.close()
    _plain_bind(held.port)


def test_port_zero_binds_never_get_a_held_port():
    with HeldPort() as held:
        given = set()
        for _ in range(2000):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                given.add(sock.getsockname()[1])
        assert held.port not in given


@pytest.mark.parametrize("use_libuv", [True, False])
def test_rank_zeros_tcp_store_binds_the_held_port_and_serves(use_libuv):
    with HeldPort("127.0.0.1") as held:
        timeout = timedelta(seconds=10)
        server = dist.TCPStore(
            "127.0.0.1",
            held.port,
            2,
            is_master=True,
            wait_for_workers=False,
            timeout=timeout,
            use_libuv=use_libuv,
        )
        client = dist.TCPStore(
            "127.0.0.1", held.port, 2, is_master=False, timeout=timeout, use_libuv=use_libuv
        )
        server.set("rank0", "ready")
        assert client.get("rank0") == b"ready"
        del client, server
