"""Building blocks of etcd v3 requests: key ranges, transaction compares and operations."""

from __future__ import annotations

from typing import Any

from etcd3 import etcdrpc


def prefix_end(prefix: str) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    for i in range(len(raw) - 1, -1, -1):
        if raw[i] < 0xFF:
            raw[i] += 1
            return bytes(raw[: i + 1])
    return b"\0"


# -- transaction building blocks ------------------------------------------------------------

_RESULTS = {"==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}


def compare(key: str, target: str, op: str, value: int | bytes) -> Any:
    """A txn compare: ``target`` is mod, create, version, lease or value; ``op`` is == != < >."""
    cmp = etcdrpc.Compare()
    cmp.key = key.encode()
    cmp.result = etcdrpc.Compare.CompareResult.Value(_RESULTS[op])
    cmp.target = etcdrpc.Compare.CompareTarget.Value(target.upper())
    field = {"mod": "mod_revision", "create": "create_revision", "version": "version",
             "lease": "lease"}  # fmt: skip
    if target == "value":
        cmp.value = value if isinstance(value, bytes) else str(value).encode()
    else:
        setattr(cmp, field[target], int(value))
    return cmp


def compare_range(prefix: str, target: str, op: str, value: int) -> Any:
    """A compare that must hold for *every* key under ``prefix`` (true when there is none)."""
    cmp = compare(prefix, target, op, value)
    cmp.range_end = prefix_end(prefix)
    return cmp


def put_op(key: str, value: bytes | str, lease: int = 0) -> Any:
    data = value.encode() if isinstance(value, str) else value
    return etcdrpc.RequestOp(
        request_put=etcdrpc.PutRequest(key=key.encode(), value=data, lease=lease)
    )


def delete_op(key: str, prefix: bool = False) -> Any:
    req = etcdrpc.DeleteRangeRequest(key=key.encode())
    if prefix:
        req.range_end = prefix_end(key)
    return etcdrpc.RequestOp(request_delete_range=req)


def get_op(key: str, prefix: bool = False) -> Any:
    req = etcdrpc.RangeRequest(key=key.encode())
    if prefix:
        req.range_end = prefix_end(key)
    return etcdrpc.RequestOp(request_range=req)
