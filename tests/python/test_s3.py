"""s3:// stores through amber.torch, amber.dcp and the CLI, against a real S3 server:
tests/s3_server.py's moto (signatures checked) behind its fault-injecting proxy,
started by this module and stopped at its end.

A training run checkpoints to s3://amber-test/... and resumes from the objects alone
(its staging directory removed) bit-identically, in one process and at 2 ranks; the
CLI lists, verifies, exports, compacts, prunes, imports and drains there; faults
injected between the client and the server during saves (a connection cut mid-upload,
500 and 503 answers, the server down and up again, a request refused) lose nothing
committed and never show a partial step to a reader of the bucket, and the next save
succeeds; refused credentials and a missing bucket fail at once, naming them. Objects
stay small: moto is slow."""
import json
import os
import shutil
import sys
import threading
import time
import uuid

import pytest
import torch

import amber
from amber.torch import Checkpointer
from conftest import HERE, PYTHON, ROOT, run_python
from test_dist_checkpointer import cli, ranks

sys.path.insert(0, os.path.join(ROOT, "tests"))
import s3_server  # noqa: E402  (tests/s3_server.py: the server and its driver)


def _unavailable(why):
    ci = os.environ.get("CI", "")
    if ci and ci != "false":
        pytest.fail(f"{why}; under CI the S3 tests must run (scripts/setup --python)")
    pytest.skip(why)


@pytest.fixture(scope="module")
def server():
    try:
        amber.Store("s3://amber-test/probe", readonly=True)
    except amber.AmberError as e:
        if e.code == amber.EFORMAT:  # the library was built without S3 support
            _unavailable(str(e))
    except Exception:
        pass
    try:
        srv = s3_server.Server()
    except RuntimeError as e:
        _unavailable(str(e))
    with pytest.MonkeyPatch.context() as mp:
        for k, v in srv.env().items():
            mp.setenv(k, v)
        for k in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL_S3",
                  "AWS_DEFAULT_REGION", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
            mp.delenv(k, raising=False)
        yield srv
    srv.stop()


@pytest.fixture
def url(server, tmp_path, monkeypatch):
    """A fresh prefix of the bucket; staging directories under the test's tmp_path."""
    monkeypatch.setenv("AMBER_STAGING", str(tmp_path / "staging"))
    os.makedirs(tmp_path / "staging")
    server.cmd("reset")
    return f"s3://amber-test/{uuid.uuid4().hex[:12]}"


# ---- a small training run ----

def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, opt):
    x = torch.randn(16, 32)  # the global RNG: its state is part of the checkpoint
    loss = (model(x) - x[:, :8]).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def run(model, opt, ck, first, last, each=None):
    losses = []
    for step in range(first, last + 1):
        losses.append(train_step(model, opt))
        if each:
            each(step)
        ck.save(step, {"model": model, "optim": opt})
        ck.wait()
    return losses


def snapshot(model, opt):
    out = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            out[f"optim/{i}/{k}"] = v.clone() if torch.is_tensor(v) else v
    return out


def bucket_steps(url):
    """What a reader of the bucket sees: the committed steps, each verified whole."""
    with amber.Store(url, readonly=True) as st:
        steps = [i.step for i in st.list()]
        for s in steps:
            with st.reader(s) as r:
                r.verify()
    return steps


def test_a_run_checkpoints_to_s3_and_resumes_from_it_bit_identically(url, tmp_path):
    torch.manual_seed(5)
    model, opt = build(0)
    with Checkpointer(str(tmp_path / "a")) as ck:
        losses_a = run(model, opt, ck, 1, 6)
    want = snapshot(model, opt)
    torch.manual_seed(5)
    model, opt = build(0)
    with Checkpointer(url) as ck:
        run(model, opt, ck, 1, 3)
        assert bucket_steps(url) == [1, 2, 3]  # durable when wait() returned
    shutil.rmtree(amber.tier_staging(url))  # a restart elsewhere: only the objects
    torch.manual_seed(999)
    model, opt = build(7)
    with Checkpointer(url) as ck:
        assert ck.load({"model": model, "optim": opt}) == 3
        assert ck.served_by == "durable"
        losses_c = run(model, opt, ck, 4, 6)
    assert losses_c == losses_a[3:]
    got = snapshot(model, opt)
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]) if torch.is_tensor(want[k]) else got[k] == want[k], k
    assert bucket_steps(url) == [1, 2, 3, 4, 5, 6]
    # the staging directory holds the newest chain: a restart on this host reads it
    model, opt = build(8)
    with Checkpointer(url) as ck:
        assert ck.load({"model": model, "optim": opt}) == 6 and ck.served_by == "memory"
        with pytest.raises(amber.AmberError, match="not after the latest step 6"):
            ck.save(6, {"model": model, "optim": opt})


