"""A Modbus RTU bus for the agent's RTU test (edge-agent/tests/sources_modbus_rtu.rs).

Usage: python3 modbus_rtu_server.py PORT_PATH PROBE_PATH

Prints "ready" once unit 1 answers a read made through PROBE_PATH, the other end of the line
(the end the agent opens afterwards). Serves units 1 and 2 with pymodbus's serial RTU server (pymodbus and pyserial pinned in .ci/test)
on the serial port PORT_PATH, at 19200 baud, 8 data bits, no parity, 1 stop bit (8N1). In the
test the port is one end of a socat pseudo-terminal pair and the agent polls the other end;
this machine's kernel refuses a parity bit on a pseudo-terminal (tcsetattr: EINVAL), so the
test line has none. Unit 1 holds its values big-endian (ABCD), unit 2 the same
values little-endian in both bytes and words (DCBA); sources_modbus_rtu.rs holds the same
table. Any other unit id (the test polls unit 3) gets no answer at all, as a dead or absent
device on a real RS-485 bus: `ignore_missing_slaves` drops the request.

Addresses are the wire's zero-based ones: pymodbus adds 1 before it looks in a block, so every
block starts at 1.
"""

import asyncio
import struct
import sys

from pymodbus import FramerType
from pymodbus.client import AsyncModbusSerialClient
from pymodbus.datastore import (
    ModbusSequentialDataBlock,
    ModbusServerContext,
    ModbusSlaveContext,
)
from pymodbus.exceptions import ModbusException
from pymodbus.server import ModbusSerialServer


def words(raw: bytes, byte_order: str, word_order: str) -> list[int]:
    """The registers a device in these orders sends for `raw` (most significant byte first)."""
    regs = []
    for i in range(0, len(raw), 2):
        hi, lo = raw[i], raw[i + 1]
        regs.append((lo << 8 | hi) if byte_order == "little" else (hi << 8 | lo))
    if word_order == "little":
        regs.reverse()
    return regs


# (address, raw big-endian bytes): the same values on both units, in each unit's orders.
TABLE = [
    (0, struct.pack(">I", 0x11223344)),
    (2, struct.pack(">f", 21.5)),
    (4, struct.pack(">i", -123456)),
    (6, struct.pack(">d", -1234.5678)),
    (10, struct.pack(">h", -50)),
]


def unit(order: str) -> ModbusSlaveContext:
    hr = [0] * 100
    for addr, raw in TABLE:
        regs = words(raw, order, order)
        hr[addr : addr + len(regs)] = regs
    return ModbusSlaveContext(
        hr=ModbusSequentialDataBlock(1, hr),
        ir=ModbusSequentialDataBlock(1, [0] * 100),
        co=ModbusSequentialDataBlock(1, [True] + [False] * 99),
        di=ModbusSequentialDataBlock(1, [False] * 100),
    )


async def serve(bus: str, probe: str) -> None:
    context = ModbusServerContext(slaves={1: unit("big"), 2: unit("little")}, single=False)
    server = ModbusSerialServer(
        context,
        framer=FramerType.RTU,
        port=bus,
        baudrate=19200,
        bytesize=8,
        parity="N",
        stopbits=1,
        ignore_missing_slaves=True,
    )
    serving = asyncio.create_task(server.serve_forever())
    # Ready once unit 1 answers a read through the other end of the line; the agent opens that
    # end only after "ready".
    client = AsyncModbusSerialClient(
        port=probe, framer=FramerType.RTU, baudrate=19200, parity="N", timeout=0.5, retries=0
    )
    for _ in range(100):
        try:
            await client.connect()
            reply = await client.read_holding_registers(0, count=1, slave=1)
            if not reply.isError():
                break
        except ModbusException:
            pass
        await asyncio.sleep(0.1)
    else:
        sys.exit("unit 1 never answered through " + probe)
    client.close()
    print("ready", flush=True)
    await serving


def main() -> None:
    asyncio.run(serve(sys.argv[1], sys.argv[2]))


if __name__ == "__main__":
    main()
