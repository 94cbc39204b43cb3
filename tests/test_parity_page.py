"""The parity report's HTML page, looked at in a real headless browser (Chromium): it renders, with the verdict box
at the top in the verdict's colours and the error plots drawn.

Skipped where no Chromium is installed (Debian: ``apt-get install chromium``). The screenshot is decoded here (a
PNG reader of a few lines: Pillow is not a dependency) and its pixels are checked for the page's colours.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib

import numpy as np
import pytest
import torch
from onnxscript import opset18 as op

import aot2onnx
import aot2onnx.parity

_BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable") if shutil.which(b)),
                None)
_WIDTH, _HEIGHT = 1280, 1400

# The page's colours (report.py's style sheet and plot.py's).
_VERDICT_BAD_BACKGROUND = (0xFF, 0xEE, 0xEE)
_VERDICT_BAD_BORDER = (0xBB, 0x00, 0x00)
_VERDICT_OK_BACKGROUND = (0xEE, 0xFF, 0xEE)
_PLOT_OWN = (0xFF, 0x7F, 0x0E)
_PLOT_LIMIT = (0xD6, 0x27, 0x28)


def _read_png(data: bytes) -> np.ndarray:
    """An 8-bit RGB or RGBA, non-interlaced PNG as a height x width x 3 array."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
    assert depth == 8 and colour in (2, 6) and interlace == 0, (depth, colour, interlace)
    channels = 3 if colour == 2 else 4
    rows = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, 1 + width * channels)
    image = np.zeros((height, width * channels), dtype=np.uint8)
    previous = np.zeros(width * channels, dtype=np.int64)
    for y in range(height):
        kind, line = rows[y, 0], rows[y, 1:].astype(np.int64)
        if kind == 0:
            current = line
        elif kind == 2:  # up
            current = (line + previous) & 255
        elif kind == 1:  # sub: a running sum per channel
            current = np.cumsum(line.reshape(width, channels), axis=0).reshape(-1) & 255
        else:  # average or Paeth: byte by byte
            got, above = line.tolist(), previous.tolist()
            out = [0] * len(got)
            for x, value in enumerate(got):
                a = out[x - channels] if x >= channels else 0
                b = above[x]
                c = above[x - channels] if x >= channels else 0
                if kind == 3:
                    p = (a + b) // 2
                else:
                    pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                    p = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                out[x] = (value + p) & 255
            current = np.array(out, dtype=np.int64)
        image[y] = current
        previous = current
    return image.reshape(height, width, channels)[:, :, :3]


def _pixels(image: np.ndarray, colour: tuple[int, int, int]) -> np.ndarray:
    """Where ``image`` has ``colour`` (within a little, for anti-aliasing): a boolean mask."""
    return np.abs(image.astype(np.int64) - np.array(colour)).max(-1) <= 6


def _screenshot(page, directory) -> np.ndarray:
    shot = directory / "page.png"
    result = subprocess.run(
        [_BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={directory / 'profile'}",
         f"--window-size={_WIDTH},{_HEIGHT}", f"--screenshot={shot}", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert shot.exists(), f"{_BROWSER} wrote no screenshot (exit {result.returncode}):\n{result.stderr[-2000:]}"
    return _read_png(shot.read_bytes())


def _gelu_off(x, approximate: str = "none"):
    """aten::gelu(Tensor self, *, str approximate='none') -> Tensor, 1e-3 too large."""
    exact = op.Mul(op.Mul(x, op.CastLike(0.5, x)),
                   op.Add(op.CastLike(1.0, x), op.Erf(op.Div(x, op.CastLike(2.0**0.5, x)))))
    return op.Mul(exact, op.CastLike(1.001, x))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


@pytest.mark.skipif(_BROWSER is None, reason="no headless browser: Chromium is not installed (Debian: apt-get "
                                              "install chromium), so the report page cannot be looked at")
@pytest.mark.parametrize("faulty", [True, False], ids=["not_ok", "ok"])
def test_the_report_page_renders_in_a_headless_browser(tmp_path, faulty):
    if faulty:
        aot2onnx.register_lowering(torch.ops.aten.gelu.default)(_gelu_off)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    report = aot2onnx.parity.compare(_model(), (x,))
    assert report.ok is not faulty, report.summary()
    report.save(tmp_path / "report")
    image = _screenshot(tmp_path / "report" / "report.html", tmp_path)
    assert image.shape == (_HEIGHT, _WIDTH, 3)
    assert (image != 255).any(axis=-1).mean() > 0.02, "the page is blank"
    # The verdict box, first thing under the title: its background spans most of the width.
    background = _pixels(image, _VERDICT_BAD_BACKGROUND if faulty else _VERDICT_OK_BACKGROUND)
    rows = np.nonzero(background.sum(axis=1) > _WIDTH // 2)[0]
    assert rows.size and rows[0] < 200, "no verdict box in the verdict's colour at the top of the page"
    if faulty:
        assert _pixels(image[:rows[-1] + 10], _VERDICT_BAD_BORDER).sum() > _WIDTH, "the verdict box has no border"
        assert not _pixels(image, _VERDICT_OK_BACKGROUND).any()
    # The error plots (inline SVG): the tolerance line and the nodes' own errors, drawn.
    assert _pixels(image, _PLOT_LIMIT).sum() > 20, "no plot's tolerance line was drawn"
    assert _pixels(image, _PLOT_OWN).sum() > 20, "no plot's dots were drawn"
