"""The environment each torch rank gets keeps gloo's and NCCL's sockets on loopback for a local
job (NCCL's bootstrap would otherwise listen on an external interface)."""

from __future__ import annotations

from nbdist.engine import hardware
from nbdist.engine.backends import torch_ddp


def test_local_job_keeps_gloo_and_nccl_on_loopback(monkeypatch):
    monkeypatch.setattr(torch_ddp, "_loopback_interface", lambda: "lo")
    assert torch_ddp.socket_ifnames("127.0.0.1", {}, None) == {
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
    }
    assert torch_ddp.socket_ifnames("127.0.0.1", {"NCCL_SOCKET_IFNAME": "ib0"}, None) == {
        "GLOO_SOCKET_IFNAME": "lo"
    }


def test_multi_host_job_sets_gloo_only(monkeypatch):
    monkeypatch.setattr(hardware, "interface_of", lambda a: {"10.0.0.2": "eth1"}[a])
    assert torch_ddp.socket_ifnames("10.0.0.1", {}, "10.0.0.2") == {"GLOO_SOCKET_IFNAME": "eth1"}
    assert torch_ddp.socket_ifnames("10.0.0.1", {}, None) == {}


def test_loopback_interface_is_found():
    assert torch_ddp._loopback_interface() == "lo"
