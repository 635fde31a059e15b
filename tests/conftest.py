import pytest
import torch

# One CPU thread: far faster for tiny models on small VMs, and CPU results depend on the thread count.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Put torch back on one thread after a test that changed it (a command run in-process with
    --threads N sets it for the whole worker, and every later test of that worker would pay for it)."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
