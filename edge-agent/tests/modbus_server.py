"""A Modbus TCP device for the agent's Modbus source test (edge-agent/tests/sources_modbus.rs).

Usage: python3 modbus_server.py PORT

Serves unit 1 on 127.0.0.1:PORT with pymodbus (pinned in .ci/test). The holding registers hold
known values in each of the four byte/word orders; sources_modbus.rs holds the same table.
Addresses are the wire's zero-based ones: pymodbus adds 1 before it looks in a block, so
every block starts at 1. Registers past 99 do not exist,
so reading them answers with exception 2 (illegal data address).
"""

import struct
import sys

from pymodbus.datastore import (
    ModbusSequentialDataBlock,
    ModbusServerContext,
    ModbusSlaveContext,
)
from pymodbus.server import StartTcpServer


def words(raw: bytes, byte_order: str, word_order: str) -> list[int]:
    """The registers a device in these orders sends for `raw` (most significant byte first)."""
    regs = []
    for i in range(0, len(raw), 2):
        hi, lo = raw[i], raw[i + 1]
        regs.append((lo << 8 | hi) if byte_order == "little" else (hi << 8 | lo))
    if word_order == "little":
        regs.reverse()
    return regs


def holding() -> list[int]:
    hr = [0] * 100
    table = [
        (0, struct.pack(">I", 0x11223344), "big", "big"),
        (2, struct.pack(">f", 21.5), "big", "little"),
        (4, struct.pack(">i", -123456), "little", "big"),
        (6, struct.pack(">I", 0xA1B2C3D4), "little", "little"),
        (8, struct.pack(">h", -50), "big", "big"),
        (10, struct.pack(">d", -1234.5678), "big", "big"),
        (14, struct.pack(">q", -9876543210), "little", "little"),
    ]
    for addr, raw, bo, wo in table:
        regs = words(raw, bo, wo)
        hr[addr : addr + len(regs)] = regs
    return hr


def main() -> None:
    port = int(sys.argv[1])
    ir = [0] * 100
    ir[3] = 1234
    device = ModbusSlaveContext(
        hr=ModbusSequentialDataBlock(1, holding()),
        ir=ModbusSequentialDataBlock(1, ir),
        co=ModbusSequentialDataBlock(1, [True, False] + [False] * 98),
        di=ModbusSequentialDataBlock(1, [False, True] + [False] * 98),
    )
    context = ModbusServerContext(slaves={1: device}, single=False)
    StartTcpServer(context=context, address=("127.0.0.1", port))


if __name__ == "__main__":
    main()
