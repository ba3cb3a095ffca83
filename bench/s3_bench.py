#!/usr/bin/env python3
"""s3_bench.py - checkpoints to an object store, side by side in one run on one local
S3 server: amber's Checkpointer("s3://...") against DCP's fsspec writer (s3fs) and
Amazon's s3torchconnector DCP writer; a full save, the next step's save, and a load;
the bytes and requests each sends per step; and what the server itself allows.

The state is GPT-2 small (124M parameters) + AdamW, trained by AdamW steps on
synthetic gradients (bench/torch_bench.py says why), policy `lossy` by default
(`--policy exact` too: a comma-separated list runs each).

The server is tests/s3_server.py: moto's S3 server (in memory, request signatures
checked) behind its proxy, which counts the requests and the bytes of their bodies,
both ways. moto is a Python server on the same 2 cores as the client: every figure
here is bound by it, so the run measures a plain PUT and GET of the same bytes
through the same server too (boto3's multipart transfer, 16 MiB parts, 8 at once),
the floor below which no writer can go here, and one GET of the whole object. moto
serves each ranged GET by reading the whole object first, so a reader's time here
grows with its requests times the size of the objects they range over: a ranged
reader of one large object (amber's one file per rank and step, boto3's 16 MiB
ranges) pays that on every request, one that GETs many smaller objects whole does
not. On real S3 a ranged GET costs its range; the three move at the network's pace,
and what carries over is the bytes and the requests.

  amber: Checkpointer(url, policy): the writer writes into the URL's staging
    directory under /dev/shm and each commit is drained to the bucket before wait()
    returns (save() + wait(): durable in S3); a delta uploads only its own file. The
    load: a new Checkpointer, its staging directory removed (a restart elsewhere: only
    the objects), load() into the live model and optimizer (ranged GETs).
  dcp_fsspec: dcp.save(state, storage_writer=FsspecWriter(url/step-N, thread_count=8))
    and dcp.load(..., FsspecReader(...)) + set_state_dict: every save writes the whole
    state.
  s3torchconnector: its S3StorageWriter(region, url/step-N, thread_count=8) and
    S3StorageReader, their client pointed at the server (force_path_style).

    s3_bench.py [--quick] [--repeat 1] [--policy lossy[,exact]] [--json FILE] [--markdown]
"""
import argparse
import gc
import io
import os
import platform
import shutil
import sys
import time
import uuid

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import set_state_dict

import amber
from amber.torch import Checkpointer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
import s3_server  # noqa: E402  (tests/s3_server.py: the server and its driver)
from _common import (add_run_args, dcp_state, emit, fmt, logger, row, spreads,  # noqa: E402
                     state_bytes, warm_trainer)

log = logger("s3_bench")
BUCKET = "amber-test"
PARALLEL = 8


class Meter:
    """Times a step and takes the proxy's counts of it (requests, bytes up, down)."""

    def __init__(self, server):
        self.server = server

    def __call__(self, fn):
        self.server.cmd("reset")
        t0 = time.perf_counter()
        out = fn()
        secs = time.perf_counter() - t0
        req, up, down = self.server.counts()
        return secs, {"requests": req, "up": up, "down": down}, out


def boto3_client():
    import boto3
    return boto3.client("s3")


def drop_prefix(prefix):
    """Removes every object under `prefix` (moto keeps them in memory)."""
    s3 = boto3_client()
    keys = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys += [{"Key": o["Key"]} for o in page.get("Contents", [])]
    for i in range(0, len(keys), 1000):
        s3.delete_objects(Bucket=BUCKET, Delete={"Objects": keys[i:i + 1000]})


def record(f, name, what, secs, counts):
    f[f"{name}_{what}"] = secs
    for k, v in counts.items():
        f[f"{name}_{what}_{k}"] = v


