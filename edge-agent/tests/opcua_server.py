"""An OPC UA server for the agent's OPC UA source test (edge-agent/tests/opcua.rs).

Usage: python3 opcua_server.py PORT [BASE]

Serves opc.tcp://127.0.0.1:PORT/tributary/ with asyncua (pinned in .ci/test), security policy
None, anonymous access. Namespace "urn:tributary:test" (index 2) holds four variables, all
changed every 100 ms with a fresh source timestamp:

- ns=2;s=Counter  Int32, counts up from BASE + 1 (BASE defaults to 0), so the test can tell
                  the values of a restarted server (started with another BASE) from the first's;
- ns=2;s=Temp     Double, 20.0 + (Counter - BASE) / 10;
- ns=2;s=Running  Boolean, true on even counts;
- ns=2;s=Label    String, "n" + Counter.

Prints "ready" on stdout once it listens.
"""

import asyncio
import datetime
import logging
import sys

from asyncua import Server, ua


async def main(port: int, base: int) -> None:
    logging.basicConfig(level=logging.WARNING)
    server = Server()
    await server.init()
    server.set_endpoint(f"opc.tcp://127.0.0.1:{port}/tributary/")
    server.set_server_name("Tributary test server")
    server.set_security_policy([ua.SecurityPolicyType.NoSecurity])
    ns = await server.register_namespace("urn:tributary:test")
    assert ns == 2, ns
    plant = await server.nodes.objects.add_object(ua.NodeId("Plant", ns), "Plant")
    specs = [
        ("Counter", ua.VariantType.Int32, 0),
        ("Temp", ua.VariantType.Double, 20.0),
        ("Running", ua.VariantType.Boolean, False),
        ("Label", ua.VariantType.String, "n0"),
    ]
    nodes = {}
    for name, vt, initial in specs:
        nodes[name] = await plant.add_variable(
            ua.NodeId(name, ns), name, ua.Variant(initial, vt)
        )
    async with server:
        print("ready", flush=True)
        n = base
        while True:
            await asyncio.sleep(0.1)
            n += 1
            now = datetime.datetime.now(datetime.timezone.utc)
            values = {
                "Counter": ua.Variant(n, ua.VariantType.Int32),
                "Temp": ua.Variant(20.0 + (n - base) / 10, ua.VariantType.Double),
                "Running": ua.Variant(n % 2 == 0, ua.VariantType.Boolean),
                "Label": ua.Variant(f"n{n}", ua.VariantType.String),
            }
            for name, v in values.items():
                dv = ua.DataValue(v, SourceTimestamp=now, ServerTimestamp=now)
                await nodes[name].write_value(dv)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0))
