"""``m3_torch.staging``: several arrays to the device in one copy (on the CPU and the meta device here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from m3_torch.staging import ALIGN, HostRing, packed_layout, upload


def mixed_arrays():
    rng = np.random.default_rng(0)
    block_table = rng.integers(-5, 1000, (7, 9)).astype(np.int32)
    return [rng.random(5, dtype=np.float32), None, rng.integers(0, 2**40, 3).astype(np.int64),
            np.zeros((0, 4), np.int32), block_table[:, ::2],   # non-contiguous
            np.array(7, np.int16), rng.random((2, 3)).astype(np.float16), np.array([True, False, True])]


def test_upload_round_trips_aligned_views():
    arrays = mixed_arrays()
    offsets, total = packed_layout(arrays)
    assert total % ALIGN == 0 and all(o % ALIGN == 0 for o in offsets if o is not None)
    out = upload(arrays, "cpu")
    assert out[1] is None
    storages = {t.untyped_storage().data_ptr() for t in out if t is not None}
    assert len(storages) == 1   # one buffer
    for a, t, o in zip(arrays, out, offsets):
        if a is None:
            continue
        assert t.dtype == torch.from_numpy(np.empty(0, a.dtype)).dtype and tuple(t.shape) == a.shape
        assert t.storage_offset() * t.element_size() == o and t.is_contiguous()
        np.testing.assert_array_equal(t.numpy(), a)
    arrays[0][:] = -1   # the caller's arrays are copied
    assert (out[0] >= 0).all()


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_upload_of_nothing(device):
    empty, none = upload([np.zeros((2, 0), np.float32), None], device)
    assert none is None and tuple(empty.shape) == (2, 0) and empty.dtype == torch.float32
    assert upload([], device) == []


def test_upload_on_meta_keeps_offsets():
    """``m3_torch.ops.record_variants`` stages on the meta device: the same views, 16-byte aligned."""
    arrays = mixed_arrays()
    offsets, _ = packed_layout(arrays)
    for a, t, o in zip(arrays, upload(arrays, "meta"), offsets):
        if a is not None:
            assert t.is_meta and tuple(t.shape) == a.shape and t.storage_offset() * t.element_size() == o


def test_upload_rejects_other_types():
    with pytest.raises(TypeError, match=r"arrays\[1\]: expected a numpy array or None, got list"):
        upload([np.zeros(2, np.int32), [1, 2]], "cpu")
    with pytest.raises(TypeError, match=r"arrays\[0\].*got complex64"):
        upload([np.zeros(2, np.complex64)], "cpu")


class FakeEvent:
    """Stands for ``torch.cuda.Event``: records and synchronizes, in a shared log."""

    def __init__(self, log):
        self.log, self.recorded = log, False

    def record(self, stream=None):
        self.recorded = True

    def synchronize(self):
        self.log.append(("synchronize", self.recorded))


def test_host_ring_waits_for_a_slots_copy_before_handing_it_out_again():
    log = []
    ring = HostRing(2, pin_memory=False, new_event=lambda: FakeEvent(log))
    first, _, first_event = ring.take(100)
    first_event.record()
    second, _, second_event = ring.take(10)
    assert second is not first and second_event is not first_event
    log.clear()
    again, _, event = ring.take(50)
    assert log == [("synchronize", True)] and event is first_event   # the first copy waited for
    assert again is first   # reused: big enough, no new allocation
    grown, _, _ = ring.take(5000)   # the second slot, grown
    assert grown is not second and grown.numel() >= 5000
