"""A Sparkplug B subscriber (a SCADA host's view) for republish_sparkplug.rs, built on the
Eclipse Tahu payload that mqtt-spb-wrapper ships (mqtt_spb_wrapper.spb_protobuf) and paho-mqtt.

Usage: sparkplug_host.py PORT GROUP

It subscribes to spBv1.0/GROUP/# and prints "ready" once the subscription is granted, then
one JSON line per message received, in arrival order:
  {"kind": "NBIRTH", "node": ..., "device": ... or null, "seq": ... or null,
   "metrics": [{"name", "datatype", "timestamp", "is_historical", "is_null", "value"}]}
A line "rebirth NODE" on stdin makes it send the NCMD `Node Control/Rebirth = true` to NODE.
"""
import base64
import json
import sys
import threading

import paho.mqtt.client as mqtt
from mqtt_spb_wrapper.spb_protobuf import Payload, addMetric, MetricDataType as T

PORT, GROUP = int(sys.argv[1]), sys.argv[2]
NS = "spBv1.0"
out_lock = threading.Lock()


def emit(obj):
    with out_lock:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


def value_of(m):
    which = m.WhichOneof("value")
    if which is None:
        return None
    v = getattr(m, which)
    if which == "bytes_value":
        return base64.b64encode(v).decode()
    return v


def on_connect(client, userdata, flags, rc):
    if rc != 0:
        print("connect refused: %s" % rc, file=sys.stderr)
        sys.exit(1)
    client.subscribe("%s/%s/#" % (NS, GROUP), qos=1)


def on_subscribe(client, userdata, mid, granted):
    emit("ready")


def on_message(client, userdata, msg):
    parts = msg.topic.split("/")
    if len(parts) < 4:
        return
    kind, node = parts[2], parts[3]
    device = parts[4] if len(parts) > 4 else None
    if kind == "NCMD":
        return
    p = Payload()
    p.ParseFromString(msg.payload)
    metrics = []
    for m in p.metrics:
        metrics.append({
            "name": m.name,
            "datatype": m.datatype,
            "timestamp": m.timestamp if m.HasField("timestamp") else None,
            "is_historical": m.is_historical,
            "is_null": m.is_null,
            "value": value_of(m),
        })
    emit({
        "kind": kind,
        "node": node,
        "device": device,
        "seq": p.seq if p.HasField("seq") else None,
        "metrics": metrics,
    })


def commands(client):
    for line in sys.stdin:
        words = line.split()
        if len(words) == 2 and words[0] == "rebirth":
            p = Payload()
            addMetric(p, "Node Control/Rebirth", None, T.Boolean, True)
            client.publish("%s/%s/NCMD/%s" % (NS, GROUP, words[1]), p.SerializeToString(), 0)


client = mqtt.Client(client_id="spb-test-host", clean_session=True)
client.on_connect = on_connect
client.on_subscribe = on_subscribe
client.on_message = on_message
client.connect("127.0.0.1", PORT, keepalive=30)
threading.Thread(target=commands, args=(client,), daemon=True).start()
client.loop_forever()
