"""The window's panels: one file each, and one row of `PANELS` (app/window/docks.py), which builds,
docks, tabs and lists it in the View menu.

Every panel is a `Panel`: the window hands it each frame it shows (`show_frame`) and empties it
when another source is shown (`clear`). A panel whose content does not follow the frames (it has
inputs of its own: the capacity planner, the device charts, the lab, the experiments) inherits
`FrameIndependent`, which leaves it as it is."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvscope.app.frames import Frame


@runtime_checkable
class Panel(Protocol):
    def show_frame(self, frame: Frame) -> None:
        """Show what the frame carries (a frame may carry only some of it: keep the rest)."""

    def clear(self) -> None:
        """Show nothing: another source is shown next."""


class FrameIndependent:
    """For a panel whose content does not follow the frames: they leave it as it is."""

    def show_frame(self, frame: Frame) -> None:
        pass

    def clear(self) -> None:
        pass
