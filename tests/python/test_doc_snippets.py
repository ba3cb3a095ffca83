"""Every code block of README.md and docs/*.md runs as written.

Each fenced block is taken from the Markdown by its language tag:
  - python: run in a fresh process in a fresh empty directory, after a prelude that
    defines what the block uses and does not define itself (a tiny `model`, its
    `optimizer`, a `train_step()`, `steps`, ...: PRELUDE below, only the names the
    block needs); a name that neither defines fails the test.
  - sh, bash, console (amber CLI commands and builds): run by bash -euo pipefail in a
    fresh copy of a prepared directory: a store `runs/x` (steps 10-50, imported by the
    CLI), the safetensors files `ckpts/step-10.safetensors` ... it was imported from,
    and `examples/` of this tree; with `amber` (the installed package's CLI) first on
    PATH and, where build/ holds libamber, that build installed into a temporary prefix
    that PKG_CONFIG_PATH and LD_LIBRARY_PATH name (what `make install` gives a user).
  - c: a block with a main() is compiled as it is, against that prefix through
    pkg-config (amber, or amber_mpi for a block that includes amber_mpi.h) with
    -Wall -Wextra -Werror, and run in a fresh empty directory; a block without one is a
    fragment of a training loop, compiled inside a loop of 3 steps with a writer `w` on
    a store and one tensor declared, and must leave the store at step 3.
  - text, cmake: not code; not run.
A block without a language tag fails the test (tag it).

An HTML comment on the line before a block says how to run it:
  <!-- snippet: skip (why) -->      not run; the reason is required and reported
  <!-- snippet: twice (why) -->     run again in the same directory: the second run must
                                     resume, writing no new step into any store
  <!-- snippet: ranks N (why) -->   under torchrun --standalone --nproc-per-node N
                                     (python) or mpirun -np N (c)
Nothing is skipped silently: skips are pytest skips with the Markdown's reason, and the
module prints what ran, what was skipped and why, and what is not code.

The blocks run two at a time (AMBER_SNIPPET_JOBS), started when the first test needs
one; AMBER_BUILD names another build directory than build/."""
import ast
import builtins
import concurrent.futures
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import PYTHON, ROOT

DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/docs/*.md"))
BUILD = os.environ.get("AMBER_BUILD") or os.path.join(ROOT, "build")
BIN = os.path.dirname(PYTHON)  # the environment's scripts: amber, torchrun
JOBS = int(os.environ.get("AMBER_SNIPPET_JOBS", "2"))
TIMEOUT = 300
RUN = {"python": "python", "sh": "sh", "bash": "sh", "console": "sh", "c": "c"}
NOT_CODE = {"text", "cmake"}

FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
CLOSE = re.compile(r"^\s*```\s*$")
MARK = re.compile(r"^\s*<!--\s*snippet:\s*(.*?)\s*-->\s*$")
DIRECTIVE = re.compile(r"^(skip|twice|ranks\s+(\d+))\s*(?:\((.+)\))?$")


@dataclass
class Block:
    doc: str
    line: int        # of the opening fence, 1-based
    lang: str
    code: str
    skip: str = None  # the reason
    twice: bool = False
    ranks: int = 0
    problem: str = None  # a malformed marker or tag

    @property
    def id(self):
        return f"{self.doc}:{self.line}:{self.lang or 'untagged'}"

    @property
    def kind(self):
        return RUN.get(self.lang)


def parse(doc):
    lines = open(os.path.join(ROOT, doc), encoding="utf-8").read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.groups()
        j = i + 1
        while j < len(lines) and not CLOSE.match(lines[j]):
            j += 1
        code = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln
                         for ln in lines[i + 1:j]) + "\n"
        b = Block(doc, i + 1, lang.lower(), code)
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mark = MARK.match(lines[k]) if k >= 0 else None
        if mark:
            d = DIRECTIVE.match(mark.group(1))
            if not d:
                b.problem = f"unknown snippet marker {mark.group(1)!r}"
            elif d.group(1) == "skip":
                b.skip = d.group(3)
                if not b.skip:
                    b.problem = "a skip needs its reason: <!-- snippet: skip (why) -->"
            elif d.group(1) == "twice":
                b.twice = True
            else:
                b.ranks = int(d.group(2))
        if not b.lang:
            b.problem = "a code block without a language tag (python, sh, c, text, ...)"
        elif b.kind is None and b.lang not in NOT_CODE:
            b.problem = f"language {b.lang!r} is neither run nor known as not code"
        out.append(b)
        i = j + 1
    return out


BLOCKS = [b for doc in DOCS for b in parse(doc)]
RUNNABLE = [b for b in BLOCKS if b.kind or b.problem]


# -- the Python prelude ------------------------------------------------------------------
# name -> (code, names it needs first, code run after the block). Only the entries a
# block uses (and their dependencies) are put before it.
PRELUDE = {
    "torch": ("import torch", (), None),
    "Checkpointer": ("from amber.torch import Checkpointer", (), None),
    "model": ("torch.manual_seed(0)\n"
              "model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), "
              "torch.nn.Linear(64, 16))", ("torch",), None),
    "optimizer": ("optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)", ("model",), None),
    "scheduler": ("scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)",
                  ("optimizer",), None),
    "dataloader": ("dataloader = torch.utils.data.DataLoader(torch.randn(64, 16), batch_size=8)",
                   ("torch",), None),
    "steps": ("steps = 10", (), None),
    "step": ("step = 1", (), None),
    "train_step": ("def train_step(*_):\n"
                   "    \"\"\"One step of training: forward, backward, optimizer.step().\"\"\"\n"
                   "    loss = model(torch.randn(8, 16)).square().mean()\n"
                   "    loss.backward()\n"
                   "    optimizer.step()\n"
                   "    if globals().get('scheduler') is not None:\n"
                   "        scheduler.step()\n"
                   "    optimizer.zero_grad()", ("model", "optimizer"), None),
    "state": ("state = {'model': model, 'optim': optimizer}", ("model", "optimizer"), None),
    "ck": ("ck = Checkpointer('runs/x')", ("Checkpointer",), "ck.close()"),
    "state_dict": ("from torch.distributed.checkpoint.state_dict import get_state_dict\n"
                   "train_step()\n"
                   "_msd, _osd = get_state_dict(model, optimizer)\n"
                   "state_dict = {'model': _msd, 'optim': _osd}",
                   ("model", "optimizer", "train_step"), None),
}


class _Free(ast.NodeVisitor):
    """The names a block reads before it binds them, in the order Python evaluates
    them (an assignment's value before its targets, a loop's iterable before its
    target); names read inside functions, classes and comprehensions count when
    neither they nor the block bind them."""

    def __init__(self):
        self.bound, self.free, self.deferred = set(), set(), set()
        self.scopes = []  # the local names of the functions, classes, comprehensions

    def _bind(self, name):
        (self.scopes[-1] if self.scopes else self.bound).add(name)

    def visit_Name(self, n):
        if not isinstance(n.ctx, ast.Load):
            self._bind(n.id)
        elif any(n.id in s for s in self.scopes):
            pass
        elif self.scopes:
            self.deferred.add(n.id)
        elif n.id not in self.bound:
            self.free.add(n.id)

    def _seq(self, *parts):
        for p in parts:
            for x in (p if isinstance(p, list) else [p]):
                if x is not None:
                    self.visit(x)

    def visit_Assign(self, n):
        self._seq(n.value, n.targets)

    def visit_AugAssign(self, n):
        self._seq(n.value, n.target)

    def visit_AnnAssign(self, n):
        self._seq(n.value, n.target)

    def visit_NamedExpr(self, n):
        self._seq(n.value, n.target)

    def visit_For(self, n):
        self._seq(n.iter, n.target, n.body, n.orelse)

    def visit_With(self, n):
        for item in n.items:
            self._seq(item.context_expr, item.optional_vars)
        self._seq(n.body)

    def visit_Import(self, n):
        for a in n.names:
            self._bind((a.asname or a.name).split(".")[0])

    visit_ImportFrom = visit_Import

    def visit_ExceptHandler(self, n):
        self._seq(n.type)
        if n.name:
            self._bind(n.name)
        self._seq(n.body)

    def visit_arg(self, n):
        self._bind(n.arg)

    def _inner(self, *parts):
        self.scopes.append(set())
        self._seq(*parts)
        self.scopes.pop()

    def visit_FunctionDef(self, n):
        self._seq(n.decorator_list, n.args.defaults, n.args.kw_defaults)
        self._bind(n.name)
        self._inner(n.args, n.body)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, n):
        self._seq(n.decorator_list, n.bases, n.keywords)
        self._bind(n.name)
        self._inner(n.body)

    def visit_Lambda(self, n):
        self._seq(n.args.defaults)
        self._inner(n.args, n.body)

    def visit_ListComp(self, n):
        self.scopes.append(set())
        for g in n.generators:
            self._seq(g.iter, g.target, g.ifs)
        self._seq(getattr(n, "elt", None), getattr(n, "key", None), getattr(n, "value", None))
        self.scopes.pop()

    visit_SetComp = visit_GeneratorExp = visit_DictComp = visit_ListComp


def free_names(code):
    tree = ast.parse(code)
    v = _Free()
    v.visit(tree)
    names = v.free | (v.deferred - v.bound)
    return {n for n in names if not hasattr(builtins, n)} - {"__name__", "__file__"}


def python_program(b):
    """The block with the prelude it needs, or raises naming what nothing defines."""
    free = free_names(b.code)
    unknown = sorted(free - set(PRELUDE))
    if unknown:
        raise AssertionError(f"{b.id}: the block uses {unknown}, which neither it nor the "
                             "prelude defines (PRELUDE in tests/python/test_doc_snippets.py)")
    order, seen = [], set()

    def need(name):
        if name in seen:
            return
        seen.add(name)
        for d in PRELUDE[name][1]:
            need(d)
        order.append(name)
    for name in sorted(free):
        need(name)
    head = "\n".join(PRELUDE[n][0] for n in order)
    tail = "\n".join(PRELUDE[n][2] for n in reversed(order) if PRELUDE[n][2])
    if b.ranks:  # leave without tearing the gloo group down (see tests/python/dist_worker.py)
        tail += "\nimport os as _os, sys as _sys\n_sys.stdout.flush()\n_sys.stderr.flush()\n_os._exit(0)"
    return f"# prelude\n{head}\n# {b.id}\n{b.code}\n# epilogue\n{tail}\n"


# -- the C wrapper of a fragment ---------------------------------------------------------
C_FRAGMENT = """#include <amber.h>
#include <stdint.h>
#include <stdio.h>
static float weights[1024];
static void forward(void) {{}}
static void backward(void) {{}}
static void optimizer_step(void) {{ for (int i = 0; i < 1024; i += 7) weights[i] += 1e-3f; }}
int main(void) {{
  amber_store *st;
  amber_writer *w;
  uint64_t latest = 0;
  if (amber_store_open(&st, "store", NULL) < 0 || amber_writer_open(&w, st, NULL) < 0 ||
      amber_writer_add(w, "weights", AMBER_F32, 1, (int64_t[]){{1024}}, weights, NULL) < 0) {{
    fprintf(stderr, "fragment set-up: %s\\n", amber_last_error(NULL));
    return 1;
  }}
  for (uint64_t step = 1; step <= 3; step++) {{
#line {line} "{doc}"
{code}
  }}
  int rc = amber_writer_wait(w);
  amber_writer_close(w);
  if (rc == 0) rc = amber_store_latest(st, &latest);
  amber_store_close(st);
  if (rc < 0 || latest != 3) {{
    fprintf(stderr, "the fragment left the store at step %llu (rc %d)\\n", (unsigned long long)latest, rc);
    return 1;
  }}
  return 0;
}}
"""


# -- running -----------------------------------------------------------------------------
def run(cmd, cwd, env, timeout=TIMEOUT, **kw):
    """(returncode, output) of `cmd`; on a timeout its whole process group is killed."""
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return 124, out + f"\n[timed out after {timeout} s]"
    return p.returncode, out


def stores(d):
    """{store directory: its LATEST or GLOBAL} of every amber store under d."""
    out = {}
    for root, dirs, files in os.walk(d):
        for f in ("GLOBAL", "LATEST"):
            if f in files and not os.path.basename(root).startswith("rank-"):
                out[os.path.relpath(root, d)] = open(os.path.join(root, f), "rb").read()
                break
    return out


class Snippets:
    """The prepared directory and environment, and the blocks' outcomes."""

    def __init__(self, base):
        self.base = base
        self.env = dict(os.environ)
        for k in ("AMBER_LIBRARY", "PYTHONPATH"):
            self.env.pop(k, None)
        self.env.update(PATH=BIN + os.pathsep + self.env.get("PATH", ""), HF_HUB_OFFLINE="1",
                        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                        OMPI_MCA_rmaps_base_oversubscribe="1")
        self.prefix = self._install()
        self.prep = self._prepare()
        self.futures = {}
        self.selected = set()
        self.lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(JOBS)

    def _install(self):
        """build/ installed into a prefix of its own, as `make install` would."""
        if not os.path.exists(os.path.join(BUILD, "libamber.so")):
            return None
        prefix = os.path.join(self.base, "prefix")
        rc, out = run(["cmake", "--install", BUILD, "--prefix", prefix], ROOT, self.env, 120)
        assert rc == 0, f"cmake --install {BUILD}:\n{out}"
        lib = os.path.join(prefix, "lib")
        self.env["PKG_CONFIG_PATH"] = os.path.join(lib, "pkgconfig")
        self.env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (lib, self.env.get("LD_LIBRARY_PATH")) if p)
        return prefix

    def _prepare(self):
        """ckpts/step-N.safetensors for N = 10..50, imported into the store runs/x."""
        prep = os.path.join(self.base, "prepared")
        os.makedirs(os.path.join(prep, "ckpts"))
        os.makedirs(os.path.join(prep, "runs"))  # amber import creates the store, not its parents
        rng = np.random.default_rng(0)
        t = {"model.weight": rng.standard_normal((64, 64), dtype=np.float32),
             "model.bias": rng.standard_normal(64, dtype=np.float32),
             "optim.exp_avg_sq": rng.random((64, 64), dtype=np.float32)}
        for step in range(10, 51, 10):
            t = {k: v + np.float32(1e-3) * (rng.random(v.shape, dtype=np.float32) < 0.1)
                 for k, v in t.items()}
            f = os.path.join(prep, "ckpts", f"step-{step}.safetensors")
            save_file(t, f)
            rc, out = run(["amber", "import", f, "runs/x", "--step", str(step)], prep, self.env, 60)
            assert rc == 0, out
        os.symlink(os.path.join(ROOT, "examples"), os.path.join(prep, "examples"))
        return prep

    def start(self, blocks):
        """Submits the blocks not yet running, the slow kinds first."""
        with self.lock:
            todo = [b for b in blocks if b.id not in self.futures]
            todo.sort(key=lambda b: (-(b.ranks or 0), b.kind != "python", -b.twice))
            for b in todo:
                self.futures[b.id] = self.pool.submit(self.run_block, b)

    def outcome(self, b):
        self.start([b])
        return self.futures[b.id].result()

    def fresh(self, b, copy_prepared):
        d = tempfile.mkdtemp(prefix=re.sub(r"\W", "_", b.id) + "-", dir=self.base)
        if copy_prepared:
            shutil.rmtree(d)
            shutil.copytree(self.prep, d, symlinks=True)
        return d

    def run_block(self, b):
        """(ok, what happened) of block b."""
        try:
            return getattr(self, f"_run_{b.kind}")(b)
        except AssertionError as e:
            return False, str(e)

    def _run_python(self, b):
        d = self.fresh(b, False)
        with open(os.path.join(d, "snippet.py"), "w") as f:
            f.write(python_program(b))
        cmd = [PYTHON, "snippet.py"]
        if b.ranks:
            cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(b.ranks), "snippet.py"]
        rc, out = run(cmd, d, self.env)
        if rc != 0:
            return False, f"exited {rc} in {d}:\n{out}"
        if b.twice:
            first = stores(d)
            if not first:
                return False, f"the first run left no amber store in {d} to resume from:\n{out}"
            rc, out2 = run(cmd, d, self.env)
            if rc != 0:
                return False, f"the second run exited {rc} in {d}:\n{out2}"
            again = stores(d)
            if again != first:
                return False, (f"the second run did not resume: it changed the stores "
                               f"{first} -> {again} in {d}:\n{out2}")
            out += "\n[second run]\n" + out2
        return True, out

    def _run_sh(self, b):
        needs_build = re.search(r"\b(cc|pkg-config|mpirun|mpicc)\b", b.code)
        if needs_build and not self.prefix:
            return None, f"no {BUILD}/libamber.so: `make test-c` (or `make`) builds it"
        if "amber_mpi" in b.code and not os.path.exists(
                os.path.join(self.prefix, "lib", "pkgconfig", "amber_mpi.pc")):
            return None, f"{BUILD} has no amber_mpi.pc: libamber_mpi is built where CMake finds MPI"
        d = self.fresh(b, True)
        code = b.code
        if b.lang == "console":
            code = "\n".join(ln[2:] for ln in code.split("\n") if ln.startswith("$ "))
        with open(os.path.join(d, "snippet.sh"), "w") as f:
            f.write(code)
        rc, out = run(["bash", "-euo", "pipefail", "snippet.sh"], d, self.env)
        return rc == 0, (out if rc == 0 else f"exited {rc} in {d}:\n{out}")

    def _run_c(self, b):
        if not self.prefix:
            return None, f"no {BUILD}/libamber.so: `make test-c` (or `make`) builds it"
        d = self.fresh(b, False)
        src = os.path.join(d, "snippet.c")
        flags = ["-Wall", "-Wextra", "-Werror"]
        if re.search(r"\bint\s+main\s*\(", b.code):
            text = f'#line {b.line + 1} "{b.doc}"\n{b.code}'
        else:
            text = C_FRAGMENT.format(line=b.line + 1, doc=b.doc, code=b.code)
            flags += ["-Wno-unused-function"]
        with open(src, "w") as f:
            f.write(text)
        pc = "amber_mpi" if "amber_mpi.h" in b.code else "amber"
        if not os.path.exists(os.path.join(self.prefix, "lib", "pkgconfig", pc + ".pc")):
            return None, f"{BUILD} has no {pc}.pc: libamber_mpi is built where CMake finds MPI"
        rc, out = run(["sh", "-c", f'cc {" ".join(flags)} snippet.c $(pkg-config --cflags --libs '
                       f'{pc}) -lm -o snippet'], d, self.env, 120)
        if rc != 0:
            return False, f"does not compile ({pc}) in {d}:\n{out}"
        cmd = ["./snippet"]
        if b.ranks:
            cmd = ["mpirun", "-np", str(b.ranks)] + cmd
        rc, out = run(cmd, d, self.env)
        return rc == 0, (out if rc == 0 else f"exited {rc} in {d}:\n{out}")


@pytest.fixture(scope="module")
def snippets(request, tmp_path_factory):
    s = Snippets(str(tmp_path_factory.mktemp("snippets")))
    selected = {item.callspec.params["b"].id for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")
                and "b" in item.callspec.params}
    s.selected = selected
    s.start([b for b in RUNNABLE if b.id in selected and not b.skip and not b.problem])
    yield s
    s.pool.shutdown(cancel_futures=True)
    report(request.config, s)


def report(config, s):
    """What ran, what was skipped and why, what is not code: printed whatever -q says."""
    tr = config.pluginmanager.get_plugin("terminalreporter")
    cap = config.pluginmanager.get_plugin("capturemanager")
    if tr is None:
        return
    if cap is not None:  # a fixture's teardown runs under pytest's capture
        with cap.global_and_fixture_disabled():
            _report(tr, s)
    else:
        _report(tr, s)


def _report(tr, s):
    ran = {}
    for b in RUNNABLE:
        f = s.futures.get(b.id)
        if f is not None and f.done() and not f.cancelled() and f.result()[0] is not None:
            ran[b.kind] = ran.get(b.kind, 0) + 1
    skipped = [b for b in RUNNABLE if b.skip and b.id in s.selected]
    env_skips = [b for b in RUNNABLE if (f := s.futures.get(b.id)) is not None and f.done()
                 and not f.cancelled() and f.result()[0] is None]
    docs = {b.doc for b in RUNNABLE if b.id in s.selected}
    text = [b for b in BLOCKS if b.lang in NOT_CODE and b.doc in docs]
    tr.write_line("")
    tr.write_line(f"doc snippets: {sum(ran.values())} ran ("
                  + ", ".join(f"{k} {v}" for k, v in sorted(ran.items())) + f"), "
                  f"{len(skipped) + len(env_skips)} skipped, {len(text)} not code "
                  f"({', '.join(sorted({b.lang for b in text}))})")
    for b in skipped:
        tr.write_line(f"  skipped {b.id}: {b.skip}")
    for b in env_skips:
        tr.write_line(f"  skipped {b.id}: {s.futures[b.id].result()[1]}")


@pytest.mark.parametrize("b", RUNNABLE, ids=lambda b: b.id)
def test_doc_block_runs(b, snippets):
    assert not b.problem, f"{b.id}: {b.problem}"
    if b.skip:
        pytest.skip(f"{b.id}: {b.skip}")
    ok, out = snippets.outcome(b)
    if ok is None:
        pytest.skip(f"{b.id}: {out}")
    assert ok, f"{b.id}:\n{out[-6000:]}"


def test_docs_have_blocks_of_every_kind():
    """The extraction finds what the docs hold: a parser that found nothing would pass."""
    kinds = {b.kind for b in RUNNABLE}
    assert {"python", "sh", "c"} <= kinds, kinds
    first = [b for b in BLOCKS if b.doc == "README.md"][0].code.split("\n")
    assert first[0].startswith("make demo") and first[1].startswith("make test"), \
        "README.md must start with `make demo` and `make test`, the command CI runs"


def _slug(heading):
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path):
    out, seen, code = set(), {}, False
    for ln in open(path, encoding="utf-8"):
        if ln.lstrip().startswith("```"):
            code = not code
        m = None if code else re.match(r"^#+\s+(.*?)\s*$", ln)
        if m:
            s = _slug(m.group(1))
            n = seen[s] = seen.get(s, -1) + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_doc_links_resolve(doc):
    """Every relative link of the docs names a file of the tree, and an anchor of it that
    exists (sections moved between pages leave no dangling link)."""
    path = os.path.join(ROOT, doc)
    text = re.sub(r"```.*?```", "", open(path, encoding="utf-8").read(), flags=re.S)
    bad = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, frag = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(dest):
            bad.append(f"{target}: no such file")
        elif frag and dest.endswith(".md") and frag not in _anchors(dest):
            bad.append(f"{target}: no such section")
    assert not bad, f"{doc}: " + "; ".join(bad)


def test_free_names_follow_evaluation_order():
    assert free_names("model, opt = prepare(model, opt)\nprint(x)") == {"prepare", "model", "opt", "x"}
    assert free_names("import torch\nfor s in range(steps):\n    train_step()\n") == {"steps",
                                                                                         "train_step"}
    assert free_names("def f():\n    return model\nmodel = 1\n") == set()
    assert free_names("with C() as ck:\n    ck.save(1)\n") == {"C"}
    assert free_names("ds = [{'x': i} for i in torch.arange(3)]\nclass M:\n    def f(self, b):\n"
                      "        return b, self, M, L\n") == {"torch", "L"}
