"""Each case of a GPU suite run (tests/ops) as a pytest test of its own.

A suite runs many cases in one process per rank (a process per case would initialise shmem on
every rank for each) and prints a line per case, then a summary:

    [PASS] name (6.4 s): detail
    [FAIL] name (0.3 s): rank 1: what differed
    [SKIP] name: reason
    (not applicable here, not run: name: reason; name: reason)
    N passed, M failed

A test module describes its runs (Run: the suite's command, its -k, the cases it must report) and
parametrizes a test with params(runs) and the conftest fixture `suite_case`: one test per case,
`<run id>::<case>`, and one per run, `<run id>::suite_exit`. The fixture runs each run once per
session for the cases of it that the session selected, and check() reports one test from that
output (the tests run only where a GPU is visible):

  <case>      passes on [PASS]; fails on [FAIL] with its line and the output around it, on [SKIP]
              (a GPU case skipped while a GPU is visible), and where the run did not report it,
              saying why (not applicable here, the suite ended or was killed before it) with the
              run's last lines. Its time in the suite becomes the user property suite_seconds
              (conftest makes it the test's call duration; the run itself counts in the set-up of
              the run's first test).
  suite_exit  fails when the run was killed at its timeout, ended without its summary line or
              with one that disagrees with its case lines, exited non-zero with no failed case (or
              zero with one), or reported a case that is not one of the run's.
"""

import dataclasses
import re

import pytest

RUN_CASE = "suite_exit"
CASE_LINE = re.compile(r"^\[(PASS|FAIL|SKIP)\] (\S+)(?: \((\d+(?:\.\d+)?) s\))?(?:: ?(.*))?$")
SUMMARY_LINE = re.compile(r"^(\d+) passed, (\d+) failed$")
NOT_APPLICABLE_LINE = "(not applicable here, not run: "
TAIL_CHARS = 4000


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a suite: `id` (its tests' id prefix), `argv` (the suite script and its arguments
    but -k), `cases` (the names it must report, in order), `ks` (its -k; empty: every case), `env`
    (((name, value), ...) set for it) and `timeout` (seconds)."""

    id: str
    argv: tuple
    cases: tuple
    ks: tuple = ()
    env: tuple = ()
    timeout: int = 1800

    def command(self, selected):
        """The suite's arguments for the cases of `selected` (names): the run's own -k, unless
        they are some but not all of its cases: then a -k each (a -k selects the names containing
        it, so a few other cases of the run may come along)."""
        chosen = [n for n in self.cases if n in selected]
        ks = chosen if chosen and len(chosen) < len(self.cases) else self.ks
        return [*self.argv, *(a for k in ks for a in ("-k", k))]


@dataclasses.dataclass(frozen=True)
class SuiteCase:
    """A test's parameter: case `name` of `run` (RUN_CASE: the run as a whole)."""

    run: Run
    name: str


def params(runs):
    """pytest parameters for runs: every case of each run, then the run as a whole."""
    return [pytest.param(SuiteCase(r, n), id=f"{r.id}::{n}") for r in runs for n in (*r.cases, RUN_CASE)]


@dataclasses.dataclass
class Case:
    status: str  # PASS, FAIL or SKIP
    seconds: object  # float, or None where the line gives none ([SKIP])
    detail: str
    around: str  # its line and the output between the previous case's line and the next one's


class Outcome:
    """What one run of a suite printed: `cmd` (as shown), `rc` (exit code; None: killed at its
    `timeout`), `out` (stdout and stderr together)."""

    def __init__(self, cmd, rc, out, timeout):
        self.cmd, self.rc, self.out, self.timeout = cmd, rc, out, timeout
        lines = out.splitlines()
        at = [(i, m) for i, m in ((i, CASE_LINE.match(s.rstrip())) for i, s in enumerate(lines)) if m]
        self.cases = {}
        for j, (i, m) in enumerate(at):
            start = at[j - 1][0] + 1 if j else 0
            end = at[j + 1][0] if j + 1 < len(at) else len(lines)
            around = "\n".join(lines[start:end])
            self.cases.setdefault(m.group(2), Case(m.group(1), float(m.group(3)) if m.group(3) else None,
                                                   m.group(4) or "", around[-TAIL_CHARS:]))
        summaries = [m for m in (SUMMARY_LINE.match(s.rstrip()) for s in lines) if m]
        self.summary = (int(summaries[-1].group(1)), int(summaries[-1].group(2))) if summaries else None
        self.not_applicable = {}
        for s in lines:
            if s.startswith(NOT_APPLICABLE_LINE):
                inner = s.rstrip()[len(NOT_APPLICABLE_LINE):]
                inner = inner[:-1] if inner.endswith(")") else inner
                for part in inner.split("; "):
                    name, _, why = part.partition(": ")
                    self.not_applicable[name] = why

    @property
    def tail(self):
        return f"$ {self.cmd}\n" + self.out[-TAIL_CHARS:]

    def count(self, status):
        return sum(1 for c in self.cases.values() if c.status == status)

    def run_problems(self, run):
        """What is wrong with the run as a whole, one line each; empty where nothing is."""
        problems = []
        if self.rc is None:
            problems.append(f"still running after {self.timeout} s: killed")
        elif self.summary is None:
            problems.append(f"exit {self.rc} without the summary line \"N passed, M failed\"")
        else:
            passed, failed = self.count("PASS"), self.count("FAIL")
            if self.summary != (passed, failed):
                problems.append(f"its summary says {self.summary[0]} passed, {self.summary[1]} failed; its case "
                                f"lines {passed} and {failed}")
            if (self.rc != 0) != (failed > 0):
                problems.append(f"exit {self.rc} with {failed} failed case(s)")
        others = [n for n in self.cases if n not in run.cases]
        if others:
            problems.append("it reported cases that are not the run's: " + ", ".join(others))
        return problems

    def why_not_reported(self, name):
        if name in self.not_applicable:
            why = f"the suite found it not applicable here: {self.not_applicable[name]}"
        elif self.rc is None:
            why = f"the suite was still running after {self.timeout} s and was killed before it finished"
        elif self.summary is None:
            why = f"the suite ended (exit {self.rc}) before it"
        else:
            why = f"the suite ran to its end (exit {self.rc}) without it"
        return f"{name}: not reported, {why}\n{self.tail}"


def verdict(outcome, case):
    """(passed, message, seconds in the suite or None) of test `case` (a SuiteCase) of `outcome`."""
    if case.name == RUN_CASE:
        problems = outcome.run_problems(case.run)
        return not problems, "\n".join(problems) + ("\n" + outcome.tail if problems else ""), None
    c = outcome.cases.get(case.name)
    if c is None:
        return False, outcome.why_not_reported(case.name), None
    if c.status == "PASS":
        return True, c.detail, c.seconds
    if c.status == "SKIP":
        return False, f"{case.name}: the suite skipped it on a GPU machine: {c.detail}\n$ {outcome.cmd}", c.seconds
    return False, f"{case.name} failed: {c.detail}\n--- the suite's output up to the next case ---\n$ {outcome.cmd}\n" + \
        c.around, c.seconds


def check(outcome, case, record_property):
    """Reports test `case` of `outcome`: records its suite time (suite_seconds), fails with the
    message of verdict() unless it passed."""
    ok, message, seconds = verdict(outcome, case)
    if seconds is not None:
        record_property("suite_seconds", seconds)
    if not ok:
        pytest.fail(message, pytrace=False)
