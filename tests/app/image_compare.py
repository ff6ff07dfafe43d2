"""Reference screenshots with a tolerance, in the manner of pyqtgraph's image tests.

A failed comparison saves the rendered image and an amplified diff under tests/artifacts/.
Regenerate the references with:  KVSCOPE_UPDATE_SCREENSHOTS=1 .venv/bin/python -m pytest tests/app
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PySide6.QtGui import QImage

REFERENCE_DIR = Path(__file__).resolve().parent / "reference"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
PIXEL_TOLERANCE = 48  # per channel: anti-aliasing and font hinting differences
MAX_DIFFERING_FRACTION = 0.005  # share of pixels allowed beyond PIXEL_TOLERANCE
UPDATE = os.environ.get("KVSCOPE_UPDATE_SCREENSHOTS") == "1"


def to_array(image: QImage) -> np.ndarray:
    """[height, width, 3] uint8 in R, G, B order."""
    image = image.convertToFormat(QImage.Format_RGBA8888)
    h, w = image.height(), image.width()
    data = np.frombuffer(image.constBits(), dtype=np.uint8, count=image.sizeInBytes())
    return data.reshape(h, image.bytesPerLine() // 4, 4)[:, :w, :3].copy()


def from_array(rgb: np.ndarray) -> QImage:
    h, w, _ = rgb.shape
    rgba = np.dstack([rgb, np.full((h, w), 255, np.uint8)]).astype(np.uint8)
    return QImage(rgba.tobytes(), w, h, 4 * w, QImage.Format_RGBA8888).copy()


def assert_matches_reference(image: QImage, name: str) -> None:
    reference = REFERENCE_DIR / f"{name}.png"
    ARTIFACTS.mkdir(exist_ok=True)
    image.save(str(ARTIFACTS / f"{name}.png"))
    if UPDATE or not reference.exists():
        REFERENCE_DIR.mkdir(exist_ok=True)
        assert image.save(str(reference))
        if not UPDATE:
            raise AssertionError(f"no reference for {name}: wrote {reference}; check it in")
        return
    got, want = to_array(image), to_array(QImage(str(reference)))
    assert got.shape == want.shape, f"{name}: size {got.shape} != reference {want.shape}"
    diff = np.abs(got.astype(np.int16) - want.astype(np.int16)).max(axis=2)
    bad = float((diff > PIXEL_TOLERANCE).mean())
    if bad > MAX_DIFFERING_FRACTION:
        from_array(np.minimum(diff * 4, 255).astype(np.uint8)[..., None].repeat(3, 2)).save(
            str(ARTIFACTS / f"{name}.diff.png"))
        raise AssertionError(f"{name}: {bad:.2%} of pixels differ from {reference} by more than "
                             f"{PIXEL_TOLERANCE}; see tests/artifacts/{name}.png and .diff.png")
