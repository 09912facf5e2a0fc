"""The compiled topology the registry stores next to the TOML: it decodes into exactly the
topology the TOML parses into, every reader falls back to the TOML when it is missing, foreign
or damaged, and ``fabric init`` compiles a topology an older vmlend stored without it."""

from __future__ import annotations

import ast
import hashlib
import random
import subprocess
import sys
from pathlib import Path

import msgspec
import msgspec.inspect
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.daemon_marks import REGISTRIES
from tests.support.hypothesis_tiers import examples
from tests.support.older_state import etcd_before_generations
from tests.support.paths import TESTS
from tests.support.simfabric import fabric_topology, small_topology, star_topology
from vmlend.errors import TopologyError
from vmlend.registry import TopologyRecord, open_registry
from vmlend.registry import etcd_keys as etcd_keys_mod
from vmlend.topology import compiled as compiled_mod
from vmlend.topology.chips import Chip
from vmlend.topology.compiled import (
    COMPILED_FORMAT,
    compile_topology,
    decode_compiled,
    stored_topology,
)
from vmlend.topology.model import Topology
from vmlend.topology.parse import parse_topology
from vmlend.wiring.fabric import default_topology_text, init_fabric, open_fabric

BIG_BAR = """
[[node]]
name = "l"
id = 1
  [[node.adapter]]
  index = 0
  [[node.device]]
  fdid = 0x100
  bdf = "0000:01:00.0"
  kind = "gpu"
  vendor = 0x10de
  device = 0x1db6
  class = 0x030200
  bars = [ { index = 0, size = "1099511627776TiB", kind = "mem64" } ]
[[node]]
name = "b"
id = 2
  [[node.adapter]]
  index = 0
[[link]]
ends = ["l:0", "b:0"]
"""


def round_trips(topology: Topology) -> bool:
    return decode_compiled(compile_topology(topology, "digest"), "digest") == topology


def suite_topologies() -> list[tuple[str, str]]:
    """Every valid topology text the test suite writes literally (TOML with ``[[node]]``),
    the test helpers' generated ones, and the shipped default, with a name for each."""
    found = [(default_topology_text()[0], "default")]
    for module in sorted(TESTS.rglob("*.py")):
        if module.name == Path(__file__).name:
            continue  # BIG_BAR here is meant not to compile
        for node in ast.walk(ast.parse(module.read_text())):
            literal = isinstance(node, ast.Constant) and isinstance(node.value, str)
            if literal and "[[node]]" in node.value:
                found.append((node.value, f"{module.name}:{node.lineno}"))
    found += [
        (small_topology(), "small"),
        (small_topology(isolated=True, devices=5, lut_entries=4), "small isolated"),
        (small_topology(bars='[ { index = 0, size = "4GiB", kind = "mem64" } ]'), "small mem64"),
        (star_topology(3, 4), "star"),
        (fabric_topology(4, 3), "fabric 4x3"),
    ]
    return found


def test_the_suites_topologies_decode_equal_to_what_their_toml_parses_into():
    checked = 0
    for text, where in suite_topologies():
        try:
            parsed = parse_topology(text, where)
        except TopologyError:
            continue  # a test of bad input
        assert round_trips(parsed), where
        checked += 1
    assert checked >= 10  # the scan found the suite's topologies


@settings(max_examples=examples(60), deadline=None)
@given(st.from_type(Topology))
def test_any_topology_either_compiles_into_itself_or_is_not_compiled(topology):
    blob = compile_topology(topology, "d")
    assert blob is None or decode_compiled(blob, "d") == topology


def test_a_size_no_host_can_address_is_refused_when_the_topology_is_read(tmp_path):
    # 2^80 bytes: beyond 64 bits, and far beyond the 52-bit physical address of any host
    with pytest.raises(TopologyError, match="at most 4096TiB"):
        parse_topology(BIG_BAR, "big.toml")
    with pytest.raises(TopologyError):
        init_fabric(tmp_path / "s.db", BIG_BAR, "big.toml", node="b")


def test_an_integer_beyond_64_bits_is_not_compiled():
    """No parsed topology has one any more, but the compiled form still refuses to encode what
    would not come back equal (a topology built in code)."""
    topology = parse_topology(BIG_BAR.replace("1099511627776TiB", "1TiB"), "big.toml")
    device = topology.devices[0]
    bar = msgspec.structs.replace(device.bars[0], size=1 << 80)
    huge = msgspec.structs.replace(
        topology, devices=(msgspec.structs.replace(device, bars=(bar,)),)
    )
    assert compile_topology(topology, "d") is not None
    assert compile_topology(huge, "d") is None