@pytest.mark.parametrize("hosts", [1, 2], ids=["one-host", "two-hosts"])
def test_two_ranks_checkpoint_to_s3_and_resume_from_it_bit_identically(url, tmp_path,
                                                                       monkeypatch, hosts):
    """2 ranks on one host share its staging directory; on two hosts (a staging
    directory each) every rank's part still reaches the bucket before GLOBAL does."""
    monkeypatch.setenv("AMBER_TEST_S3", url)
    monkeypatch.setenv("AMBER_TEST_S3_HOSTS", "1" if hosts == 2 else "0")
    ranks("s3resume", 2, str(tmp_path))
    ls = cli("ls", url, "--json")
    assert ls.returncode == 0, ls.stderr
    rows = json.loads(ls.stdout)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert {r["world_size"] for r in rows} == {2}
    v = cli("verify", url)
    assert v.returncode == 0, v.stdout + v.stderr


def test_a_memory_tier_drains_to_s3_in_the_background(url, tmp_path):
    """Checkpointer(url, memory=DIR): saves land in DIR and drain to the bucket in the
    background; close() returns once the bucket holds every step; with DIR wiped, a
    restart restores from the bucket (served_by "durable") bit-identically."""
    torch.manual_seed(3)
    model, opt = build(0)
    mem = str(tmp_path / "mem")
    with Checkpointer(url, memory=mem) as ck:
        run(model, opt, ck, 1, 4)
    assert bucket_steps(url) == [1, 2, 3, 4]
    want = snapshot(model, opt)
    shutil.rmtree(mem)
    model, opt = build(9)
    with Checkpointer(url, memory=mem) as ck:
        assert ck.load({"model": model, "optim": opt}) == 4 and ck.served_by == "durable"
    got = snapshot(model, opt)
    for k in want:
        assert torch.equal(got[k], want[k]) if torch.is_tensor(want[k]) else got[k] == want[k], k


def test_the_hf_trainer_checkpoints_to_s3_and_resumes_bit_identically(url, tmp_path):
    """AmberTrainer(amber_store="s3://..."): a run SIGKILLed mid-training, its staging
    directory removed (a restart on another host), resumes from the bucket with
    resume_from_checkpoint=True and ends bit-identical to an uninterrupted run."""
    pytest.importorskip("transformers")
    from hf_procs import Proc, procs
    worker = os.path.join(HERE, "hf_worker.py")
    ref, run = str(tmp_path / "ref"), str(tmp_path / "run")
    with procs() as ps:
        ps.append(Proc([PYTHON, worker, ref, "--steps", "8"]))
        ps.append(Proc([PYTHON, worker, run, "--steps", "8", "--store", url, "--pause-at", "5"]))
        a, b = ps
        b.wait_line("step 5", 180)
        b.kill()
        shutil.rmtree(amber.tier_staging(url), ignore_errors=True)
        c = Proc([PYTHON, worker, run, "--steps", "8", "--store", url, "--resume"])
        ps.append(c)
        a.finish(180)
        c.finish(180)
        want, got = a.result(), c.result()
    assert 1 <= got["start"] <= 4 and got["global_step"] == 8, got
    assert got["losses"] == want["losses"]
    from safetensors.torch import load_file
    x, y = load_file(f"{ref}/final.safetensors"), load_file(f"{run}/final.safetensors")
    assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)
    assert bucket_steps(url)[-1] == 8


