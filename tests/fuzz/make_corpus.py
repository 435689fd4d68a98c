#!/usr/bin/env python3
"""Writes the seed corpus of the safetensors fuzz target (tests/fuzz/corpus/).

Stdlib only, so it runs anywhere: each seed is a small safetensors image, valid or broken in one
known way. Re-run after changing the list: python3 tests/fuzz/make_corpus.py
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus")


def image(header_text: bytes, data: bytes = b"", pad: bool = True) -> bytes:
    if pad:
        header_text += b" " * ((8 - len(header_text) % 8) % 8)
    return struct.pack("<Q", len(header_text)) + header_text + data


def valid(tensors, metadata=None):
    """tensors: list of (name, dtype, shape, raw bytes) in name order."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    off = 0
    data = b""
    for name, dt, shape, raw in sorted(tensors):
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        data += raw
    return image(json.dumps(header, separators=(",", ":"), sort_keys=True).encode(), data)


def f32(*v):
    return struct.pack("<%df" % len(v), *v)


ROUTER_META = {
    "format": "moe-golden/1",
    "op": "topk_router",
    "dtype": "float32",
    "seed": "7",
    "params": '{"group_topk":0,"num_groups":0,"routing_map_format":"bytemap",'
    '"scaling_factor":1.0,"score_function":"softmax","topk":1,"use_pre_softmax":false}',
    "x-case": "op=topk_router dtype=float32 regime=uniform seed=7 E=2 K=1 T=1",
}

SEEDS = {
    "empty_header": image(b"{}"),
    "metadata_only": valid([], {"format": "moe-golden/1"}),
    "all_dtypes": valid([
        ("a.f64", "F64", [1], struct.pack("<d", 1.5)),
        ("b.f32", "F32", [2], f32(1.0, -2.0)),
        ("c.bf16", "BF16", [1], b"\x80\x3f"),
        ("d.f16", "F16", [1], b"\x00\x3c"),
        ("e.i64", "I64", [1], struct.pack("<q", -3)),
        ("f.i32", "I32", [1], struct.pack("<i", 4)),
        ("g.u8", "U8", [2], b"\x05\xff"),
        ("h.bool", "BOOL", [2], b"\x00\x01"),
        ("i.scalar", "F32", [], f32(3.0)),
        ("j.empty", "F32", [0, 4], b""),
    ]),
    "router_file": valid([
        ("input.logits", "F32", [1, 2], f32(0.5, -0.5)),
        ("output.probs", "F32", [1, 2], f32(1.0, 0.0)),
        ("output.routing_map", "BOOL", [1, 2], b"\x01\x00"),
        ("output.saved_scores", "F32", [1, 2], f32(1.0, float("-inf"))),
        ("cotangent.probs", "F32", [1, 2], f32(0.25, 0.75)),
        ("grad.logits", "F32", [1, 2], f32(0.0, 0.0)),
    ], ROUTER_META),
    "unsorted_offsets": image(
        b'{"b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
        b'"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}', b"\x01\x02\x03"),
    "duplicate_key": image(b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                           b'"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x01"),
    "overlap": image(b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
                     b'"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}', b"\x01\x02\x03"),
    "float_offset": image(b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0.0,1]}}', b"\x01"),
    "shape_overflow": image(
        b'{"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,0]}}'),
    "unknown_dtype": image(b'{"a":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}}', b"\x01"),
    "metadata_number": image(b'{"__metadata__":{"seed":7}}'),
    "escapes": image(b'{"__metadata__":{"k\\u00e9y":"v\\ud83d\\ude00\\n"}}'),
    "truncated": struct.pack("<Q", 64) + b'{"a":',
    "not_brace": image(b'  {}'),
}


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, data in SEEDS.items():
        with open(os.path.join(OUT, name + ".safetensors"), "wb") as f:
            f.write(data)
    print("wrote %d seeds to %s" % (len(SEEDS), OUT))


if __name__ == "__main__":
    main()
