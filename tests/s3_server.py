#!/usr/bin/env python3
"""A real S3 server for the C tests, with a fault-injecting proxy in front of it.

Started by tests/s3_harness.c (one process per test program), it runs moto's S3
server (moto[server], pinned in requirements-dev.txt) on 127.0.0.1, with request
signing checked: an IAM user with an s3:* policy and an access key is made first, then
authentication is switched on, so a wrong secret gets SignatureDoesNotMatch and an
unknown key InvalidAccessKeyId, as from AWS. In front of it, on another port, a small
HTTP/1.1-aware asyncio proxy through which the client under test talks, and which
injects the faults the tests ask for: a connection cut after N bytes of a request's
body, K requests answered 500/503 with S3's error body, a delayed response, and the
server taken down and brought back up (its data kept, as S3's is when one of its
front ends restarts). The proxy counts requests, so a test can check that an error
was not retried, and checks an upload's x-amz-checksum-crc32 as S3 does on arrival
(moto only stores it), answering 400 BadDigest to a body that does not match it.

Protocol: one line on stdout when ready,
    ready PROXY_PORT SERVER_PORT ACCESS_KEY SECRET_KEY
then one command per line on stdin, each answered by one line "ok ..." or "error ...":
    bucket NAME          create a bucket
    fail K STATUS CODE   answer the next K requests STATUS with S3 error CODE
    cut K N              cut the next K requests' connections after N bytes of body
    cutresp K N          cut the next K responses' connections after N bytes of body
    flip K N             change byte N of the next K requests' bodies on the way
    delay K MS           hold the next K responses MS milliseconds
    pass K               let the next K requests through (before the faults queued after)
    count                "ok REQUESTS CONNECTIONS MOST" since the last reset: requests and
                         client connections seen, most requests in flight at once
    down / up            stop the S3 server (open connections are cut) / start it again
    reset                clear the faults and the counters
Exits when stdin closes or after --timeout seconds, whichever comes first.
"""
import argparse
import asyncio
import base64
import collections
import os
import socket
import struct
import sys
import zlib

os.environ.setdefault("AWS_ACCESS_KEY_ID", "setup")  # boto3 signs the setup calls
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "setup")

BUCKET = "amber-test"
REGION = "us-east-1"
POLICY = '{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"s3:*","Resource":"*"}]}'


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Backend:
    """moto's server in this process, so that stopping it keeps its data."""

    def __init__(self):
        self.port = free_port()
        self.server = None

    def up(self):
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def down(self):
        if self.server:
            self.server.stop()
            self.server = None

    def setup(self):
        """The IAM user and bucket, made before signatures are checked."""
        import boto3
        from moto import settings

        url = f"http://127.0.0.1:{self.port}"
        iam = boto3.client("iam", endpoint_url=url, region_name=REGION)
        iam.create_user(UserName="amber")
        iam.put_user_policy(UserName="amber", PolicyName="s3", PolicyDocument=POLICY)
        key = iam.create_access_key(UserName="amber")["AccessKey"]
        self.key, self.secret = key["AccessKeyId"], key["SecretAccessKey"]
        self.bucket(BUCKET)
        settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # from now on every request is checked

    def bucket(self, name):
        import boto3

        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{self.port}", region_name=REGION,
                          aws_access_key_id=getattr(self, "key", "setup"),
                          aws_secret_access_key=getattr(self, "secret", "setup"))
        s3.create_bucket(Bucket=name)


class Faults:
    def __init__(self):
        # ("fail", status, code), ("cut", n), ("cutresp", n), ("flip", n), ("delay", seconds),
        # ("pass",)
        self.queue = collections.deque()
        self.requests = 0
        self.connections = 0
        self.in_flight = 0
        self.most = 0

    def take(self):
        self.requests += 1
        fault = self.queue.popleft() if self.queue else None
        return None if fault and fault[0] == "pass" else fault


def error_response(status, code):
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>injected by tests/s3_server.py</Message></Error>").encode()
    reason = {400: "Bad Request", 500: "Internal Server Error",
              503: "Service Unavailable"}.get(status, "Error")
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return head + body


def parse_head(head):
    lines = head.decode("latin-1").split("\r\n")
    fields = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            fields[k.strip().lower()] = v.strip()
    return lines[0], fields


