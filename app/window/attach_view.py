"""What the window adds while it shows an attached server (or a recording of one): the pool
titled as hash slots (and each tier below the GPU's: pool_host), a note saying why, the server's
KV groups (kind, window, resident blocks) under it, a click on a cell of any tier described by
the live mirror (the server's hash, the tiers holding it), the mirror's health in the status bar,
and per-step series on the timeline (blocks stored and removed, preemptions, KV usage, TTFT and
ITL from the server's metrics). The panels themselves are not changed. File → Attach…'s dialog:
attach_dialog.py."""

from __future__ import annotations

import bisect
import html

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QLabel

from kvscope.app import palette
from kvscope.app.frames import Frame
from kvscope.app.panels.pool_host import host_line, lower_cell
from kvscope.app.panels.pool_text import TITLE_TIP
from kvscope.engine import events as ev
from kvscope.sessions.kv_events.slots import ATTACH_PREFIX, group_lines

SLOTS_NOTE = ("A cell is a block hash the server holds, not a physical block (their ids are "
              "not published); darker = stored earlier")
HEALTHY, WAITING, UNHEALTHY = "#1a7f37", "#b06f00", palette.EVICTED_COLOR  # green, amber, red
# the timeline's own series that mean nothing for an attached server, and what others mean there
ENGINE_ONLY = ("prefill", "decode", "tokens", "active")
ATTACH_LABELS = {"cached": "resident (cached)", "free": "free slots",
                 "hit": "hit % (metrics)"}
# what the timeline's plots show for an attached server (their tooltips)
ATTACH_TIPS = {
    "time": "TTFT and ITL from the server's metrics (an attached server publishes no forward "
            "times)",
    "tokens": "Blocks the server stored (green) and removed (vermilion) in each step, from its "
              "KV events; preemptions (dashed, from its metrics)",
    "blocks": "Resident blocks (green: the block hashes the server holds) and free hash slots "
              "(grey) after each step",
    "hit": "KV usage and prefix-cache hit rate, from the server's metrics"}
POOL_TIP = ("Hash slots: each cell is a block hash the server holds (resident) or an empty slot; "
            "physical block ids are not published")


def is_attached(source) -> bool:
    """The source shows an attached server: live, or a recording of one."""
    if source.attached:
        return True
    try:
        return str(source.settings().get("model") or "").startswith(ATTACH_PREFIX)
    except Exception:  # noqa: BLE001 - a source that cannot say is not attached
        return False


class HealthLabel(QLabel):
    """The mirror's health, always in the status bar: green when nothing was missed; a click
    shows every line in Details."""

    clicked = Signal()

    def mousePressEvent(self, event) -> None:  # noqa: N802 - Qt API
        self.clicked.emit()
        super().mousePressEvent(event)

    def show_health(self, short: str, lines: list[str], ok: bool | None) -> None:
        """ok: nothing missed (green); None: nothing arrived yet (amber); False: something was
        missed (red)."""
        self.setText({True: "● ", None: "○ ", False: "▲ "}[ok] + short)
        color = {True: HEALTHY, None: WAITING, False: UNHEALTHY}[ok]
        self.setStyleSheet(f"color: {color}; padding: 0 4px")
        self.setToolTip("Mirror health (click for details):\n" + "\n".join(lines))


