"""A minimal WebSocket client (RFC 6455) for tests that hold sockets open against a real server:
it answers the server's pings (daphne closes a socket that does not) and records what arrives,
including how the socket was closed. No extra package: the handshake and frames are a few bytes."""

import asyncio
import base64
import json
import os
import struct
from dataclasses import dataclass, field


@dataclass
class WebSocket:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    texts: list[str] = field(default_factory=list)
    pings: int = 0
    close_code: int | None = None
    closed: bool = False
    _task: asyncio.Task | None = None

    @classmethod
    async def connect(cls, host: str, port: int, path: str, headers: dict[str, str]) -> "WebSocket":
        reader, writer = await asyncio.open_connection(host, port)
        key = base64.b64encode(os.urandom(16)).decode()
        lines = [
            f"GET {path} HTTP/1.1",
            f"Host: {host}:{port}",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Key: {key}",
            "Sec-WebSocket-Version: 13",
            *(f"{name}: {value}" for name, value in headers.items()),
        ]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0]
        if b" 101 " not in status:
            raise ConnectionError(f"handshake refused: {status!r}")
        socket = cls(reader, writer)
        socket._task = asyncio.create_task(socket._read())
        return socket

    async def _read(self) -> None:
        try:
            while True:
                first, second = await self.reader.readexactly(2)
                opcode, length = first & 0x0F, second & 0x7F
                if length == 126:
                    (length,) = struct.unpack("!H", await self.reader.readexactly(2))
                elif length == 127:
                    (length,) = struct.unpack("!Q", await self.reader.readexactly(8))
                payload = await self.reader.readexactly(length)
                if opcode == 0x1:
                    self.texts.append(payload.decode())
                elif opcode == 0x9:
                    self.pings += 1
                    await self._send(0xA, payload)
                elif opcode == 0x8:
                    self.close_code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            self.closed = True

    async def _send(self, opcode: int, payload: bytes) -> None:
        mask = os.urandom(4)
        length = len(payload)
        if length < 126:
            head = struct.pack("!BB", 0x80 | opcode, 0x80 | length)
        elif length < 2**16:
            head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, length)
        else:
            head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, length)
        self.writer.write(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
        await self.writer.drain()

    async def send_json(self, data: object) -> None:
        await self._send(0x1, json.dumps(data).encode())

    async def close(self) -> None:
        if not self.closed:
            try:
                await self._send(0x8, struct.pack("!H", 1000))
            except ConnectionError:
                pass
        if self._task is not None:
            self._task.cancel()
        self.writer.close()