def amber_round(tr, meter, f, policy, step):
    name = f"amber_{policy}"
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    url = f"s3://{BUCKET}/{prefix}"
    try:
        with Checkpointer(url, policy=policy) as ck:
            log(f"{name}: full save")
            secs, c, _ = meter(lambda: (ck.save(step, tr.state, full=True), ck.wait()))
            record(f, name, "full", secs, c)
            tr.train()
            log(f"{name}: the next step's save")
            secs, c, _ = meter(lambda: (ck.save(step + 1, tr.state), ck.wait()))
            record(f, name, "delta", secs, c)
            kinds = [i.kind for i in ck.steps()]
            assert kinds == ["full", "delta"], kinds
        shutil.rmtree(amber.tier_staging(url), ignore_errors=True)  # only the objects
        gc.collect()
        with Checkpointer(url, policy=policy) as ck:
            log(f"{name}: load from the bucket")
            secs, c, got = meter(lambda: ck.load(tr.state))
            assert got == step + 1 and ck.served_by == "durable", (got, ck.served_by)
            record(f, name, "load", secs, c)
    finally:
        shutil.rmtree(amber.tier_staging(url), ignore_errors=True)
        drop_prefix(prefix)
    return step + 1


def dcp_round(tr, meter, f, name, writer, reader):
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    url = f"s3://{BUCKET}/{prefix}"
    try:
        log(f"{name}: full save")
        secs, c, _ = meter(lambda: dcp.save(dcp_state(tr.model, tr.opt),
                                            storage_writer=writer(f"{url}/step-1")))
        record(f, name, "full", secs, c)
        tr.train()
        log(f"{name}: the next step's save (the whole state again)")
        secs, c, _ = meter(lambda: dcp.save(dcp_state(tr.model, tr.opt),
                                            storage_writer=writer(f"{url}/step-2")))
        record(f, name, "delta", secs, c)
        gc.collect()

        def load():
            sd = dcp_state(tr.model, tr.opt)
            dcp.load(sd, storage_reader=reader(f"{url}/step-2"))
            set_state_dict(tr.model, tr.opt, model_state_dict=sd["model"],
                           optim_state_dict=sd["optim"])
        log(f"{name}: load")
        secs, c, _ = meter(load)
        record(f, name, "load", secs, c)
    finally:
        drop_prefix(prefix)


def fsspec_io():
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    return (lambda p: FsspecWriter(p, thread_count=PARALLEL)), (lambda p: FsspecReader(p))


def s3tc_io():
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3FileSystem, S3StorageReader, S3StorageWriter
    region, endpoint = os.environ["AWS_REGION"], os.environ["AWS_ENDPOINT_URL"]

    def fs():  # its client knows no AWS_ENDPOINT_URL: given here, path-style as local servers need
        return S3FileSystem(region, s3_client=S3Client(
            region, endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True)))

    def writer(p):
        w = S3StorageWriter(region, p, thread_count=PARALLEL)
        w.fs = fs()
        return w

    def reader(p):
        r = S3StorageReader(region, p)
        r.fs = fs()
        return r
    return writer, reader


def floor(meter, f, nbytes):
    """A plain PUT and GET of `nbytes` through the same server (boto3's multipart
    transfer: 16 MiB parts and ranges, 8 at once), and one GET of the whole object:
    what the server allows a writer and a reader of the state."""
    from boto3.s3.transfer import TransferConfig
    cfg = TransferConfig(multipart_threshold=16 << 20, multipart_chunksize=16 << 20,
                         max_concurrency=PARALLEL)
    s3 = boto3_client()
    key = f"bench-floor-{uuid.uuid4().hex[:8]}"
    buf = bytes(nbytes)
    try:
        log(f"floor: PUT and GET of {nbytes / 1e9:.2f} GB")
        secs, c, _ = meter(lambda: s3.upload_fileobj(io.BytesIO(buf), BUCKET, key, Config=cfg))
        record(f, "floor", "put", secs, c)
        buf = None
        sink = io.BytesIO()
        secs, c, _ = meter(lambda: s3.download_fileobj(BUCKET, key, sink, Config=cfg))
        record(f, "floor", "get", secs, c)
        sink = None
        # one GET of the whole object: moto serves every ranged GET by reading the
        # whole object first, so here fewer, larger requests win whatever their ranges
        secs, c, _ = meter(lambda: len(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()))
        record(f, "floor", "get_whole", secs, c)
    finally:
        s3.delete_object(Bucket=BUCKET, Key=key)


PEERS = (("dcp_fsspec", fsspec_io), ("s3torchconnector", s3tc_io))


