from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

import aot2onnx

# The suite runs what users run: the persistent cache is on (the default), in a directory of this test
# session's own, so graphs lowered by one test are served to the next from disk as they are to a user's
# second run, and the user's cache is left alone. Tests that need the cache off say so and why.
_CACHE_DIR = tempfile.mkdtemp(prefix="aot2onnx-test-cache-")
os.environ["AOT2ONNX_CACHE_DIR"] = _CACHE_DIR
# The key that authenticates cache entries, in the same directory's keeping: a run needs no writable home.
_SECRET_DIR = tempfile.mkdtemp(prefix="aot2onnx-test-secret-")
os.environ["AOT2ONNX_CACHE_SECRET_FILE"] = os.path.join(_SECRET_DIR, "cache-secret")
atexit.register(shutil.rmtree, _SECRET_DIR, ignore_errors=True)
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _scoped_user_lowerings():
    # A test's register_lowering calls end with it (rules registered when a test module is imported stay).
    with aot2onnx.scoped_lowerings():
        yield


@pytest.fixture
def cache_off(monkeypatch):
    """For tests that count lowerings or sessions a cache hit would skip."""
    monkeypatch.setenv("AOT2ONNX_CACHE_DIR", "off")


@pytest.fixture
def two_threads():
    """torch, and so ONNX Runtime's sessions, on two threads for the test (the thread trial, races)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)