def test_lightning_checkpoints_to_s3_and_resumes_bit_identically(url, tmp_path):
    """AmberCheckpointIO(store="s3://..."): ModelCheckpoint's pointer files stay in its
    local dirpath and name the bucket; a run SIGKILLed right after a save, its staging
    directory removed (a restart on another host), resumes with fit(ckpt_path="last")
    and ends bit-identical to an uninterrupted run with a local store. Lightning's
    removals of old files prune the bucket."""
    pytest.importorskip("lightning")
    worker = os.path.join(HERE, "pl_worker.py")
    ref, run_dir = tmp_path / "ref", tmp_path / "run"
    want = json.loads(run_python(worker, str(ref), "--steps", "8").stdout.splitlines()[-1])
    p = run_python(worker, str(run_dir), "--steps", "8", "--store", url, "--kill-at", "4",
                   check=False)
    assert p.returncode == -9, p.stderr[-3000:]
    shutil.rmtree(amber.tier_staging(url), ignore_errors=True)
    last = json.loads((run_dir / "last.ckpt").read_text())
    assert last["store"] == url and last["format"] == "amber-lightning"
    assert not (run_dir / "amber").exists()  # the checkpoints are in the bucket alone
    p = run_python(worker, str(run_dir), "--steps", "8", "--store", url, "--resume")
    got = json.loads(p.stdout.splitlines()[-1])
    assert got["resumed_from"] == 4, got
    for step, loss in got["losses"].items():
        assert loss == want["losses"][step], step
    assert got["digest"] == want["digest"] and got["global_step"] == 8
    steps = bucket_steps(url)
    last = json.loads((run_dir / "last.ckpt").read_text())
    assert steps[-1] == last["step"] and steps[0] > 1, steps  # pruned as Lightning removed files
    from amber.integrations.lightning import load
    assert load(run_dir / "last.ckpt")["global_step"] == 8


def test_accelerate_saves_to_and_loads_from_s3(url):
    """AcceleratorCheckpointer(accelerator, "s3://..."): save_state writes the bucket;
    load_state, its staging directory removed (another host), restores the saved
    model, optimizer and extra exactly after training moved them on."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from amber.integrations.accelerate import AcceleratorCheckpointer
    acc = Accelerator(cpu=True)
    model, opt = acc.prepare(*build(0))
    with AcceleratorCheckpointer(acc, url) as ck:
        for step in (1, 2, 3):
            train_step(model, opt)
            ck.save_state(step, extra={"pos": step * 10})
    want = snapshot(model, opt)
    assert bucket_steps(url) == [1, 2, 3]
    for _ in range(2):
        train_step(model, opt)  # the live state moves on
    shutil.rmtree(amber.tier_staging(url), ignore_errors=True)
    with AcceleratorCheckpointer(acc, url) as ck:
        assert ck.load_state() == 3 and ck.extra == {"pos": 30}
    got = snapshot(model, opt)
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]) if torch.is_tensor(want[k]) else got[k] == want[k], k


def test_the_cli_on_an_s3_store(url, tmp_path):
    model, opt = build(0)
    with Checkpointer(url, full_share=-1) as ck:
        run(model, opt, ck, 1, 3)
        want = {k: v.clone() for k, v in model.state_dict().items()}
    ls = cli("ls", url, "--json")
    assert ls.returncode == 0, ls.stderr
    rows = json.loads(ls.stdout)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[1]["kind"] == "delta"
    info = cli("info", url, "--json")
    assert info.returncode == 0 and json.loads(info.stdout)["step"] == 3, info.stderr
    v = cli("verify", url)
    assert v.returncode == 0 and v.stdout.count(": ok") == 3, v.stdout + v.stderr
    out = tmp_path / "out.safetensors"
    e = cli("export", url, "-o", str(out))
    assert e.returncode == 0, e.stderr
    from safetensors.torch import load_file
    got = load_file(str(out))
    for k, t in want.items():
        assert torch.equal(got[f"model/{k}"], t), k
    c = cli("compact", url, "--step", "2", "--json")
    assert c.returncode == 0 and json.loads(c.stdout)["kind"] == "full", c.stderr
    p = cli("prune", url, "--keep-last", "1", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["kept"] == 2  # 3 is a delta of the compacted 2
    assert bucket_steps(url) == [2, 3]
    e2 = cli("export", url, "-o", str(tmp_path / "again.safetensors"))
    assert e2.returncode == 0 and load_file(str(tmp_path / "again.safetensors")).keys() == \
        got.keys()
    # import into a new s3:// store, through its staging directory
    imp = cli("import", str(out), url + "-imported", "--step", "7")
    assert imp.returncode == 0, imp.stderr
    e3 = cli("export", url + "-imported", "-o", str(tmp_path / "imp.safetensors"))
    assert e3.returncode == 0, e3.stderr
    assert all(torch.equal(t, load_file(str(tmp_path / "imp.safetensors"))[k])
               for k, t in got.items())
    low = cli("import", str(out), url + "-imported", "--step", "7")
    assert low.returncode == 1 and "not after the latest step 7" in low.stderr
    # amber drain MEMDIR s3://...: a memory tier finished into the bucket
    mem = str(tmp_path / "mem")
    assert cli("import", str(out), mem, "--step", "4").returncode == 0
    d = cli("drain", mem, url + "-drained", "--json")
    assert d.returncode == 0 and json.loads(d.stdout)["durable_step"] == 4, d.stderr
    assert bucket_steps(url + "-drained") == [4]


# A reader of the bucket in a process of its own, straight to moto (the faults are
# the saves'): lists and verifies every step it sees until the stop file appears.
WATCH = """
import json, os, sys, time
import amber
url, stop = sys.argv[1], sys.argv[2]
seen, bad = set(), []
while not os.path.exists(stop):
    try:
        with amber.Store(url, readonly=True) as st:
            for i in st.list():
                with st.reader(i.step) as r:
                    r.verify()
                seen.add(i.step)
    except amber.AmberError as e:
        if not (e.code == amber.ENOENT and "no store at" in str(e)):
            bad.append(str(e))
    time.sleep(0.02)
