"""A Sparkplug B edge node for tests/sparkplug.rs, built on the Eclipse Tahu payload helpers
that mqtt-spb-wrapper ships (mqtt_spb_wrapper.spb_protobuf) and paho-mqtt.

Usage: sparkplug_node.py PORT HOST_ID EXPECTED_JSON

It publishes a BIRTH the host misses (it is not subscribed yet), waits for the host's STATE,
sends DATA the host cannot decode (so the host must ask for a rebirth), answers the rebirth,
then DATA by alias of every datatype, device DATA, historical DATA, a seq gap, a DDEATH, an
NDEATH, a reconnect with a new bdSeq, a stale NDEATH of the old session, and more DATA. It
writes the metrics the host must store to EXPECTED_JSON and prints "born" and "done".
"""
import base64
import json
import sys
import threading
import time

import paho.mqtt.client as mqtt
from mqtt_spb_wrapper.spb_protobuf import Payload, addMetric, MetricDataType as T

PORT, HOST_ID, EXPECTED = int(sys.argv[1]), sys.argv[2], sys.argv[3]
GROUP, NODE, DEVICE = "g1", "n1", "dev1"
NS = "spBv1.0"
expected = []
clock = [int(time.time() * 1000) - 60_000]

# name, alias, datatype, value, kind in the agent's records, stored value
NODE_METRICS = [
    ("i8", 1, T.Int8, -5, "i64", -5),
    ("i16", 2, T.Int16, -300, "i64", -300),
    ("i32", 3, T.Int32, -70000, "i64", -70000),
    ("i64", 4, T.Int64, -(2**40), "i64", -(2**40)),
    ("u8", 5, T.UInt8, 200, "i64", 200),
    ("u16", 6, T.UInt16, 60000, "i64", 60000),
    ("u32", 7, T.UInt32, 4_000_000_000, "i64", 4_000_000_000),
    ("u64", 8, T.UInt64, 2**62, "i64", 2**62),
    ("f32", 9, T.Float, 1.5, "f64", 1.5),
    ("f64", 10, T.Double, -2.25, "f64", -2.25),
    ("on", 11, T.Boolean, True, "bool", True),
    ("label", 12, T.String, "hello", "str", "hello"),
    ("when", 13, T.DateTime, 1_764_590_400_000, "i64", 1_764_590_400_000),
    ("note", 14, T.Text, "long text", "str", "long text"),
    ("id", 15, T.UUID, "6f1c0b5e-0000-4000-8000-000000000001", "str", "6f1c0b5e-0000-4000-8000-000000000001"),
    ("blob", 17, T.Bytes, b"\x00\x01\xff", "bytes", base64.b64encode(b"\x00\x01\xff").decode()),
]
DEVICE_METRICS = [("temp", 1, T.Double, 21.5, "f64", 21.5), ("count", 2, T.Int16, -1, "i64", -1)]


def tick():
    clock[0] += 1
    return clock[0]


def payload(seq):
    p = Payload()
    p.timestamp = tick()
    if seq is not None:
        p.seq = seq
    return p


def add(p, device, name, alias, dtype, value, kind, stored, historical=False, store=True, use_name=True):
    ts = tick()
    m = addMetric(p, name if use_name else None, alias, dtype, value, ts)
    if historical:
        m.is_historical = True
    if store:
        expected.append({"device": device, "historical": historical, "name": name,
                         "ts_ms": ts, "kind": kind, "value": stored})


def bdseq(p, n):
    addMetric(p, "bdSeq", None, T.Int64, n, tick())


