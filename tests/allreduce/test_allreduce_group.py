"""Group plans, the all-reduce messages and configuration: pure tests, no event loop."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import p2ptrain.allreduce as allreduce_package
from p2ptrain.allreduce import AllReduceConfig, GroupMember, GroupPlan
from p2ptrain.allreduce.protocol import (
    Hello,
    PartHeader,
    ResultHeader,
    decode_values,
    parse_part,
    parse_result,
)
from p2ptrain.allreduce.vector import flatten, unflatten
from p2ptrain.errors import ConfigError, RemoteProtocolError, TensorFormatError
from p2ptrain.node.address import PeerAddress
from p2ptrain.secure.identity import Identity

IDS = [Identity.generate().peer_id for _ in range(4)]


def member(i: int, *, client: bool = False) -> GroupMember:
    return GroupMember(IDS[i], None if client else PeerAddress("127.0.0.1", 4000 + i))


def plan(**changes: Any) -> GroupPlan:
    fields: dict[str, Any] = {
        "round_id": b"round-1",
        "members": tuple(member(i, client=i == 3) for i in range(4)),
        "boundaries": (0, 10, 25, 31, 31),
        "chunk_elements": 4,
        "reduce_timeout": 5.0,
        "round_timeout": 9.0,
        "predicted_time": 0.25,
    }
    fields.update(changes)
    return GroupPlan(**fields)


def test_the_package_exports_are_pinned() -> None:
    assert sorted(allreduce_package.__all__) == [
        "AGGREGATION_RULES",
        "AllReduceConfig",
        "AllReduceReport",
        "AllReduceService",
        "GroupMember",
        "GroupPlan",
        "RoundObserver",
        "ShardReport",
        "ThroughputConfig",
        "ThroughputMeter",
        "allreduce",
        "new_round_id",
    ]


def test_parts_and_chunks() -> None:
    p = plan()
    assert p.size == 4 and p.num_elements == 31
    assert p.part(1) == (10, 25) and p.part(3) == (31, 31)
    assert p.chunks(1) == [(10, 14), (14, 18), (18, 22), (22, 25)]
    assert p.chunks(3) == []
    assert p.reducers() == [0, 1, 2]
    assert p.index_of(IDS[2]) == 2 and p.index_of(Identity.generate().peer_id) is None
    assert p.members[0].dial_address.peer_id == IDS[0]
    with pytest.raises(ConfigError, match="client mode"):
        _ = p.members[3].dial_address


def test_from_shares_uses_the_partition_boundaries() -> None:
    members = [member(i) for i in range(3)]
    p = GroupPlan.from_shares(members, [0.5, 0.25, 0.25], 7, chunk_elements=2)
    assert p.boundaries in ((0, 4, 6, 7), (0, 3, 5, 7))
    assert len(p.round_id) == 16
    assert GroupPlan.from_shares(members, [1, 0, 0], 7).round_id != p.round_id
    with pytest.raises(ConfigError, match="expected 3 shares"):
        GroupPlan.from_shares(members, [1.0], 7)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"round_id": b""}, "round_id"),
        ({"members": ()}, "1 to 1024 members"),
        ({"members": (member(0), member(0), member(1), member(2))}, "twice"),
        ({"boundaries": (0, 10, 25, 31)}, "expected 5 boundaries"),
        ({"boundaries": (1, 10, 25, 31, 31)}, "start at 0"),
        ({"boundaries": (0, 10, 9, 31, 31)}, "never decrease"),
        ({"boundaries": (0, 10, 25, 30, 31)}, "no address"),
        ({"boundaries": (0, 10.0, 25, 31, 31)}, "ints"),
        ({"chunk_elements": 0}, "chunk_elements"),
        ({"chunk_elements": 1 << 22}, "chunk_elements"),
        ({"reduce_timeout": 0.0}, "positive"),
        ({"round_timeout": float("inf")}, "positive"),
        ({"reduce_timeout": 9.0}, "shorter"),
        ({"predicted_time": -1.0}, "predicted_time"),
    ],
)
def test_invalid_plans_are_refused(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan(**changes)


def test_a_member_address_must_name_the_member() -> None:
    with pytest.raises(ConfigError, match="another peer"):
        GroupMember(IDS[0], PeerAddress("127.0.0.1", 1, IDS[1]))


def test_the_wire_form_round_trips_and_the_digest_pins_every_field() -> None:
    p = plan()
    wire = msgpack.unpackb(msgpack.packb(p.to_wire(), use_bin_type=True))
    again = GroupPlan.from_wire(wire)
    assert again == p and again.digest == p.digest and len(p.digest) == 32
    for change in (
        {"round_id": b"round-2"},
        {"boundaries": (0, 11, 25, 31, 31)},
        {"chunk_elements": 5},
        {"reduce_timeout": 5.5},
        {"predicted_time": None},
        {"members": (member(1), member(0), member(2), member(3, client=True))},
    ):
        assert dataclasses.replace(p, **change).digest != p.digest


@pytest.mark.parametrize(
    "mutate",
    [
        lambda w: w.update(v=2),
        lambda w: w.pop("c"),
        lambda w: w.update(extra=1),
        lambda w: w.update(m="nope"),
        lambda w: w.update(m=[[b"short", None]]),
        lambda w: w["m"].__setitem__(0, [IDS[0].digest, 5]),
        lambda w: w["m"].__setitem__(0, [IDS[0].digest, "no port"]),
        lambda w: w.update(b="0,1"),
        lambda w: w.update(tr="soon"),
        lambda w: w.update(r=b"x" * 65),
    ],
)
def test_from_wire_refuses_malformed_plans(mutate: Any) -> None:
    wire = plan().to_wire()
    mutate(wire)
    with pytest.raises(RemoteProtocolError):
        GroupPlan.from_wire(wire)


@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats()
        | st.binary(max_size=40)
        | st.text(max_size=10),
        lambda c: (
            st.lists(c, max_size=4)
            | st.dictionaries(
                st.sampled_from(["v", "r", "m", "b", "c", "ts", "tr", "p", "x"]), c, max_size=9
            )
        ),
        max_leaves=30,
    )
)
def test_from_wire_raises_only_remote_protocol_errors(data: object) -> None:
    with contextlib.suppress(RemoteProtocolError):
        GroupPlan.from_wire(data)


def test_hello_round_trips_and_is_validated() -> None:
    hello = Hello(b"r", bytes(32), 2.5, "int8", 64)
    assert Hello.parse(hello.to_body()) == hello
    good = hello.to_body()
    changes: list[tuple[dict[str, Any], str]] = [
        ({"r": b""}, "round id"),
        ({"g": b"short"}, "digest"),
        ({"w": -1.0}, "weight"),
        ({"w": float("nan")}, "weight"),
        ({"w": True}, "weight"),
        ({"c": "gzip"}, "codec"),
        ({"k": 0}, "block size"),
        ({"z": 1}, "keys"),
    ]
    for change, match in changes:
        with pytest.raises(RemoteProtocolError, match=match):
            Hello.parse({**good, **change})
    with pytest.raises(RemoteProtocolError, match="map"):
        Hello.parse([1, 2])


def test_part_and_result_bodies_are_validated() -> None:
    assert parse_part(PartHeader(2, {"c": "none"}).to_body(), num_chunks=3).chunk == 2
    with pytest.raises(RemoteProtocolError, match="chunk index"):
        parse_part({"i": 3, "h": {}}, num_chunks=3)
    with pytest.raises(RemoteProtocolError, match="codec header"):
        parse_part({"i": 0, "h": 1}, num_chunks=3)
    result = ResultHeader(1, (0, 2), ((3, "why" * 100),), {"c": "none", "n": 4})
    parsed = parse_result(result.to_body(), num_chunks=2, group_size=4)
    assert parsed.contributors == (0, 2) and parsed.excluded[0][0] == 3
    assert len(parsed.excluded[0][1]) == 200
    empty = parse_result(ResultHeader(0, ()).to_body(), num_chunks=2, group_size=4)
    assert empty.contributors == () and empty.codec_header is None
    for body, match in [
        ({"i": 0, "x": [2, 0], "h": {}}, "sorted"),
        ({"i": 0, "x": [0, 0], "h": {}}, "sorted"),
        ({"i": 0, "x": [4], "h": {}}, "contributor"),
        ({"i": 0, "x": [0]}, "codec header"),
        ({"i": 0, "x": [], "h": {}}, "carries no values"),
        ({"i": 0, "x": [], "e": [[0]]}, "exclusion"),
        ({"i": 0, "x": [], "e": [[9, "x"]]}, "excluded member"),
    ]:
        with pytest.raises(RemoteProtocolError, match=match):
            parse_result(body, num_chunks=2, group_size=4)


def test_decode_values_checks_codec_and_size() -> None:
    values = torch.arange(6, dtype=torch.float32)
    header, payload = {"c": "none", "n": 6}, values.numpy().tobytes()
    assert torch.equal(decode_values(header, payload, 6), values)
    with pytest.raises(TensorFormatError, match="expected 5"):
        decode_values(header, payload, 5)
    with pytest.raises(TensorFormatError, match="unknown codec"):
        decode_values({"c": 7, "n": 6}, payload, 6)
    with pytest.raises(TensorFormatError, match="block size"):
        decode_values({"c": "int8", "n": 6, "b": 0}, payload, 6)


@given(
    body=st.dictionaries(
        st.sampled_from(["i", "x", "e", "h", "q"]),
        st.recursive(
            st.none() | st.integers(-2, 9) | st.text(max_size=5) | st.binary(max_size=5),
            lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=2), c, max_size=3),
            max_leaves=10,
        ),
    )
)
def test_message_parsers_raise_only_remote_protocol_errors(body: dict[str, Any]) -> None:
    for parse in (
        lambda: parse_result(body, num_chunks=3, group_size=5),
        lambda: parse_part(body, num_chunks=3),
        lambda: Hello.parse(body),
        lambda: decode_values(body.get("h"), b"\0" * 12, 3),  # type: ignore[arg-type]
    ):
        with contextlib.suppress(RemoteProtocolError):
            parse()


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"codec": "zip"}, "codec"),
        ({"block_size": 0}, "block_size"),
        ({"aggregation": "median"}, "aggregation"),
        ({"trim": -1}, "trim"),
        ({"clip_iterations": 0}, "clip_iterations"),
        ({"clip_radius": 0.0}, "clip_radius"),
        ({"clip_radius": float("nan")}, "clip_radius"),
    ],
)
def test_config_is_validated(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        AllReduceConfig(**changes)


def test_flatten_is_zero_copy_for_one_float32_tensor_and_round_trips() -> None:
    x = torch.randn(3, 4)
    flat, layout = flatten(x)
    assert flat.data_ptr() == x.data_ptr() and flat.shape == (12,)
    single = unflatten(flat, layout)
    assert isinstance(single, torch.Tensor) and single.shape == (3, 4)
    tensors = [torch.randn(2, 3, dtype=torch.float64), torch.randn(()), torch.randn(4).half()]
    flat, layout = flatten(tensors)
    back = unflatten(flat, layout)
    assert isinstance(back, list) and [t.dtype for t in back] == [t.dtype for t in tensors]
    for a, b in zip(back, tensors, strict=True):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-6, atol=1e-6)
    with pytest.raises(ConfigError, match="floating-point"):
        flatten([torch.ones(2, dtype=torch.int32)])
    with pytest.raises(ConfigError, match="expected tensors"):
        flatten([[1.0]])  # type: ignore[list-item]