def shape(t: msgspec.inspect.Type, seen: set[type]) -> str:
    """What decoding depends on in the type ``t``, as text: Structs with their options and
    fields (name, wire name, type, default), containers, enums with their values."""
    mi = msgspec.inspect
    if isinstance(t, mi.StructType):
        if t.cls in seen:
            return t.cls.__qualname__
        seen.add(t.cls)
        options = (t.array_like, t.forbid_unknown_fields, t.tag, t.tag_field)
        fields = ", ".join(
            f"{f.name}/{f.encode_name}: {shape(f.type, seen)}"
            + ("" if f.required else f" = {msgspec.json.encode(f.default).decode()}")
            + ("" if f.default_factory is msgspec.NODEFAULT else f" = {f.default_factory!r}")
            for f in t.fields
        )
        return f"{t.cls.__qualname__}{options}{{{fields}}}"
    if isinstance(t, mi.VarTupleType):
        return f"tuple[{shape(t.item_type, seen)}, ...]"
    if isinstance(t, mi.TupleType):
        return f"tuple[{', '.join(shape(i, seen) for i in t.item_types)}]"
    if isinstance(t, mi.UnionType):
        return " | ".join(shape(i, seen) for i in t.types)
    if isinstance(t, mi.EnumType):
        return f"{t.cls.__qualname__}{sorted(m.value for m in t.cls)}"
    if isinstance(
        t, mi.IntType | mi.StrType | mi.BoolType | mi.NoneType | mi.FloatType | mi.BytesType
    ):
        return type(t).__name__
    raise AssertionError(f"describe {t!r} here, then re-pin the shape")


def test_the_model_shape_is_pinned_to_the_compiled_format():
    # The compiled bytes are a Topology's parts as msgpack: a changed Struct (a field added,
    # renamed, retyped, a new default) could decode old bytes into a topology the TOML no
    # longer gives. Such a change must bump COMPILED_FORMAT and update this pin.
    described = shape(msgspec.inspect.type_info(Topology), set())
    described += shape(msgspec.inspect.type_info(compiled_mod._Header), set())
    digest = hashlib.sha256(described.encode()).hexdigest()[:16]
    # /3: NodeSpec.iommu; /4: PcieElement.chip, LinkSpec.chip; /5: sliced;
    # /6: LinkSpec.requester_entries; /7: a header naming where each table lies
    pinned = {"vmlend-topology/7": "a6afb36178c57ed4"}
    assert pinned.get(COMPILED_FORMAT) == digest, (
        "the Topology model changed: bump COMPILED_FORMAT (vmlend/topology/compiled.py)"
        f" and pin the new shape here ({digest}): {described}"
    )


def test_what_the_parser_derives_is_pinned_to_the_compiled_format():
    # Old bytes are trusted as long as the format tag matches: a parser that derives something
    # else from the same text (a default window, RAM, a VF's DMA width, a name) must bump
    # COMPILED_FORMAT too. Fixed inputs: the default topology and the generated ones.
    texts = [default_topology_text()[0], small_topology(), star_topology(3, 4)]
    texts.append(fabric_topology(4, 3))
    body = b"".join(msgspec.msgpack.encode(parse_topology(t, "pin.toml")) for t in texts)
    digest = hashlib.sha256(body).hexdigest()[:16]
    # repinned without a bump when an input changes and the parser does not (issue 23 part 3:
    # the default topology gained gamma's second adapter; parse.py and the model are unchanged)
    # /4: each element's chip; /5: sliced; /6: each switch's requester_entries; /7: the
    # blob's layout only (the parser's output is unchanged)
    pinned = {"vmlend-topology/7": "f9daa7ac94089527"}
    assert pinned.get(COMPILED_FORMAT) == digest, (
        "the parser's output changed: bump COMPILED_FORMAT (vmlend/topology/compiled.py) and pin"
        f" it here ({digest})"
    )


def test_damaged_blobs_never_raise_nor_decode_into_another_topology():
    # Every one-byte change of a real blob: the TOML's topology or None, never an exception
    # (e.g. a bad UTF-8 byte in a name) and never a different topology.
    text, source = default_topology_text()
    parsed = parse_topology(text, source)
    blob = compile_topology(parsed, "d")
    assert blob is not None
    rnd = random.Random(14)
    for _ in range(3000):
        damaged = bytearray(blob)
        damaged[rnd.randrange(len(damaged))] = rnd.randrange(256)
        assert decode_compiled(bytes(damaged), "d") in (None, parsed)


