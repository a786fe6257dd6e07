"""An OPC UA server for the agent's OPC UA source tests (edge-agent/tests/opcua.rs and
edge-agent/tests/opcua_security.rs).

Usage: python3 opcua_server.py PORT [BASE] [--secure CERT KEY]

Serves opc.tcp://127.0.0.1:PORT/tributary/ with asyncua (pinned in .ci/test), security policy
None, anonymous access. With --secure it offers only Basic256Sha256 with SignAndEncrypt
(still anonymous), its application URI "urn:tributary:test-server", with the certificate CERT
(DER) and the private key KEY (PEM); when CERT does not exist yet, a self-signed pair is
written there first: common name "Tributary test server", subjectAltName the application URI
(first, as OPC UA wants it), then DNS localhost and IP 127.0.0.1, valid for one day. Any client
certificate is accepted (no certificate validator is set). Namespace "urn:tributary:test" (index 2) holds four variables, all
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
import ipaddress
import logging
import os
import sys

from asyncua import Server, ua

APPLICATION_URI = "urn:tributary:test-server"


def make_cert(cert_path: str, key_path: str) -> None:
    """Writes a self-signed server certificate (DER) and its key (PEM)."""
    from asyncua.crypto import cert_gen
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding
    from cryptography.x509.oid import ExtendedKeyUsageOID

    key = cert_gen.generate_private_key()
    cert = cert_gen.generate_self_signed_app_certificate(
        key,
        "Tributary test server",
        {},
        [
            x509.UniformResourceIdentifier(APPLICATION_URI),
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ],
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        days=1,
    )
    with open(key_path, "wb") as f:
        f.write(cert_gen.dump_private_key_as_pem(key))
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(Encoding.DER))


async def main(port: int, base: int, secure) -> None:
    logging.basicConfig(level=logging.WARNING)
    server = Server()
    await server.init()
    server.set_endpoint(f"opc.tcp://127.0.0.1:{port}/tributary/")
    server.set_server_name("Tributary test server")
    if secure is None:
        server.set_security_policy([ua.SecurityPolicyType.NoSecurity])
    else:
        cert_path, key_path = secure
        if not os.path.exists(cert_path):
            make_cert(cert_path, key_path)
        await server.set_application_uri(APPLICATION_URI)
        server.set_security_policy([ua.SecurityPolicyType.Basic256Sha256_SignAndEncrypt])
        await server.load_certificate(cert_path)
        await server.load_private_key(key_path)
    ns = await server.register_namespace("urn:tributary:test")
    assert ns == 2, ns
    plant = await server.nodes.objects.add_object(ua.NodeId("Plant", ns), "Plant")
    # The initial values are already this server's (a client that subscribes before the first
    # write gets them): the Counter starts at BASE + 1, like the first write.
    specs = [
        ("Counter", ua.VariantType.Int32, base + 1),
        ("Temp", ua.VariantType.Double, 20.0),
        ("Running", ua.VariantType.Boolean, False),
        ("Label", ua.VariantType.String, f"n{base + 1}"),
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
    args = sys.argv[1:]
    secure = None
    if "--secure" in args:
        at = args.index("--secure")
        secure = (args[at + 1], args[at + 2])
        del args[at : at + 3]
    asyncio.run(main(int(args[0]), int(args[1]) if len(args) > 1 else 0, secure))
