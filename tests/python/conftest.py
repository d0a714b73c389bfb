import os
import pathlib
import secrets
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
# The tests mirror the package in sub-folders; their shared helpers (engine_models, server_harness,
# reference_sampler, gen_support_table) live here, and the op cases and references in ops/backend_ops:
# both importable from every folder.
HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "ops")]


def data_dir() -> pathlib.Path:
    """Real test data (models, vocabularies, templates): TALLOW_TEST_DATA, default ../shared/data."""
    return pathlib.Path(os.environ.get("TALLOW_TEST_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture
def shared_data() -> pathlib.Path:
    d = data_dir()
    if not d.is_dir():
        pytest.skip(f"real test data not found at {d} (set TALLOW_TEST_DATA)")
    return d


@pytest.fixture
def rng(request) -> np.random.Generator:
    """Fresh random inputs every run; the seed is printed on failure so a run can be repeated
    with TALLOW_TEST_SEED=<seed>."""
    seed = int(os.environ.get("TALLOW_TEST_SEED", secrets.randbits(32)))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules whose reference models (transformers on CPU torch) are tiny: torch's thread pool only
    costs time there (20x on a loaded 2-core box). Use with pytestmark = pytest.mark.usefixtures(...)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def scripted(tmp_path):
    """scripted(**config) -> a server on a scripted engine (server_harness.Scripted); every one made is
    stopped afterwards. (Here, not in server/conftest.py: a second conftest module would shadow this one
    for the tests that import data_dir from it.)"""
    from server_harness import Scripted

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
