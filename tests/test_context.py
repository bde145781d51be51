"""Fault contexts: canonical encoding, the FNV-1a fault key, secrets, refusal of bad input."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from faultfs.core.context import FaultContext, fnv1a64, is_fault_key
from faultfs.errors import InvalidInput


def test_fnv1a64_reference_vectors():
    assert fnv1a64(b"") == 0xCBF29CE484222325
    assert fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert fnv1a64(b"foobar") == 0x85944171F73967E8


def test_golden_encoding_and_key():
    ctx = FaultContext("file::/data/run42/field.bin", "run42_field", chunk_size=4 << 20,
                       blob_prefix="")
    assert ctx.encode() == (
        b'{"blob_prefix":"","chunk_size":4194304,"dst":"run42_field","dst_token":"",'
        b'"format":"binary","on_fault":true,"range_off":0,"range_size":0,"s3_profile":"",'
        b'"s3_region":"","src":"file::/data/run42/field.bin","src_data":"","src_token":""}'
    ), "format changed: bump the version and document it in docs/FORMAT.md"
    assert ctx.key == "fault:2407f47982dc8298"
    assert is_fault_key(ctx.key)


def test_secrets_never_reach_the_encoding_or_the_key():
    plain = FaultContext("s3://b/k", "t")
    secret = FaultContext("s3://b/k", "t", src_token="AKIA-SECRET", dst_token="hunter2")
    assert b"AKIA" not in secret.encode() and b"hunter2" not in secret.encode()
    assert secret.key == plain.key
    assert FaultContext.decode(secret.encode()) == plain


@pytest.mark.parametrize("bad", [
    {"chunk_size": -1}, {"chunk_size": (1 << 30) + 1}, {"range_off": -5},
    {"range_size": 1 << 63}, {"src": ""}, {"blob_prefix": "a/b"}, {"src": "x\x00y"},
    {"chunk_size": True}, {"range_off": "3"},
])
def test_invalid_fields_are_refused(bad):
    fields = {"src": "/x", "dst": "t", **bad}
    with pytest.raises(InvalidInput):
        FaultContext(**fields)


@pytest.mark.parametrize("data", [
    b"", b"[]", b"not json", b'{"src":"/x"}',
    b'{"blob_prefix":"chunk_","chunk_size":0,"dst":"t","dst_token":"","format":"binary",'
    b'"on_fault":true,"range_off":0,"range_size":0,"s3_profile":"","s3_region":"",'
    b'"src":"/x","src_data":"","src_token":"","extra":1}',
    b"\xff\xfe", b"{" * 100000,
])
def test_decode_refuses_what_encode_would_not_produce(data):
    with pytest.raises(InvalidInput):
        FaultContext.decode(data)


def test_decode_refuses_non_canonical_spacing():
    ctx = FaultContext("/x", "t")
    spaced = json.dumps(json.loads(ctx.encode()), sort_keys=True).encode()
    with pytest.raises(InvalidInput, match="canonical"):
        FaultContext.decode(spaced)


text = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=30)


def _valid_prefix(prefix: str) -> bool:
    from faultfs.core.names import check_blob_prefix

    try:
        check_blob_prefix(prefix)
    except InvalidInput:
        return False
    return True


@given(src=text.filter(bool), dst=text, prefix=text.filter(_valid_prefix),
       off=st.integers(0, 1 << 40), size=st.integers(0, 1 << 40), cs=st.integers(0, 1 << 30))
def test_encode_decode_round_trip_and_key_is_stable(src, dst, prefix, off, size, cs):
    ctx = FaultContext(src, dst, blob_prefix=prefix, range_off=off, range_size=size, chunk_size=cs)
    again = FaultContext.decode(ctx.encode())
    assert again == ctx
    assert again.key == ctx.key
    assert is_fault_key(ctx.key)


def test_is_fault_key():
    assert is_fault_key("fault:0123456789abcdef")
    assert not is_fault_key("fault:0123456789ABCDEF")
    assert not is_fault_key("fault:0123")
    assert not is_fault_key("chunk_0")


@pytest.mark.parametrize(("prefix", "reason"), [
    ("page:", "would name chunks like pages"), (".c", "would name chunks like pages or hidden"),
    ("a\tb", "control character"), ("a/b", "contains '/'"), ("x\udcff", "not valid UTF-8"),
])
def test_blob_prefixes_that_would_collide_or_break_listings_are_refused(prefix, reason):
    with pytest.raises(InvalidInput, match=reason):
        FaultContext("/x", "t", blob_prefix=prefix)


def test_a_source_name_that_is_not_utf8_is_refused_clearly():
    with pytest.raises(InvalidInput, match=r"source '/data/x.+' is not valid UTF-8"):
        FaultContext("/data/x\udcff.bin", "t")
