"""Selectors and the [alias] table: what a user may ask for, what each means against the
fabric's kinds, and one line saying what to do for everything else."""

from __future__ import annotations

import pytest

from vmlend.errors import ConfigError
from vmlend.topology.selectors import (
    Alias,
    Criteria,
    DeviceWish,
    parse_aliases,
    parse_pci_id,
    parse_wish,
    resolve,
)

KINDS = ("gpu", "nic", "nvme", "vf")
A100 = Alias(0x10DE, 0x20B0)


@pytest.mark.parametrize(
    ("text", "wish"),
    [
        ("gpu", DeviceWish("gpu")),
        ("GPU:2", DeviceWish("gpu", 2)),
        ("nvme,lender=alpha", DeviceWish("nvme", 1, "alpha")),
        ("vf:3,lender=beta", DeviceWish("vf", 3, "beta")),
        ("a100:2", DeviceWish("a100", 2)),
        ("vendor=10de,product=1db4", DeviceWish(None, 1, None, 0x10DE, 0x1DB4)),
        ("vendor=0x10de,product=0X1DB4", DeviceWish(None, 1, None, 0x10DE, 0x1DB4)),
        ("VENDOR=10DE,PRODUCT=1db4,count=2", DeviceWish(None, 2, None, 0x10DE, 0x1DB4)),
        ("product=a54,vendor=8086,lender=alpha", DeviceWish(None, 1, "alpha", 0x8086, 0x0A54)),
        ("gpu,vendor=10de,product=1db4", DeviceWish("gpu", 1, None, 0x10DE, 0x1DB4)),
        ("gpu,count=2", DeviceWish("gpu", 2)),
        ("0x10", None),
        ("16", None),
    ],
)
def test_selectors_parse_and_fdids_are_left_to_the_fdid_parser(text, wish):
    assert parse_wish(text) == wish


@pytest.mark.parametrize(
    "text",
    [
        "gpu",
        "gpu:3,lender=beta",
        "vendor=10de,product=1db4",
        "vendor=10de,product=1db4,lender=alpha,count=4",
        "gpu,vendor=8086,product=0a54",
    ],
)
def test_a_wish_is_said_as_a_selector_that_reads_back_the_same(text):
    wish = parse_wish(text)
    assert wish is not None and parse_wish(str(wish)) == wish


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("gpu:0", "1 to 64 devices"),
        ("gpu:65", "1 to 64 devices"),
        ("gpu:x", "give an fdid"),
        ("gpu,color=red", "'color=red' is not an attribute"),
        ("gpu,lender=", "'lender=' is not an attribute"),
        ("gpu;x", "give an fdid"),
        ("-", "give an fdid"),
        ("vendor=10de", "give vendor= and product= together"),
        ("product=1db4", "give vendor= and product= together"),
        ("gpu,vendor=10de", "give vendor= and product= together"),
        ("vendor=10dg,product=1db4", "bad vendor id '10dg'"),
        ("vendor=10de,product=12345", "bad product id '12345'"),
        ("vendor=0x,product=1db4", "bad vendor id '0x'"),
        ("vendor=-1,product=1db4", "bad vendor id '-1'"),
        ("vendor=ffff,product=1db4", "what a missing device reads"),
        ("vendor=10de,product=1db4,vendor=8086", "vendor= is given twice"),
        ("gpu:2,count=2", "keep one"),
        ("vendor=10de,product=1db4,count=0", "1 to 64 devices"),
        ("lender=alpha", "give an fdid"),
        ("vendor=10de,product=1db4,", "'' is not an attribute"),
    ],
)
def test_bad_selectors_are_one_line_saying_what_a_selector_is(text, says):
    with pytest.raises(ConfigError) as e:
        parse_wish(text)
    msg = str(e.value)
    assert msg.startswith(f"bad device {text!r}: ") and says in msg and "\n" not in msg


@pytest.mark.parametrize(
    ("value", "number"),
    [("10de", 0x10DE), ("0x10DE", 0x10DE), ("a54", 0xA54), (0x8086, 0x8086), (0, 0)],
)
def test_pci_ids_are_hex_as_lspci_shows_them_or_toml_integers(value, number):
    assert parse_pci_id(value, "vendor") == number


