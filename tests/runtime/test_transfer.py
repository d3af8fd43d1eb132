"""Host arrays reach the device through staging memory filled in place (gpu_workers.transfer):
the values, their dtypes and the 16-byte alignment of each uploaded segment survive."""

import numpy as np
import pytest
import torch

from gpu_workers.transfer import to_device, upload

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_upload_keeps_every_segment_aligned_and_exact(device):
    parts = [np.arange(5, dtype=np.int32), np.array([], dtype=np.int32),
             np.array([7, -1, 3], dtype=np.int64), np.full(9, 2, dtype=np.int32)]
    views = upload(parts, device)
    assert [v.dtype for v in views] == [torch.int32] * 4
    for part, view in zip(parts, views, strict=True):
        assert view.device.type == device.type
        assert view.cpu().tolist() == part.tolist()
        assert view.data_ptr() % 16 == 0


@pytest.mark.parametrize("device", DEVICES)
def test_to_device_keeps_dtype_and_shape_and_owns_its_copy(device):
    array = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]  # not contiguous
    out = to_device(array, device)
    assert out.dtype == torch.int64 and tuple(out.shape) == (3, 2)
    array[0, 0] = 100  # the caller may reuse its array at once
    assert out.cpu().tolist() == [[0, 2], [4, 6], [8, 10]]
    values = np.array([0.5, 1.5], dtype=np.float32)
    floats = to_device(values, device)
    values[:] = 0
    assert floats.dtype == torch.float32 and floats.cpu().tolist() == [0.5, 1.5]
