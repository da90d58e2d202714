"""``megazero.offload.host_resident.HostResident``: weights held in host memory between uses."""

from __future__ import annotations

import pytest
import torch

from megazero.offload.host_resident import HostResident


def test_weights_come_back_exactly_and_leave_no_device_bytes():
    """Two views of one storage and a separate tensor: the host copy holds each storage once;
    outside ``on_device`` the storages hold 0 bytes (the shapes stay); inside, the values are the
    originals bit for bit; an exception in the block still frees them."""
    flat = torch.randn(10, dtype=torch.float32, device="cpu")
    a, b = flat[:4].view(2, 2), flat[4:]
    c = torch.randn(3, dtype=torch.float64, device="cpu")
    want = [a.clone(), b.clone(), c.clone()]
    held = HostResident([a, b, c], torch.device("cpu"))
    assert held.nbytes == 10 * 4 + 3 * 8 and not held.pinned
    assert all(t.untyped_storage().nbytes() == 0 for t in (a, b, c)) and a.shape == (2, 2)
    for _ in range(2):
        with held.on_device():
            assert all(torch.equal(t, w) for t, w in zip((a, b, c), want))
    assert flat.untyped_storage().nbytes() == 0
    with pytest.raises(ValueError), held.on_device():
        raise ValueError("inside")
    assert not held.resident and c.untyped_storage().nbytes() == 0
