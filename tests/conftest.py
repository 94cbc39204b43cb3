from __future__ import annotations

import os

import pytest
import torch

# Tests lower every graph afresh and leave the user's cache alone; tests of the cache set their own directory.
os.environ["AOT2ONNX_CACHE_DIR"] = "off"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
