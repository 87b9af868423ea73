#!/usr/bin/env python3
"""The jepsen bed's Rails side and its end-of-run inventory, speaking RESP over plain sockets.

push: every 1/RATE s, asks the sentinels which server is the primary, LPUSHes one PlainJob
payload (Sidekiq's shape) to queue:plain there and WAITs for both replicas. Each push is one
line of OUT: `<jid> <confirmed>`, confirmed = 1 when the LPUSH was acknowledged and reached
both replicas (no failover can lose it), 0 when it failed or replication did not confirm it
(a push into the cut-off side of a split, which Redis itself may lose).

inventory: every jid of a PlainJob still in Redis on the final primary (queue:plain, retry,
dead, schedule, and any list a worker still holds), one per line of OUT.
Usage: pusher.py push SENTINELS MASTER RATE SECONDS OUT | pusher.py inventory HOST PORT OUT
"""
import json
import socket
import sys
import time


def command(sock, *args):
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(a), a))
    sock.sendall(b"".join(parts))
    return reply(sock.makefile("rb"))


def reply(f):
    line = f.readline()
    if not line:
        raise ConnectionError("closed")
    kind, rest = line[:1], line[1:-2]
    if kind in (b"+", b":"):
        return int(rest) if kind == b":" else rest.decode()
    if kind == b"-":
        raise RuntimeError(rest.decode())
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = f.read(n + 2)[:-2]
        return data
    if kind == b"*":
        n = int(rest)
        return None if n < 0 else [reply(f) for _ in range(n)]
    raise RuntimeError("bad reply %r" % line)


def connect(host, port, timeout=1.0):
    s = socket.create_connection((host, int(port)), timeout=timeout)
    s.settimeout(timeout)
    return s


def primary(sentinels, master):
    for addr in sentinels:
        host, port = addr.rsplit(":", 1)
        try:
            with connect(host, port, 0.5) as s:
                r = command(s, "SENTINEL", "get-master-addr-by-name", master)
                if r:
                    return r[0].decode(), int(r[1])
        except (OSError, RuntimeError, ConnectionError):
            continue
    return None


def payload(jid):
    now = time.time()
    return json.dumps({"retry": 3, "queue": "plain", "class": "PlainJob", "args": [jid],
                       "jid": jid, "created_at": now, "enqueued_at": now})


def push(sentinels, master, rate, seconds, out):
    sentinels = sentinels.split(",")
    end = time.time() + float(seconds)
    n = 0
    with open(out, "w") as f:
        while time.time() < end:
            n += 1
            jid = "plain%06d" % n
            confirmed = 0
            try:
                p = primary(sentinels, master)
                if p:
                    with connect(*p) as s:
                        command(s, "SADD", "queues", "plain")
                        command(s, "LPUSH", "queue:plain", payload(jid))
                        confirmed = 1 if command(s, "WAIT", 2, 500) >= 2 else 0
            except (OSError, RuntimeError, ConnectionError):
                pass
            f.write("%s %d\n" % (jid, confirmed))
            f.flush()
            time.sleep(1.0 / float(rate))


def jids_in(values):
    for v in values or []:
        try:
            j = json.loads(v)
        except (ValueError, TypeError):
            continue
        if isinstance(j, dict) and j.get("class") == "PlainJob":
            yield j.get("jid")


def inventory(host, port, out):
    found = set()
    with connect(host, port, 5.0) as s:
        cursor = b"0"
        keys = []
        while True:
            cursor, batch = command(s, "SCAN", cursor, "COUNT", 1000)
            keys.extend(batch)
            if cursor in (b"0", "0"):
                break
        for k in keys:
            t = command(s, "TYPE", k)
            if t == "list":
                found.update(jids_in(command(s, "LRANGE", k, 0, -1)))
            elif t == "zset" and k in (b"retry", b"dead", b"schedule"):
                found.update(jids_in(command(s, "ZRANGE", k, 0, -1)))
    with open(out, "w") as f:
        for j in sorted(found):
            f.write(j + "\n")


if __name__ == "__main__":
    if sys.argv[1] == "push":
        push(*sys.argv[2:7])
    elif sys.argv[1] == "inventory":
        inventory(*sys.argv[2:5])
    else:
        sys.exit("usage: pusher.py push|inventory ...")
