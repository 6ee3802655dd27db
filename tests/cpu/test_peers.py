"""Peer-access bookkeeping with a faked driver (CPU): which devices a batch's
memory names, enabling once per context and peer, and the reasons given."""

from __future__ import annotations

import pytest

from kvcopy import testing

from kvcopy.testing import engine

peers = engine.peers
from kvcopy.config import config
from kvcopy.errors import CudaError


class FakePeerDriver:
    def __init__(self, reachable=(1,), count=3):
        self.reachable, self.count, self.enabled = set(reachable), count, []
        self.noted: list[tuple[int, int]] = []

    def note_peer_access(self, ctx, peer):  # (kvcopy._cuda.classify's)
        self.noted.append((ctx, peer))

    def device_count(self):
        return self.count

    def current_context_key(self):
        return 0xC0

    def can_access_peer(self, here, peer):
        return peer in self.reachable

    def enable_peer_access(self, peer):
        if peer == 2:
            raise CudaError(219, "CUDA_ERROR_TOO_MANY_PEERS", "too many peers")
        self.enabled.append(peer)
        return True


@pytest.fixture
def fake(seams):
    driver = FakePeerDriver(reachable=(1, 2))
    seams.enter_context(testing.fake_cuda(driver, ("driver", "classify")))
    peers.forget()
    yield driver
    peers.forget()


def test_peers_of_reads_classify_ordinals(fake):
    assert peers.peers_of((0, 1), 0) == [1]
    assert peers.peers_of((-1, 1), 1) == []
    assert peers.peers_of((-2, -1), 0) == [1, 2]  # several devices: every other one


def test_peer_access_is_enabled_once_per_context_and_peer(fake):
    assert peers.enable_for(0, [1]) is True
    assert peers.enable_for(0, [1]) is False
    assert fake.enabled == [1]
    assert fake.noted == [(0xC0, 1)]  # the classifier now treats device 1's memory as reachable


def test_access_enabled_by_the_application_counts_too(fake):
    fake.enable_peer_access = lambda peer: False  # CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
    assert peers.enable_for(0, [1]) is True and fake.noted == [(0xC0, 1)]


def test_a_failure_to_enable_is_logged_not_raised(fake, caplog):
    assert peers.enable_for(0, [2]) is False
    assert "could not be enabled" in caplog.text and fake.noted == []
    assert "could not be enabled" in peers.why_unreachable(0, [2])


def test_disabled_setting_enables_nothing(fake, monkeypatch):
    config.enable_peer_access = False
    assert peers.enable_for(0, [1]) is False and fake.enabled == []
    assert "enable_peer_access is False" in peers.why_unreachable(0, [1])


def test_reasons_name_the_missing_piece(fake, monkeypatch):
    fake.reachable = set()
    assert "cuDeviceCanAccessPeer is 0" in peers.why_unreachable(0, [1])
    fake.reachable = {1}
    peers.enable_for(0, [1])
    assert "cuMemSetAccess" in peers.why_unreachable(0, [1])


def test_enable_peer_access_setting_is_checked(monkeypatch):
    with pytest.raises(TypeError, match="enable_peer_access must be True or False"):
        config.enable_peer_access = "yes"
    with pytest.raises(ValueError, match="peer_ctas must be at least 1"):
        config.peer_ctas = 0
