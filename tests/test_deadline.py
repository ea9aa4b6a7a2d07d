"""``deadline.py``: at ``CVE_DEADLINE`` a run that has not answered writes ``timeout``, its ranks are
killed and it exits 0; an answer written before is kept."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from support import alive

BODY = """
import os, subprocess, sys, time
from complete_verifier_ext import deadline
results = sys.argv[1]
if sys.argv[2] == "answered":
    open(results, "w").write("unsat\\n")
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a 'rank'
print(child.pid, flush=True)
deadline.arm(float(os.environ["CVE_DEADLINE"]), deadline.timeout_answer(lambda: results))
time.sleep(120)  # a stage that never looks at the clock
"""


def test_a_run_past_its_deadline_answers_timeout_and_ends(tmp_path):
    for case, expected in (("silent", "timeout\n"), ("answered", "unsat\n")):
        results = tmp_path / f"{case}.txt"
        env = {**os.environ, "CVE_DEADLINE": repr(time.time() + 2.0)}
        proc = subprocess.Popen([sys.executable, "-c", BODY, str(results), case], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
        out, err = proc.communicate(timeout=100)  # ends at the deadline, not after 120 s
        assert proc.returncode == 0, err
        assert results.read_text() == expected
        assert "timeout: the run had not ended at its deadline" in err
        child, gone = int(out.split()[0]), time.monotonic() + 30
        while alive(child) and time.monotonic() < gone:  # killed; reaped by init shortly after
            time.sleep(0.1)
        assert not alive(child), "the run's child process survived it"
