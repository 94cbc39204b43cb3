"""The browser demo (js/demo/, `make demo-web`): headless Chromium opens the page with the exported moons
classifier, the page trains it with onnxruntime-web, and the screenshot shows the loss curve falling.
Slow (a browser, 300 steps); `make test-browser` runs it. Skips, saying why, without node, js/node_modules or
Chromium."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(pathlib.Path(__file__).parent))
from export_for_web import export  # noqa: E402
from test_js_trainer import CHROMIUM, NODE, _browser_missing  # noqa: E402

LINE = (0xD6, 0x33, 0x6C)  # the loss curve's colour in js/demo/demo.mjs

pytestmark = [pytest.mark.slow, pytest.mark.skipif(_browser_missing() is not None, reason=str(_browser_missing()))]


def _read_png(path: pathlib.Path) -> np.ndarray:
    """The pixels of an 8-bit RGB or RGBA, non-interlaced PNG (what Chromium writes) as [height, width, channels]."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, chunks = 8, {}
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunks.setdefault(kind, []).append(data[pos + 8:pos + 8 + length])
        pos += 12 + length
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"][0])
    assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
    bpp = 3 if color == 2 else 4
    raw = np.frombuffer(zlib.decompress(b"".join(chunks[b"IDAT"])), np.uint8).reshape(height, 1 + width * bpp)
    out = np.zeros((height, width * bpp), np.int64)
    prev = np.zeros(width * bpp, np.int64)
    for y in range(height):
        kind, row = raw[y, 0], raw[y, 1:].astype(np.int64)
        if kind == 0:
            cur = row
        elif kind == 1:
            cur = np.cumsum(row.reshape(width, bpp), axis=0).reshape(-1) % 256
        elif kind == 2:
            cur = (row + prev) % 256
        else:  # Average and Paeth depend on the pixel just decoded: one byte at a time
            cur = row.copy()
            for i in range(width * bpp):
                a = cur[i - bpp] if i >= bpp else 0
                b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
                if kind == 3:
                    cur[i] = (row[i] + (a + b) // 2) % 256
                else:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    cur[i] = (row[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) % 256
        out[y], prev = cur, cur
    return out.reshape(height, width, bpp)[..., :3].astype(np.uint8)


def test_demo_page_trains_and_plots_a_falling_loss(tmp_path):
    export(tmp_path / "artifact")
    shot = tmp_path / "demo.png"
    run = subprocess.run([NODE, "js/test/demo-screenshot.mjs", str(tmp_path / "artifact"), "--out", str(shot)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "CHROMIUM": CHROMIUM})
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["state"] == "done", result["status"]
    losses = result["losses"]
    assert len(losses) == 300 and np.mean(losses[-30:]) < 0.25 * np.mean(losses[:10]), losses
    if os.environ.get("AOT2ONNX_KEEP_SCREENSHOT"):
        shutil.copy(shot, os.environ["AOT2ONNX_KEEP_SCREENSHOT"])

    # The screenshot: the curve is drawn, and where it starts (left) it is higher than where it ends (right).
    pixels = _read_png(shot).astype(np.int64)
    curve = (np.abs(pixels - np.array(LINE)).max(axis=-1) < 40)
    ys, xs = np.nonzero(curve)
    assert len(xs) > 500, f"the loss curve is missing from the screenshot ({len(xs)} pixels of its colour)"
    left, right = xs.min(), xs.max()
    assert right - left > 500, "the curve does not span the plot"
    span = (right - left) // 10
    start, end = ys[xs < left + span].mean(), ys[xs > right - span].mean()
    assert end - start > 100, f"the curve's first tenth is at y={start:.0f}, its last at y={end:.0f}: it does not fall"
    assert (np.abs(pixels - 255).max(axis=-1) > 0).mean() > 0.05, "the page is blank"