def reset(writer):
    """Closes with a TCP reset, as a dying peer or a cut network does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class Proxy:
    def __init__(self, backend, faults):
        self.backend = backend
        self.faults = faults
        self.open = set()  # the writers of live connections, both sides
        self.port = None

    async def start(self):
        server = await asyncio.start_server(self.client, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        return server

    def cut_all(self):
        for w in list(self.open):
            reset(w)
        self.open.clear()

    async def copy(self, reader, writer, n):
        while n > 0:
            data = await reader.read(min(n, 1 << 16))
            if not data:
                raise ConnectionError("peer closed")
            writer.write(data)
            await writer.drain()
            n -= len(data)

    async def copy_chunked(self, reader, writer):
        while True:
            line = await reader.readuntil(b"\r\n")
            writer.write(line)
            size = int(line.split(b";")[0], 16)
            await self.copy(reader, writer, size + 2)
            if size == 0:
                return

    async def client(self, creader, cwriter):
        self.faults.connections += 1
        self.open.add(cwriter)
        conn = {"up": None}
        try:
            while await self.exchange(creader, cwriter, conn):
                pass
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError):
            pass
        except Exception as e:  # a bug here must show, not hang the test
            print(f"s3_server.py: proxy: {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            self.open.discard(cwriter)
            cwriter.close()
            self.drop(conn)

    def drop(self, conn):
        if conn["up"] is not None:
            self.open.discard(conn["up"][1])
            conn["up"][1].close()
            conn["up"] = None

    async def head_of(self, reader):
        """The next response head, interim (1xx) ones included."""
        rhead = await reader.readuntil(b"\r\n\r\n")
        line, fields = parse_head(rhead)
        return rhead, int(line.split(" ")[1]), fields

    async def exchange(self, creader, cwriter, conn):
        """One request and its response; False when the connection is to end."""
        try:
            head = await creader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        self.faults.in_flight += 1
        self.faults.most = max(self.faults.most, self.faults.in_flight)
        try:
            return await self.forward(head, creader, cwriter, conn)
        finally:
            self.faults.in_flight -= 1

    async def forward(self, head, creader, cwriter, conn):
        line, fields = parse_head(head)
        method = line.split(" ")[0]
        length = int(fields.get("content-length", "0"))
        expect = "100-continue" in fields.get("expect", "").lower()
        fault = self.faults.take()
        if fault and fault[0] == "fail":
            if expect:  # the body never comes: answer at once, then close
                cwriter.write(error_response(fault[1], fault[2]))
                await cwriter.drain()
                return False
            await creader.readexactly(length)
            cwriter.write(error_response(fault[1], fault[2]))
            await cwriter.drain()
            return True
        if conn["up"] is None:
            try:
                conn["up"] = await asyncio.open_connection("127.0.0.1", self.backend.port)
            except OSError:  # the server is down: the client sees a reset
                reset(cwriter)
                return False
            self.open.add(conn["up"][1])
        ureader, uwriter = conn["up"]
        uwriter.write(head)
        await uwriter.drain()
        if expect:  # curl waits for "100 Continue" before it sends a large body
            rhead, status, rfields = await self.head_of(ureader)
            if status != 100:  # refused before the body: forwarded, then closed
                cwriter.write(rhead)
                await self.body(ureader, cwriter, method, status, rfields)
                return False
            cwriter.write(rhead)
            await cwriter.drain()
        if fault and fault[0] == "cut":
            await self.copy(creader, uwriter, min(fault[1], length))
            reset(cwriter)
            reset(uwriter)
            return False
        body = await creader.readexactly(length)
        if fault and fault[0] == "flip":  # a byte changed on the way, unseen by TCP
            body = body[:fault[1]] + bytes([body[fault[1]] ^ 1]) + body[fault[1] + 1:]
        crc = fields.get("x-amz-checksum-crc32")
        if crc is not None and crc != base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode():
            # S3 checks an upload's checksum on arrival; moto does not, so this proxy
            # does it in its place, and the body never reaches the server
            cwriter.write(error_response(400, "BadDigest"))
            await cwriter.drain()
            self.drop(conn)  # it waits for a body that will not come
            return True
        uwriter.write(body)
        await uwriter.drain()
        rhead, status, rfields = await self.head_of(ureader)
        while 100 <= status < 200:
            cwriter.write(rhead)
            rhead, status, rfields = await self.head_of(ureader)
        # moto's server (werkzeug) closes after each response; the proxy keeps the
        # client's connection open all the same, as S3 does, and opens the next
        # upstream one itself, so that what the proxy counts is the client's reuse.
        upstream_closes = "close" in rfields.get("connection", "").lower()
        if upstream_closes:
            rhead = b"".join(l for l in rhead.splitlines(keepends=True)
                             if not l.lower().startswith(b"connection:"))
        if fault and fault[0] == "delay":
            await asyncio.sleep(fault[1])
        cwriter.write(rhead)
        if fault and fault[0] == "cutresp":
            await self.copy(ureader, cwriter, min(fault[1], int(rfields.get("content-length", "0"))))
            reset(cwriter)
            reset(uwriter)
            return False
        if not await self.body(ureader, cwriter, method, status, rfields):
            return False
        if upstream_closes:
            self.drop(conn)
        return "close" not in fields.get("connection", "").lower()

    async def body(self, ureader, cwriter, method, status, rfields):
        """Forwards a response's body; False when the server's close delimits it."""
        if method == "HEAD" or status in (204, 304):
            pass
        elif "chunked" in rfields.get("transfer-encoding", ""):
            await self.copy_chunked(ureader, cwriter)
        elif "content-length" in rfields:
            await self.copy(ureader, cwriter, int(rfields["content-length"]))
        else:
            cwriter.write(await ureader.read())
            await cwriter.drain()
            return False
        await cwriter.drain()
        return True


async def control(backend, faults, proxy):
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = await reader.readline()
        if not line:
            return
        cmd = line.decode().split()
        try:
            if not cmd:
                continue
            if cmd[0] == "bucket":
                await asyncio.to_thread(backend.bucket, cmd[1])
                reply = "ok"
            elif cmd[0] == "fail":
                faults.queue.extend([("fail", int(cmd[2]), cmd[3])] * int(cmd[1]))
                reply = "ok"
            elif cmd[0] == "cut":
                faults.queue.extend([("cut", int(cmd[2]))] * int(cmd[1]))
                reply = "ok"
            elif cmd[0] == "cutresp":
                faults.queue.extend([("cutresp", int(cmd[2]))] * int(cmd[1]))
                reply = "ok"
            elif cmd[0] == "flip":
                faults.queue.extend([("flip", int(cmd[2]))] * int(cmd[1]))
                reply = "ok"
            elif cmd[0] == "delay":
                faults.queue.extend([("delay", int(cmd[2]) / 1000)] * int(cmd[1]))
                reply = "ok"
            elif cmd[0] == "pass":
                faults.queue.extend([("pass",)] * int(cmd[1]))
                reply = "ok"
            elif cmd[0] == "count":
                reply = f"ok {faults.requests} {faults.connections} {faults.most}"
            elif cmd[0] == "down":
                proxy.cut_all()
                await asyncio.to_thread(backend.down)
                reply = "ok"
            elif cmd[0] == "up":
                await asyncio.to_thread(backend.up)
                reply = "ok"
            elif cmd[0] == "reset":
                faults.queue.clear()
                faults.requests = faults.connections = faults.most = 0
                reply = "ok"
            else:
                reply = f"error unknown command {cmd[0]}"
        except Exception as e:  # the test reads the reason
            reply = f"error {type(e).__name__}: {e}".replace("\n", " ")
        sys.stdout.write(reply + "\n")
        sys.stdout.flush()


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=600, help="exit after this many seconds")
    args = ap.parse_args()
    backend = Backend()
    backend.up()
    await asyncio.to_thread(backend.setup)
    faults = Faults()
    proxy = Proxy(backend, faults)
    server = await proxy.start()
    print(f"ready {proxy.port} {backend.port} {backend.key} {backend.secret}", flush=True)
    ctl = asyncio.ensure_future(control(backend, faults, proxy))
    done, _ = await asyncio.wait([ctl], timeout=args.timeout)
    if not done:
        print(f"s3_server.py: exiting after {args.timeout:g} s", file=sys.stderr)
        ctl.cancel()
    server.close()
    proxy.cut_all()
    backend.down()
    sys.stdout.flush()
    os._exit(0)  # no teardown of the tasks still waiting, nor of moto's daemon threads


if __name__ == "__main__":
    asyncio.run(main())