class Node:
    def __init__(self, bd):
        self.bd = bd
        self.rebirth = threading.Event()
        self.state = threading.Event()
        self.c = mqtt.Client(client_id="spb-test-node-%d" % bd, clean_session=True)
        will = payload(None)
        bdseq(will, bd)
        self.c.will_set("%s/%s/NDEATH/%s" % (NS, GROUP, NODE), will.SerializeToString(), 1, False)
        self.c.on_message = self.on_message
        self.c.connect("127.0.0.1", PORT)
        self.c.loop_start()
        self.c.subscribe([("%s/%s/NCMD/%s" % (NS, GROUP, NODE), 1), ("%s/STATE/%s" % (NS, HOST_ID), 1)])

    def on_message(self, _c, _u, msg):
        if "/STATE/" in msg.topic:
            if json.loads(msg.payload).get("online"):
                self.state.set()
            return
        p = Payload()
        p.ParseFromString(msg.payload)
        if any(m.name == "Node Control/Rebirth" and m.boolean_value for m in p.metrics):
            self.rebirth.set()

    def pub(self, kind, p, device=None):
        topic = "%s/%s/%s/%s" % (NS, GROUP, kind, NODE) + ("/" + device if device else "")
        self.c.publish(topic, p.SerializeToString(), 1).wait_for_publish()

    def births(self, store):
        p = payload(0)
        bdseq(p, self.bd)
        add(p, None, "Node Control/Rebirth", 100, T.Boolean, False, "bool", False, store=store)
        for name, alias, dtype, value, kind, stored in NODE_METRICS:
            add(p, None, name, alias, dtype, value, kind, stored, store=store)
        self.pub("NBIRTH", p)
        p = payload(1)
        for name, alias, dtype, value, kind, stored in DEVICE_METRICS:
            add(p, DEVICE, name, alias, dtype, value, kind, stored, store=store)
        self.pub("DBIRTH", p, DEVICE)

    def wait(self, event, what):
        if not event.wait(60):
            sys.exit("sparkplug node: no %s from the host within 60 s" % what)


def main():
    node = Node(bd=0)
    node.births(store=False)  # the host is not subscribed yet: missed
    print("born", flush=True)
    node.wait(node.state, "STATE online")
    # DATA the host has no BIRTH for: not stored, answered by a rebirth request.
    p = payload(2)
    add(p, None, "i8", 1, T.Int8, 1, "i64", 1, store=False, use_name=False)
    node.pub("NDATA", p)
    node.wait(node.rebirth, "rebirth request")
    node.births(store=True)
    # Every datatype by alias only.
    p = payload(2)
    for name, alias, dtype, value, kind, stored in NODE_METRICS:
        add(p, None, name, alias, dtype, value, kind, stored, use_name=False)
    node.pub("NDATA", p)
    p = payload(3)
    add(p, DEVICE, "temp", 1, T.Double, 22.5, "f64", 22.5, use_name=False)
    add(p, DEVICE, "count", 2, T.Int16, -2, "i64", -2, use_name=False)
    node.pub("DDATA", p, DEVICE)
    # Historical values (older timestamps), then a gap: seq 5 is never sent.
    p = payload(4)
    add(p, None, "f64", 10, T.Double, 0.125, "f64", 0.125, historical=True, use_name=False)
    add(p, None, "u16", 6, T.UInt16, 7, "i64", 7, historical=True, use_name=False)
    node.pub("NDATA", p)
    p = payload(6)
    add(p, None, "i32", 3, T.Int32, 42, "i64", 42, use_name=False)
    node.pub("NDATA", p)
    node.pub("DDEATH", payload(7), DEVICE)
    death = payload(None)
    bdseq(death, 0)
    node.pub("NDEATH", death)
    node.c.loop_stop()
    node.c.disconnect()
    # A new session with a new bdSeq; the old session's NDEATH arrives late and is stale.
    node = Node(bd=1)
    p = payload(0)
    bdseq(p, 1)
    add(p, None, "i8", 1, T.Int8, -128, "i64", -128)
    add(p, None, "label", 2, T.String, "second", "str", "second")
    node.pub("NBIRTH", p)
    node.pub("NDEATH", death)
    p = payload(1)
    add(p, None, "i8", 1, T.Int8, 127, "i64", 127, use_name=False)
    add(p, None, "label", 2, T.String, "later", "str", "later", use_name=False)
    node.pub("NDATA", p)
    with open(EXPECTED, "w") as f:
        json.dump(expected, f)
    node.c.loop_stop()
    node.c.disconnect()
    print("done", flush=True)


main()
