"""GPU tests: skipped (with the reason) where no CUDA device of compute capability >= 8.0 is."""

import pytest
import torch


def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (GPU tests run on the H200 machine)"
    cc = torch.cuda.get_device_capability(0)
    if cc < (8, 0):
        return f"GPU compute capability {cc[0]}.{cc[1]} < 8.0"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_reason()
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _usual_kernels_after_flag_tests():
    """After a test that built its kernels with other nvcc flags (helpers.late_arrival_build), the
    usual kernels again (monkeypatch, set up after this fixture, has restored the environment)."""
    yield
    from .helpers import FLAGS_CHANGED

    if FLAGS_CHANGED:
        from jitmarlin.ops import _kernels as K

        K.clear_kernel_caches()
        FLAGS_CHANGED.clear()