print(json.dumps({"seen": sorted(seen), "bad": bad}))
"""


def test_faults_during_saves_lose_nothing_and_show_no_partial_step(url, server, tmp_path):
    import subprocess
    model, opt = build(0)
    stop = tmp_path / "stop"
    watcher = subprocess.Popen([sys.executable, "-c", WATCH, url, str(stop)],
                               stdout=subprocess.PIPE, text=True,
                               env=dict(os.environ, **server.env(direct=True)))
    faults = {2: ["cut 1 3000"],                       # a connection cut mid-upload
              3: ["fail 2 503 SlowDown", "fail 1 500 InternalError"],
              4: ["pass 2", "cut 2 100", "fail 1 503 SlowDown"]}

    def inject(step):
        server.cmd("reset")
        for f in faults.get(step, []):
            server.cmd(f)
        if step == 5:  # the server down during the save, and up again
            threading.Timer(0.05, server.cmd, ("down",)).start()
            threading.Timer(1.0, server.cmd, ("up",)).start()
    try:
        with Checkpointer(url) as ck:
            run(model, opt, ck, 1, 5, each=inject)
            time.sleep(1.2)
            assert bucket_steps(url) == [1, 2, 3, 4, 5]
            # a request refused (a 4xx, not retried) fails that save's wait(),
            # naming the object; the step stays committed in the staging directory,
            # and the next save uploads it with its own
            train_step(model, opt)
            server.cmd("reset")
            server.cmd("fail 1 403 AccessDenied")
            ck.save(6, {"model": model, "optim": opt})
            with pytest.raises(amber.AmberError) as e:
                ck.wait()
            assert e.value.code == amber.EPERM and url in str(e.value)
            assert bucket_steps(url) == [1, 2, 3, 4, 5]
            run(model, opt, ck, 7, 7)
            assert bucket_steps(url) == [1, 2, 3, 4, 5, 6, 7]
    finally:
        stop.touch()
        out, _ = watcher.communicate(timeout=120)
    got = json.loads(out.strip().splitlines()[-1])
    assert not got["bad"], got["bad"]
    assert 1 in got["seen"] and set(got["seen"]) <= {1, 2, 3, 4, 5, 6, 7}


def test_refused_credentials_and_a_missing_bucket_fail_at_once(url, server, monkeypatch):
    model, opt = build(0)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    server.cmd("reset")
    with pytest.raises(amber.AmberError) as e:
        Checkpointer(url)
    assert e.value.code == amber.EPERM and url in str(e.value) and \
        "SignatureDoesNotMatch" in str(e.value)
    assert server.counts()[0] <= 3  # a request or two, none retried
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret)
    server.cmd("reset")
    with pytest.raises(amber.AmberError) as e:
        Checkpointer("s3://no-such-bucket-here/run")
    assert e.value.code == amber.ENOENT and "no-such-bucket-here" in str(e.value) and \
        "NoSuchBucket" in str(e.value)
    assert server.counts()[0] <= 3


def test_dcp_saves_to_and_loads_from_s3(url):
    import torch.distributed.checkpoint as dcp
    from amber.dcp import Reader, Writer
    model, opt = build(0)
    train_step(model, opt)
    w = Writer(url)
    try:
        dcp.save({"model": model.state_dict()}, storage_writer=w)
        train_step(model, opt)
        dcp.save({"model": model.state_dict()}, storage_writer=w)
    finally:
        w.close()
    assert bucket_steps(url) == [0, 1]
    model2, _ = build(3)
    state = {"model": model2.state_dict()}
    dcp.load(state, storage_reader=Reader(url))
    for k, v in model.state_dict().items():
        assert torch.equal(state["model"][k], v), k