def one_round(tr, meter, r, a):
    f = {"state_bytes": state_bytes(tr.model, tr.opt)}
    step = 1000 * (r + 1)
    for policy in a.policy.split(","):
        step = amber_round(tr, meter, f, policy, step) + 1
    for name, make in PEERS:
        try:
            w, rd = make()
        except ImportError as e:
            log(f"{name}: not installed ({e}): left out")
            continue
        dcp_round(tr, meter, f, name, w, rd)
    floor(meter, f, f["state_bytes"])
    systems = [f"amber_{p}" for p in a.policy.split(",")] + [n for n, _ in PEERS
                                                             if f"{n}_full" in f]
    for s in systems:  # against the server's own pace
        for what, fl in (("full", "floor_put"), ("delta", "floor_put"), ("load", "floor_get")):
            f[f"{s}_{what}_vs_floor"] = f[f"{s}_{what}"] / f[fl]
        f[f"{s}_load_vs_floor_whole_get"] = f[f"{s}_load"] / f["floor_get_whole"]
    for p in a.policy.split(","):
        for n, _ in PEERS:
            if f"{n}_full" in f:
                f[f"{n}_delta_vs_amber_{p}"] = f[f"{n}_delta"] / f[f"amber_{p}_delta"]
                f[f"{n}_load_vs_amber_{p}"] = f[f"{n}_load"] / f[f"amber_{p}_load"]
    return f


NAMES = {"amber_lossy": "amber (lossy)", "amber_exact": "amber (exact)",
         "dcp_fsspec": "DCP FsspecWriter (s3fs)", "s3torchconnector": "s3torchconnector DCP",
         "floor": "floor: boto3 PUT / GET"}


def report(res, markdown, systems):
    F, R = res["figures"], res["ratios"]
    w = (26, 8, 22, 22, 22)
    lines = [row(["system", "step", "seconds", "MB up / down", "requests"], markdown, w)]
    if markdown:
        lines.append("|---|---|---|---|---|")
    for s in systems + ["floor"]:
        for what in (("put", "get", "get_whole") if s == "floor" else ("full", "delta", "load")):
            k = f"{s}_{what}"
            if k not in F:
                continue
            mb = f"{F[k + '_up']['median'] / 1e6:.1f} / {F[k + '_down']['median'] / 1e6:.1f}"
            lines.append(row([NAMES.get(s, s), what, fmt(F[k], "s"), mb,
                              f"{F[k + '_requests']['median']:.0f}"], markdown, w))
    lines.append("")
    lines.append(row(["ratio", "median (min-max)"], markdown, (58,)))
    if markdown:
        lines.append("|---|---|")
    for k in sorted(R):
        lines.append(row([k, fmt(R[k], "x")], markdown, (58,)))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(ap)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--policy", default="lossy")
    a = ap.parse_args()
    server = s3_server.Server(timeout=7200)
    try:
        os.environ.update(server.env())
        for k in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION"):
            os.environ.pop(k, None)
        os.environ.setdefault("AMBER_STAGING", "/dev/shm" if os.path.isdir("/dev/shm")
                              else "/tmp")
        tr = warm_trainer(a)
        meter = Meter(server)
        rounds = [one_round(tr, meter, r, a) for r in range(a.repeat)]
    finally:
        server.stop()
    ratio_keys = [k for k in rounds[0] if "_vs_" in k]
    systems = [f"amber_{p}" for p in a.policy.split(",")] + [n for n, _ in PEERS
                                                             if f"{n}_full" in rounds[0]]
    res = {"machine": platform.node(), "cpus": os.cpu_count(), "amber": amber.version(),
           "policy": a.policy, "figures": spreads(rounds, skip=ratio_keys),
           "ratios": spreads([{k: f[k] for k in ratio_keys} for f in rounds])}
    head = (f"s3_bench: {'quick model' if a.quick else 'GPT-2 small + AdamW'} "
            f"({rounds[0]['state_bytes'] / 1e9:.2f} GB), moto's S3 server behind a proxy on "
            f"127.0.0.1, {a.repeat} round(s), {os.cpu_count()} CPUs")
    emit(head, report(res, a.markdown, systems), res, a.json)


if __name__ == "__main__":
    main()
