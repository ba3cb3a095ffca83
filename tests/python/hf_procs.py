"""Worker processes for the framework integration tests, bounded in time.

Proc starts a command in its own session, collects its stdout lines on a thread,
and can wait for a line, SIGKILL the command with its children, or wait for the
end; `procs()` is a context manager that kills whatever is still running when the
test leaves it, pass or fail. The ranks that `accelerate launch` starts (through
torchrun) run in sessions of their own, so a worker prints "pid P" for each, and
kill() SIGKILLs those too.
"""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = sys.executable


def env(**extra):
    """The workers' environment: one thread each, no hub, no progress bars."""
    e = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
             HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
             TRANSFORMERS_VERBOSITY="error")
    e.update(extra)
    return e


class Proc:
    def __init__(self, args, **extra_env):
        self.args = [str(a) for a in args]
        self.err = tempfile.TemporaryFile(mode="w+")
        self.p = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                  env=env(**extra_env), start_new_session=True)
        self.lines = []
        self.pids = []  # ranks in sessions of their own ("pid P" lines)
        self.seen = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.p.stdout:
            m = re.fullmatch(r"pid (\d+)\n?", line)
            if m:
                self.pids.append(int(m.group(1)))
            with self.seen:
                self.lines.append(line.rstrip("\n"))
                self.seen.notify_all()
        with self.seen:
            self.lines.append(None)  # end of output
            self.seen.notify_all()

    def wait_line(self, want, timeout):
        """Blocks until the process printed the line `want`; AssertionError (with its
        output) if it ends or `timeout` seconds pass first."""
        end = time.monotonic() + timeout
        with self.seen:
            while want not in self.lines:
                left = end - time.monotonic()
                if None in self.lines or left <= 0:
                    raise AssertionError(f"never printed {want!r}: {self.report()}")
                self.seen.wait(left)

    def kill(self):
        """SIGKILLs the command's process group and every rank it reported."""
        groups = ([self.p.pid] if self.p.poll() is None else []) + self.pids
        for g in groups:
            try:
                os.killpg(g, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.p.wait()

    def finish(self, timeout, check=True):
        """Waits for the end (SIGKILL at `timeout`); with check, a nonzero exit
        raises AssertionError with the output. Returns the exit code."""
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout} s: {self.report()}") from None
        self.reader.join(timeout=10)
        if check and self.p.returncode != 0:
            raise AssertionError(f"exited {self.p.returncode}: {self.report()}")
        return self.p.returncode

    def result(self):
        """The last stdout line as JSON (the workers' report)."""
        lines = [ln for ln in self.lines if ln]
        try:
            return json.loads(lines[-1])
        except (IndexError, ValueError):
            raise AssertionError(f"no JSON report: {self.report()}") from None

    def report(self):
        self.err.seek(0)
        out = "\n".join(ln for ln in self.lines if ln is not None)
        return f"{' '.join(self.args)}\n--- stdout:\n{out[-3000:]}\n--- stderr:\n{self.err.read()[-6000:]}"


@contextlib.contextmanager
def procs():
    """A list to put Procs in; every one still running at the exit is killed."""
    started = []
    try:
        yield started
    finally:
        for p in started:
            p.kill()