def test_fabric_init_repairs_a_compiled_form_its_text_no_longer_gives(tmp_path):
    # A blob of the right format and digest that decodes into something else (a parser that
    # changed without a format bump, or damage the check missed): init with the same text
    # rewrites it from the text instead of refusing the "different" topology.
    path = tmp_path / "s.db"
    text, source = default_topology_text()
    init_fabric(path, text, source, node="gamma")
    parsed = parse_topology(text, source)
    other = msgspec.structs.replace(parsed, name="not-what-the-text-says")
    with open_registry(path) as reg, reg.write() as tx:
        tx.set_topology_compiled(compile_topology(other, tx.topology().digest))
    with open_fabric(path, "gamma") as fabric:
        assert fabric.topology().name == "not-what-the-text-says"  # the cache is trusted
    assert init_fabric(path, text, source, node="gamma").action == "unchanged"
    with open_fabric(path, "gamma") as fabric:
        assert fabric.topology() == parsed


@pytest.mark.parametrize(
    "blob",
    [
        None,
        b"",
        b"not msgpack at all",
        msgspec.msgpack.encode(["vmlend-topology/0", "d", {"name": "x"}]),  # another format
        msgspec.msgpack.encode([COMPILED_FORMAT, "other digest", {"name": "x"}]),
        msgspec.msgpack.encode([COMPILED_FORMAT, "d", {"name": 5}]),  # not a Topology
        msgspec.msgpack.encode({"format": COMPILED_FORMAT}),
    ],
    ids=["none", "empty", "garbage", "format", "digest", "invalid", "shape"],
)
def test_a_missing_foreign_or_damaged_blob_is_not_decoded(blob):
    assert decode_compiled(blob, "d") is None


