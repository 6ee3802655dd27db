"""kvcopy.testing's seams put back what they changed, on leaving and on an error."""
from __future__ import annotations

import pytest

import kvcopy
from kvcopy import testing


def test_settings_hold_for_the_block_and_are_put_back_after_an_error():
    before = kvcopy.config.launch_bytes
    with pytest.raises(RuntimeError):
        with testing.settings(launch_bytes=4096):
            assert kvcopy.config.launch_bytes == 4096
            raise RuntimeError("inside")
    assert kvcopy.config.launch_bytes == before
    with pytest.raises(ValueError, match="launch_bytes"):
        with testing.settings(launch_bytes=-1):
            pass
    assert kvcopy.config.launch_bytes == before


def test_fake_cuda_reaches_every_user_of_a_layer_and_leaves_none_behind():
    real = testing.cuda.driver
    users = [testing.engine.dispatch, testing.engine.decide, testing.engine.ring,
             testing.engine.context]
    fake = object()
    with testing.fake_cuda(fake, ("driver",)):
        assert all(module.driver is fake for module in users)
    assert all(module.driver is real for module in users)
    with pytest.raises(ValueError, match="no layer"):
        with testing.fake_cuda(fake, ("drivers",)):
            pass
