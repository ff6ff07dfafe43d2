"""The timeline's KV-groups plot (a mixin of Timeline): for a model with several KV-cache groups,
the blocks requests hold in each group after each step, and the blocks a sliding window released
during the step (StepRecord.group_blocks, window_freed_blocks). A run with one group has neither
the plot nor its entry in the plots menu, and pays nothing per frame."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg

from kvscope.engine.kv_groups import KVGroup
from kvscope.engine.metrics import StepRecord

# Okabe-Ito colours the timeline's other plots do not use for blocks
GROUP_COLORS = ("#0072b2", "#e69f00", "#56b4e9", "#f0e442", "#000000")
FREED_COLOR = "#009e73"  # the cached green: released blocks stay cached
GROUPS_TIP = ("Blocks held by requests in each KV-cache group after each step (each group has "
              "its own block tables, all drawn from one pool), and the blocks a sliding window "
              "released during the step: they stay cached, and hit, until evicted")


class GroupLines:
    """The KV-groups plot of a Timeline (its `_plot`, `_own_series`, `_add_step_lines`,
    `time_plot`, `series`, `_lay_out_plots`; `num_groups` is SeriesPlots')."""

    def _init_groups(self) -> None:
        self.group_plot = self._plot("groups", "by group", GROUPS_TIP)
        self.group_plot.setXLink(self.time_plot)
        self.group_names: list[str] = []  # the groups' names, from the snapshots' groups
        self.group_short: list[str] = []  # and in fewer words, for the readout
        self.group_held = np.zeros((0, 1))  # [step, group]: blocks held, after the step
        self.window_freed = np.zeros(0)  # [step]: blocks released out of a window in the step

    def _clear_groups(self) -> None:
        self.group_held, self.window_freed = np.zeros((0, 1)), np.zeros(0)
        self._set_num_groups(1)

    def name_groups(self, groups: tuple[KVGroup, ...]) -> None:
        """The names the legend and the readout give the groups' lines."""
        names = [g.name for g in groups]
        if len(names) > 1 and names != self.group_names:
            self.group_names = names
            self.group_short = ["full" if g.window is None else f"window {g.window}"
                                for g in groups]
            self._name_lines()

    def _add_group_records(self, records: list[StepRecord]) -> None:
        tuples = [r.group_blocks for r in records]
        width = max(self.group_held.shape[1], *map(len, tuples))
        rows = np.array([t + (0,) * (width - len(t)) for t in tuples], dtype=np.float64)
        held = self.group_held
        if width > held.shape[1]:
            held = np.pad(held, ((0, 0), (0, width - held.shape[1])))
        self.group_held = np.concatenate([held, rows.reshape(len(records), width)])
        self.window_freed = np.concatenate(
            [self.window_freed, np.array([r.window_freed_blocks for r in records], np.float64)])
        if width > self.num_groups:
            self._set_num_groups(width)

    def _set_num_groups(self, n: int) -> None:
        """Lines for n groups (and the freed one) where n > 1; the plot and its menu entry
        are offered only then."""
        offered, self.num_groups = self.num_groups > 1, n
        for g in range(n if n > 1 else 0):
            if f"group{g}" not in self.series:
                self._own_series(f"group{g}", self.group_plot,
                                 GROUP_COLORS[g % len(GROUP_COLORS)], "",
                                 legend_order=self._legend_place())
        if n > 1 and "freed" not in self.series:
            self._own_series("freed", self.group_plot, FREED_COLOR, "")
            self._add_step_lines(self.group_plot)
            self.set_cursor(self._cursor_step)
        for name, s in self.series.items():
            if s.plot == "groups":
                shown = name == "freed" or int(name[5:]) < n
                for item in s.items:
                    item.setVisible(shown and n > 1)
                s.visible = shown
        self._name_lines()
        if offered != (n > 1):
            self._lay_out_plots()

    def _legend_place(self) -> int:
        """Where a group's line goes in the legend: after the groups' lines made already,
        before the freed one."""
        names = list(self.series)
        return names.index("freed") if "freed" in names else len(names)

    def _name(self, g: int, short: bool = False) -> str:
        names = self.group_short if short else self.group_names
        return names[g] if g < len(names) else f"group {g}"

    def _name_lines(self) -> None:
        for g in range(self.num_groups if self.num_groups > 1 else 0):
            self.set_series_label(f"group{g}", f"{self._name(g)} held")
        if "freed" in self.series:
            self.set_series_label("freed", "freed by the window")

    def _group_lines(self) -> list[tuple[pg.PlotDataItem, np.ndarray]]:
        """(curve, values per step) of the KV-groups plot's lines; none with one group."""
        if self.num_groups < 2:
            return []
        lines = [(self.series[f"group{g}"].items[0], self.group_held[:, g])
                 for g in range(self.num_groups)]
        return [*lines, (self.series["freed"].items[0], self.window_freed)]

    def _groups_readout(self, i: int) -> str:
        """The KV-groups plot's values at sample i, while it is shown."""
        if self.num_groups < 2 or "groups" not in self.shown_plots:
            return ""
        held = ", ".join(f"{self._name(g, short=True)}: {int(self.group_held[i, g])}"
                         for g in range(self.num_groups))
        return f" · held {held} · window freed {int(self.window_freed[i])}"
