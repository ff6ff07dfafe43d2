"""Reading the colour of a block's cell off a real rendering of the pool view."""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import QPointF
from PySide6.QtGui import QImage


def grab_pool(pool) -> QImage:
    return pool.plot.grab().toImage().convertToFormat(QImage.Format_RGB32)


def cell_pixel(pool, image: QImage, block: int, dx: float = 0.0, dy: float = 0.0):
    """RGB at a point of a block's cell, (dx, dy) in cells from its centre."""
    x, y = pool.cell_center(block)
    scene = pool.plot.plotItem.vb.mapViewToScene(QPointF(x + dx, y + dy))
    p = pool.plot.mapFromScene(scene)
    ratio = image.devicePixelRatio()
    c = image.pixelColor(int(p.x() * ratio), int(p.y() * ratio))
    return c.red(), c.green(), c.blue()


def lut_rgb(code: int, lut: np.ndarray) -> tuple[int, int, int]:
    return tuple(int(v) for v in lut[code, :3])


def close(a, b, tol: int = 6) -> bool:
    return all(abs(int(x) - int(y)) <= tol for x, y in zip(a, b, strict=True))
