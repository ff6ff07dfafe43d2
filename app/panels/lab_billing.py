"""The Lab panel's prompt-cache billing (kvscope.lab.billing): a TTL (off: the miss-ratio run)
and the prices, a preset filling plain numbers the user edits; once run, the cost against TTL
on the panel's plot, the prefixes that cost or saved most in a table, and the bill in words."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QHBoxLayout,
    QLabel,
    QSpinBox,
    QTableWidgetItem,
    QWidget,
)

from kvscope.app.panels.result_view import result_table
from kvscope.app.plots.billing import draw_cost_curve
from kvscope.lab import billing

PREFIX_COLUMNS = ("prefix tokens", "writes", "hits", "paid", "saving $", "first request")
TOP_PREFIXES = 50
PRICE_FIELDS = (("input", "input $/M", "C: $ per million input tokens"),
                ("write", "write ×", "w: a cache write costs w x C"),
                ("read", "read ×", "r: a cache read costs r x C"),
                ("output", "output $/M", "$ per million output tokens"))


class BillingControls(QWidget):
    """TTL seconds (0: off) and the prices."""

    def __init__(self, parent=None):
        super().__init__(parent)
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        self.ttl = QSpinBox(minimum=0, maximum=7 * 86400, value=0, suffix=" s")
        self.ttl.setSpecialValueText("off")
        self.ttl.setToolTip("Prompt-cache billing: a cached block expires this long after its "
                            "last use, on the trace's clock (off: the miss-ratio run)")
        self.preset = QComboBox()
        self.preset.addItems(billing.PRESETS)
        self.preset.setToolTip(f"Fills the numbers beside it ({billing.PRESETS_SOURCE})")
        self.fields: dict[str, QDoubleSpinBox] = {}
        row.addWidget(QLabel("TTL"))
        row.addWidget(self.ttl)
        row.addWidget(self.preset)
        for name, label, tip in PRICE_FIELDS:
            box = QDoubleSpinBox(minimum=0, maximum=1e4, decimals=3)
            box.setToolTip(tip)
            self.fields[name] = box
            row.addWidget(QLabel(label))
            row.addWidget(box)
        self.min_tokens = QSpinBox(minimum=0, maximum=10**7)
        self.min_tokens.setToolTip("The shortest prompt prefix that is cached (tokens)")
        row.addWidget(QLabel("min"))
        row.addWidget(self.min_tokens)
        row.addStretch(1)
        self.preset.currentTextChanged.connect(self.fill)
        self.fill(self.preset.currentText())

    def fill(self, preset: str) -> None:
        prices, _ = billing.PRESETS[preset]
        for name, box in self.fields.items():
            box.setValue(getattr(prices, name))
        self.min_tokens.setValue(prices.min_tokens)

    def ttl_s(self) -> float:
        return float(self.ttl.value())

    def prices(self) -> billing.Prices:
        return billing.Prices(**{n: b.value() for n, b in self.fields.items()},
                              min_tokens=self.min_tokens.value())


class BillView:
    """The table of prefixes, and what a bill draws and says."""

    def __init__(self):
        self.table = result_table(PREFIX_COLUMNS)
        self.table.hide()

    def show(self, plot_item, bill: billing.Bill, points: list[tuple[float, float]]) -> str:
        draw_cost_curve(plot_item, points, bill.cost_without_cache)
        p = bill.prices
        top = sorted(bill.prefixes, key=lambda x: -abs(x.saving(p)))[:TOP_PREFIXES]
        self.table.setRowCount(len(top))
        for i, x in enumerate(top):
            values = (f"{x.start_token:,}–{x.end_token:,}", f"{x.writes:,}", f"{x.hits:,}",
                      "yes" if x.paid(p) else "no", f"{x.saving(p):,.4f}", str(x.first_request))
            for j, text in enumerate(values):
                item = QTableWidgetItem(text)
                item.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
                self.table.setItem(i, j, item)
        self.table.show()
        return bill_text(bill)


def bill_text(bill: billing.Bill) -> str:
    return (f"${bill.cost:,.4f} with prompt caching, ${bill.cost_without_cache:,.4f} without; "
            f"tokens written {bill.written_tokens:,}, read {bill.read_tokens:,}, uncached "
            f"{bill.uncached_tokens:,}; hit ratio {bill.request_hit_ratio:.1%} of requests, "
            f"{bill.token_hit_ratio:.1%} of tokens.\n{billing.verdict(bill)}.")