@pytest.mark.parametrize("value", ["", "0x", "10de ", "1_0de", "१०", "12345", 0x10000, -1, True])
def test_anything_else_is_no_pci_id(value):
    with pytest.raises(ConfigError, match="bad vendor id"):
        parse_pci_id(value, "vendor")


def test_the_alias_table_reads_hex_strings_and_integers():
    table = {
        "a100": {"vendor": "10de", "product": "20b0"},
        "v100": {"vendor": "0x10de", "product": 0x1DB4},
        "p4500_nvme": {"product": "0a54", "vendor": 0x8086},
    }
    assert parse_aliases(table, "/etc/vmlend/vmlend.toml") == {
        "a100": A100,
        "v100": Alias(0x10DE, 0x1DB4),
        "p4500_nvme": Alias(0x8086, 0x0A54),
    }
    assert parse_aliases({}, "f") == {}


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ("a100", "alias must be a table"),
        ({"a100": "10de:20b0"}, "alias.a100 = '10de:20b0' must be a table"),
        ({"a100": {"vendor": "10de"}}, "alias.a100 has no product; give both"),
        ({"a100": {"product": "20b0"}}, "alias.a100 has no vendor; give both"),
        ({"a100": {"vendor": "10de", "product": "20b0", "numa": 1}}, "has numa;"),
        ({"a100": {"vendor": "10dex", "product": "20b0"}}, "alias.a100: bad vendor id '10dex'"),
        ({"a100": {"vendor": "10de", "product": True}}, "alias.a100: bad product id True"),
        ({"A100": {"vendor": "10de", "product": "20b0"}}, "alias 'A100' is no name"),
        ({"1gpu": {"vendor": "10de", "product": "20b0"}}, "alias '1gpu' is no name"),
        ({"a,b": {"vendor": "10de", "product": "20b0"}}, "alias 'a,b' is no name"),
    ],
)
def test_a_bad_alias_table_names_the_file_and_the_alias(table, says):
    with pytest.raises(ConfigError) as e:
        parse_aliases(table, "/etc/vmlend/vmlend.toml")
    msg = str(e.value)
    assert msg.startswith("/etc/vmlend/vmlend.toml: ") and says in msg and "\n" not in msg


def test_a_name_is_a_kind_or_an_alias_and_ids_stand_alone():
    aliases = {"a100": A100}
    assert resolve(DeviceWish("gpu"), aliases, KINDS) == Criteria("gpu", None, None, None)
    assert resolve(DeviceWish("a100", 2, "beta"), aliases, KINDS) == Criteria(
        None, 0x10DE, 0x20B0, "beta"
    )
    ids = DeviceWish(None, 1, None, 0x8086, 0x0A54)
    assert resolve(ids, aliases, KINDS) == Criteria(None, 0x8086, 0x0A54, None)
    both = DeviceWish("nvme", 1, None, 0x8086, 0x0A54)
    assert resolve(both, aliases, KINDS) == Criteria("nvme", 0x8086, 0x0A54, None)


def test_an_alias_with_the_name_of_a_kind_is_refused_when_used():
    aliases = {"gpu": A100, "a100": A100}
    with pytest.raises(ConfigError, match=r"alias 'gpu' .* has the name of the fabric's device"):
        resolve(DeviceWish("gpu"), aliases, KINDS)
    # the other aliases, and the kinds no alias shadows, still work
    assert resolve(DeviceWish("nic"), aliases, KINDS).kind == "nic"
    assert resolve(DeviceWish("a100"), aliases, KINDS).vendor == 0x10DE


def test_an_unknown_name_lists_the_kinds_and_aliases_there_are():
    with pytest.raises(ConfigError) as e:
        resolve(DeviceWish("h100"), {"a100": A100}, KINDS)
    msg = str(e.value)
    assert "no device kind or alias 'h100'" in msg
    assert "its kinds: gpu, nic, nvme, vf; aliases: a100" in msg and "[alias]" in msg


def test_an_alias_given_ids_again_is_refused():
    with pytest.raises(ConfigError, match="alias 'a100' already names vendor=10de,product=20b0"):
        resolve(DeviceWish("a100", 1, None, 0x10DE, 0x20B1), {"a100": A100}, KINDS)
