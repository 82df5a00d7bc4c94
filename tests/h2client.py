"""A small HTTP/2 client over a plain socket (prior knowledge, no TLS) for the gateway tests: it sends
what a test needs frame by frame (HEADERS, DATA, RST_STREAM) and hands back every frame received, so a
test can check each DATA frame's bytes and count what the server answers to abuse. Header blocks are
sent as HPACK literals without indexing; received ones are not decoded beyond the status: h2o sends
:status 200 as the static table's index 8 (0x88)."""
import socket
import struct

DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, END_HEADERS, ACK = 1, 4, 1


def _int7(n):
    if n < 127:
        return bytes([n])
    out, n = [127], n - 127
    while n >= 128:
        out.append((n & 127) | 128)
        n >>= 7
    out.append(n)
    return bytes(out)


def hpack(headers):
    out = b""
    for n, v in headers:
        n, v = n.encode(), v.encode()
        out += b"\x00" + _int7(len(n)) + n + _int7(len(v)) + v
    return out


class H2:
    def __init__(self, port, host="127.0.0.1", timeout=60):
        self.s = socket.create_connection((host, port), timeout=timeout)
        self.port = port
        self.next_id = 1
        self.buf = b""
        self.closed = False
        self.s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        # the largest windows: the test reads everything, flow control must not hold a stream back
        self.frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 2**31 - 1))
        self.frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1 - 65535))

    def frame(self, typ, flags, sid, payload=b""):
        self.s.sendall(struct.pack(">I", len(payload))[1:] + bytes([typ, flags]) + struct.pack(">I", sid) + payload)

    def request(self, method, path, body=None, headers=(), end=True):
        sid = self.next_id
        self.next_id += 2
        h = [(":method", method), (":scheme", "http"), (":path", path), (":authority", "127.0.0.1:%d" % self.port)]
        if body is not None:
            h.append(("content-type", "application/json"))
            h.append(("content-length", str(len(body))))
        h += list(headers)
        self.frame(HEADERS, END_HEADERS | (END_STREAM if body is None and end else 0), sid, hpack(h))
        if body is not None:
            self.frame(DATA, END_STREAM if end else 0, sid, body)
        return sid

    def rst(self, sid, code=8):  # CANCEL
        self.frame(RST_STREAM, 0, sid, struct.pack(">I", code))

    def read_frame(self):
        """The next frame as (type, flags, stream id, payload); None when the server closed. SETTINGS
        and PING are acknowledged here (and returned too)."""
        while len(self.buf) < 9 or len(self.buf) < 9 + int.from_bytes(self.buf[:3], "big"):
            try:
                more = self.s.recv(1 << 16)
            except (ConnectionResetError, socket.timeout):
                more = b""
            if not more:
                self.closed = True
                return None
            self.buf += more
        n = int.from_bytes(self.buf[:3], "big")
        typ, flags, sid = self.buf[3], self.buf[4], struct.unpack(">I", self.buf[5:9])[0] & 0x7FFFFFFF
        payload, self.buf = self.buf[9:9 + n], self.buf[9 + n:]
        try:
            if typ == SETTINGS and not flags & ACK:
                self.frame(SETTINGS, ACK, 0)
            elif typ == PING and not flags & ACK:
                self.frame(PING, ACK, 0, payload)
        except OSError:
            pass  # the server closed its side: the frames it sent before are still read
        return typ, flags, sid, payload

    def responses(self, sids):
        """Reads until every stream of `sids` ended: {sid: {"status200": bool, "frames": [DATA payloads],
        "reset": error code or None}}; a GOAWAY or a closed connection ends the wait early."""
        out = {sid: {"status200": None, "frames": [], "reset": None, "ended": False} for sid in sids}
        left = set(sids)
        self.goaway = None
        while left:
            f = self.read_frame()
            if f is None:
                break
            typ, flags, sid, payload = f
            if typ == GOAWAY:
                self.goaway = struct.unpack(">II", payload[:8])
                continue
            if sid not in out:
                continue
            r = out[sid]
            if typ == HEADERS:
                r["status200"] = payload[:1] == b"\x88"
            elif typ == DATA:
                r["frames"].append(payload)
            elif typ == RST_STREAM:
                r["reset"] = struct.unpack(">I", payload)[0]
            if (typ in (HEADERS, DATA) and flags & END_STREAM) or typ == RST_STREAM:
                r["ended"] = True
                left.discard(sid)
        return out

    def close(self):
        try:
            self.s.close()
        except OSError:
            pass