def test_a_truncated_blob_falls_back_to_the_same_topology():
    text, source = default_topology_text()
    parsed = parse_topology(text, source)
    blob = compile_topology(parsed, "d")
    assert blob is not None
    for cut in (1, len(blob) // 2, len(blob) - 1):
        rec = TopologyRecord("n", source, text, "d", "", 0.0, blob[:cut])
        assert stored_topology(rec) == parsed


def test_the_compiled_path_imports_no_toml_parser(tmp_path):
    init_fabric(tmp_path / "s.db", *default_topology_text(), node="gamma")
    code = (
        "import sys; from vmlend.registry import open_registry;"
        " from vmlend.topology.compiled import stored_topology;"
        f" reg = open_registry({str(tmp_path / 's.db')!r});"
        " tx = reg.read().__enter__(); t = stored_topology(tx.topology());"
        " print(len(t.devices), 'tomllib' in sys.modules, 'vmlend.topology.parse' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, text=True)
    assert out.returncode == 0, out.stderr
    count, tomllib, parser = out.stdout.split()
    assert int(count) > 0 and (tomllib, parser) == ("False", "False")


# --- in the registry, either backend ---------------------------------------------------------
@pytest.fixture(params=REGISTRIES)
def location(request, tmp_path):
    if request.param == "etcd":
        return request.getfixturevalue("etcd_url")
    return tmp_path / "s.db"


def stored(location) -> TopologyRecord:
    # opened as the upgrade opens it: a cluster of an older layout is read too
    with open_registry(location, upgrading=True) as reg, reg.read() as tx:
        return tx.topology()


def test_fabric_init_stores_the_compiled_topology(location):
    text, source = default_topology_text()
    init_fabric(location, text, source, node="gamma")
    rec = stored(location)
    assert decode_compiled(rec.compiled_bytes(), rec.digest) == parse_topology(text, source)
    with open_fabric(location, "gamma") as fabric:
        assert fabric.topology() == parse_topology(text, source)


def test_a_damaged_compiled_topology_opens_from_the_toml_and_init_compiles_it_again(location):
    text, source = default_topology_text()
    init_fabric(location, text, source, node="gamma")
    with open_registry(location) as reg:
        reg.transact(lambda tx: tx.set_topology_compiled(b"\x93\xa1x damaged"))
    assert decode_compiled(stored(location).compiled_bytes(), stored(location).digest) is None
    with open_fabric(location, "gamma") as fabric:
        assert fabric.topology() == parse_topology(text, source)
    assert init_fabric(location, text, source, node="gamma").action == "unchanged"
    rec = stored(location)
    assert decode_compiled(rec.compiled_bytes(), rec.digest) == parse_topology(text, source)


def test_an_etcd_record_without_the_compiled_key_is_upgraded_with_it(etcd_url):
    """A layout-2 cluster is opened only by ``vmlend registry upgrade`` (layout 5 does not
    read its holds): the upgrade compiles a record that has no compiled form, and the fabric
    then opens as its text says."""
    from vmlend.registry.upgrade import upgrade

    text, source = default_topology_text()
    # as a vmlend before the compiled topology (and before generations) wrote it
    etcd_before_generations(etcd_url, text, source, compiled=False)
    assert stored(etcd_url).compiled_bytes() is None
    with open_registry(etcd_url, upgrading=True) as reg:
        upgrade(reg)  # type: ignore[arg-type]
    with open_fabric(etcd_url, "gamma") as fabric:
        assert fabric.topology() == parse_topology(text, source)
    assert init_fabric(etcd_url, text, source).action == "unchanged"
    rec = stored(etcd_url)
    assert decode_compiled(rec.compiled_bytes(), rec.digest) == parse_topology(text, source)
    with open_registry(etcd_url) as reg:  # now a generation, the old record gone
        _rev, kvs = reg.gateway.range(reg.keys.topology_record, None, 0)
        assert kvs == []
        _rev, kvs = reg.gateway.range(reg.keys.topology_head, None, 0)
        assert kvs and b"vmlend-topology-pieces" in kvs[0].value


def test_an_etcd_record_with_a_compiled_key_that_is_not_base64_opens_from_the_toml():
    record = {"compiled": "not base64 !", "text": "x"}
    assert etcd_keys_mod.compiled_of(record) is None
    assert etcd_keys_mod.compiled_of({"compiled": 7}) is None
    assert etcd_keys_mod.compiled_of({}) is None


def test_a_topology_compiled_before_the_chips_is_parsed_from_its_text():
    # vmlend-topology/3 had no chips: its blob is not trusted, the stored text is parsed
    # again; a text without chips (every topology stored before) gets the default chips, and
    # a text that names one has it
    import zlib

    text, source = default_topology_text()
    for stored_text, chip in [
        (text, Chip.PM8536),
        (text.replace('name = "mxs824"\n', 'name = "mxs824"\nchip = "PEX8733"\n', 1), Chip.PEX8733),
    ]:
        parsed = parse_topology(stored_text, source)
        shape_3 = msgspec.to_builtins(parsed)  # what /3 stored: no "chip" anywhere
        for link in shape_3["links"]:
            del link["chip"]
        for node in shape_3["nodes"]:
            for element in node["pcie"]:
                del element["chip"]
        body = msgspec.msgpack.encode(shape_3)
        blob = msgspec.msgpack.encode(
            ["vmlend-topology/3", "d", zlib.crc32(body), msgspec.Raw(body)]
        )
        assert decode_compiled(blob, "d") is None
        got = stored_topology(TopologyRecord("n", source, stored_text, "d", "", 0.0, blob))
        assert got == parsed and got.switch_chip("mxs824") is chip
        assert got.switch_chip("mxs824b") is Chip.PM8536


def test_a_topology_compiled_before_the_iommu_setting_is_parsed_from_its_text():
    # vmlend-topology/2 had no NodeSpec.iommu: its blob is not trusted, the stored text is
    # parsed again, and a node whose text turns its IOMMU off gets it off
    import zlib

    text, source = default_topology_text()
    text = text.replace('name = "beta"\n', 'name = "beta"\niommu = false\n', 1)
    parsed = parse_topology(text, source)
    shape_2 = msgspec.to_builtins(parsed)  # what /2 stored: nodes without "iommu"
    for node in shape_2["nodes"]:
        del node["iommu"]
    body = msgspec.msgpack.encode(shape_2)
    blob = msgspec.msgpack.encode(["vmlend-topology/2", "d", zlib.crc32(body), msgspec.Raw(body)])
    assert decode_compiled(blob, "d") is None
    rec = TopologyRecord("n", source, text, "d", "", 0.0, blob)
    got = stored_topology(rec)
    assert got == parsed and not got.node("beta").iommu and got.node("alpha").iommu