class AttachOverlay:
    """What the window adds while it shows an attached server; inactive otherwise."""

    def __init__(self, window):
        self.w = window
        self.active = False
        self.note = QLabel(SLOTS_NOTE)
        self.note.setWordWrap(True)
        self.note.setStyleSheet("color: #555555; padding: 1px 4px")
        self.note.hide()
        self.groups = QLabel()  # the server's KV groups, one line each
        self.groups.setStyleSheet("color: #333333; padding: 1px 4px")
        self.groups.setToolTip("The server's KV-cache groups (vLLM's group_idx), with the kind "
                               "and sliding window its BlockStored events name, and the hash "
                               "slots each holds now")
        self.groups.hide()
        self.health = HealthLabel()
        self.health.hide()
        self.health.clicked.connect(self.show_details)
        window.selection.blocks_changed.connect(self._describe_slots)
        window.selection.host_blocks_changed.connect(self._describe_tier_slot)
        self.curves = {  # name -> (plot, colour, dashed, legend label), on the timeline
            "stored": ("tokens", palette.CACHED_COLOR, False, "stored blocks"),
            "removed": ("tokens", palette.EVICTED_COLOR, False, "removed blocks"),
            "preemptions": ("tokens", "#000000", True, "preemptions"),
            "ttft": ("time", "#0072b2", False, "TTFT ms (metrics)"),
            "itl": ("time", palette.DECODE_COLOR, True, "ITL ms (metrics)"),
            "kv_usage": ("hit", "#7f3fbf", False, "KV usage % (metrics)"),
            "hit_rate": ("hit", palette.CACHED_COLOR, True, "hit % (SGLang gauge)"),
        }
        for name, (plot, color, dashed, label) in self.curves.items():
            window.timeline.add_series(name, plot, color, label, dashed=dashed, visible=False)
        self.clear()

    def clear(self) -> None:
        self.data = {name: ([], []) for name in self.curves}
        for name in self.curves:
            self.w.timeline.set_series(name, [], [])

    # --------------------------------------------------------------- source
    def set_source(self, source) -> None:
        """Called after the panels were cleared for a new source."""
        self.clear()
        self.active = is_attached(source)
        self.note.setVisible(self.active)
        self.groups.setVisible(self.active)
        self.groups.clear()
        if self.active:
            self.w.pool.set_terms("hash slot", "darker = stored earlier")
        else:
            self.w.pool.set_terms()
        self.w.pool.title.setToolTip(POOL_TIP if self.active else TITLE_TIP)
        self.health.setVisible(source.attached)
        if source.attached:  # its problems in the banner, until they no longer hold
            source.on_problem = self._problem
            source.on_resolved = self._resolved
        tl = self.w.timeline
        for name in self.curves:
            tl.show_series(name, self.active)
        # an attached server publishes no prefill/decode split, tokens or batches: only the
        # blocks it holds, and its metrics
        for name in ENGINE_ONLY:
            tl.show_series(name, not self.active)
        tl.show_batch_axis(not self.active)
        for name, label in ATTACH_LABELS.items():
            tl.set_series_label(name, label if self.active else None)
        tl.set_axis_label("tokens", "per step" if self.active else None)
        for plot, tip in ATTACH_TIPS.items():
            tl.set_plot_tip(plot, tip if self.active else None)
        tl.set_readout(self.readout if self.active else None)
        tl.require_plots(("tokens",) if self.active else ())  # where stored/removed are drawn

    def _banner_text(self, problem: str) -> str:
        return f"Attached to {self.w.source.name}: {problem}"

    def _problem(self, problem: str) -> None:
        self.w.banner.show_error(self._banner_text(problem))

    def _resolved(self, problem: str) -> None:
        banner = self.w.banner
        if banner.isVisible() and banner.label.text() == self._banner_text(problem):
            banner.hide()

    def readout(self, data, i: int, events: list[str]) -> str:
        """The timeline's readout at sample i, in the words of an attached server."""
        step = int(data["step"][i])
        text = (f"step {step} (at {data['start_s'][i] - data['start_s'][0]:.3f} s): stored "
                f"{self._at('stored', step):.0f} · removed {self._at('removed', step):.0f} · "
                f"resident {int(data['cached'][i])} · free slots {int(data['free'][i])}")
        if self._at("preemptions", step):
            text += f" · preemptions {self._at('preemptions', step):.0f}"
        for name, words in (("kv_usage", "KV usage {:.0f} %"), ("ttft", "TTFT {:.1f} ms"),
                            ("itl", "ITL {:.1f} ms"), ("hit_rate", "hit {:.0f} %")):
            value = self._at(name, step, None)
            if value is not None:
                text += " · " + words.format(value)
        return text + "".join(f" · {e}" for e in events)

    def _at(self, name: str, step: int, missing=0):
        """A series' value at a step (missing: none there)."""
        xs, ys = self.data[name]
        i = bisect.bisect_left(xs, step)
        return ys[i] if i < len(xs) and xs[i] == step else missing

    # --------------------------------------------------------------- frames
    def after_frame(self, frame: Frame) -> None:
        if not self.active:
            return
        pool = self.w.pool
        snap = self.w.snapshot
        if snap is not None and pool.title.text().startswith("<b>Block pool</b>"):
            pool.title.setText(f"<b>Hash slots</b> · {snap.medium or 'GPU'}: "
                               f"{snap.num_cached_blocks} resident of {snap.num_blocks} slots · "
                               f"{snap.block_size} tokens per block"
                               + "".join("<br>" + host_line(t) for t in snap.tiers()[1:]))
        if snap is not None:
            self.groups.setText("\n".join(group_lines(snap)))
        if frame.records:
            self._add(frame)
        source = self.w.source
        health = source.health()
        if health is not None:
            self.health.show_health(*health)

    def _add(self, frame: Frame) -> None:
        steps = [r.step for r in frame.records]
        stored = dict.fromkeys(steps, 0)
        removed = dict.fromkeys(steps, 0)
        for e in frame.events:
            if e.kind == ev.CACHED and e.step in stored:
                stored[e.step] += len(e.blocks)
            elif e.kind == ev.UNCACHED and e.step in removed:
                removed[e.step] += len(e.blocks)
        self._extend("stored", steps, list(stored.values()))
        self._extend("removed", steps, list(removed.values()))
        self._extend("preemptions", steps, [r.num_preempted for r in frame.records])
        for step, m in frame.metrics:
            for name, scale in (("ttft", 1e3), ("itl", 1e3), ("kv_usage", 100.0),
                                ("hit_rate", 100.0)):
                if name in m:
                    self._extend(name, [step], [m[name] * scale])
        for name, (x, y) in self.data.items():
            self.w.timeline.set_series(name, x, y)

    def _extend(self, name: str, x: list, y: list) -> None:
        xs, ys = self.data[name]
        xs.extend(x)
        ys.extend(y)

    def _describe_slots(self, blocks) -> None:
        """A click on a cell: what the server holds in that slot (after Details' own text)."""
        source = self.w.source
        if not blocks or not source.attached:
            return
        lines = [source.describe_slot(int(b)) for b in list(blocks)[:20]]
        self.w.details.show_text("Hash slot" + ("s" if len(lines) > 1 else ""),
                                 "<br>".join(html.escape(x) for x in lines))

    def _describe_tier_slot(self, cells) -> None:
        """A click on a cell of a tier below the GPU's: what the server holds there now."""
        source, snap = self.w.source, self.w.snapshot
        found = None if len(cells) != 1 or snap is None else lower_cell(snap, cells[0])
        if found is None or not source.attached:
            return
        tier, block = found
        self.w.details.show_text(f"{tier.medium} hash slot",
                                 html.escape(source.describe_slot(block, tier.medium)))

    def show_details(self) -> None:
        source = self.w.source
        if not source.attached:
            return
        short, lines, ok = source.health()
        self.w.docks["details"].show()
        self.w.docks["details"].raise_()
        self.w.details.help_button.setChecked(False)  # the health lines get its room
        self.w.details.show_text("Mirror health" + ("" if ok else " (something was missed)"),
                                 "<br>".join(html.escape(x) for x in lines + [SLOTS_NOTE]))


