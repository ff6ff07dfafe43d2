"""Axes of the plots drawn here: a fraction reads as a percentage ("40%"), never as a number
under an SI scale ("cached fraction (x0.001)" over 0-900)."""

from __future__ import annotations


def percent_axis(axis, percent: bool) -> None:
    """Ticks of a pyqtgraph AxisItem read "40%" (its values are percentages) or, percent off,
    plain numbers; either way without an SI prefix."""
    axis.enableAutoSIPrefix(False)
    if percent:
        plain = type(axis).tickStrings
        axis.tickStrings = lambda values, scale, spacing: [
            f"{text}%" for text in plain(axis, values, scale, spacing)]
    else:
        axis.__dict__.pop("tickStrings", None)
    axis.picture = None  # the ticks drawn afresh
    axis.update()
