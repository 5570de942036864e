"""KUnit results from a guest console (KTAP as the kernel prints it at boot)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# "    ok 3 test_merge_keeps_zero" / "not ok 1 page_zeroed" (any indentation)
RESULT_RE = re.compile(r"^\s*(not ok|ok) \d+ (\S+)(?:\s+#\s*(\w+))?")
SUITE_RE = re.compile(r"^\s*# (\S+): pass:(\d+) fail:(\d+) skip:(\d+) total:(\d+)")


@dataclass
class KunitResults:
    suites: dict[str, dict[str, int]] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    # cases that skipped, with the reason they gave
    skipped: dict[str, str] = field(default_factory=dict)
    # what a failed case printed before its result ("EXPECTATION FAILED at ...")
    diagnostics: dict[str, list[str]] = field(default_factory=dict)

    @property
    def passed(self) -> int:
        return sum(s["pass"] for s in self.suites.values())

    @property
    def ok(self) -> bool:
        return bool(self.suites) and not self.failed and all(
            s["fail"] == 0 for s in self.suites.values())


# KTAP structure lines, which are not what a case said
HEADER_RE = re.compile(r"^\s*(KTAP version \d+|1\.\.\d+|# Subtest: |# module: )")
# lines a failed case keeps: the last of what it printed
DIAGNOSTIC_LINES = 20


def parse(lines: list[str]) -> KunitResults:
    res = KunitResults()
    said: list[str] = []  # since the last result line
    for raw in lines:
        # strip a printk timestamp "[    0.123456] "
        line = re.sub(r"^\[\s*\d+\.\d+\]\s?", "", raw)
        m = SUITE_RE.match(line)
        if m and m.group(1) != "Totals":
            res.suites[m.group(1)] = {"pass": int(m.group(2)), "fail": int(m.group(3)),
                                      "skip": int(m.group(4)), "total": int(m.group(5))}
            said = []
            continue
        if m:
            continue
        m = RESULT_RE.match(line)
        if not m:
            if line.strip() and not HEADER_RE.match(line):
                said.append(line.strip())
            continue
        if (m.group(3) or "").upper() == "SKIP":
            res.skipped[m.group(2)] = line.split("#", 1)[1].strip()[4:].strip()
        elif m.group(1) == "not ok":
            res.failed.append(m.group(2))
            if said:
                res.diagnostics[m.group(2)] = said[-DIAGNOSTIC_LINES:]
        said = []
    return res
