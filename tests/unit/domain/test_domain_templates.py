"""The template files: shipped with the package, loadable, and failing clearly when broken."""

from __future__ import annotations

import pytest

from tests.support.paths import REPO
from vmlend.domain.templates import TemplateSet, default_template_dir
from vmlend.errors import ConfigError, HostError

NAMES = ["disk-file", "domain-pc", "domain-q35", "hostdev-mdev"]


def test_installed_templates_are_the_repository_ones():
    shipped = default_template_dir()
    assert sorted(p.stem for p in shipped.glob("*.xml")) == NAMES
    repo = REPO / "xml-templates"
    for name in NAMES:
        assert (repo / f"{name}.xml").read_bytes() == (shipped / f"{name}.xml").read_bytes()


def test_each_load_is_a_private_copy():
    t = TemplateSet()
    a = t.hostdev()
    a.set("model", "changed")
    assert t.hostdev().get("model") == "vfio-pci"


def test_domain_templates_by_machine():
    t = TemplateSet()
    assert t.domain("q35").find("os/type").get("machine") == "q35"
    assert t.domain("pc").find("os/type").get("machine") == "pc"
    with pytest.raises(ConfigError, match="unknown machine type 'isapc'"):
        t.domain("isapc")


def test_missing_template_dir_says_the_install_is_incomplete(tmp_path):
    with pytest.raises(HostError, match="installation may be incomplete"):
        TemplateSet(tmp_path / "nowhere").hostdev()


def test_broken_template_is_named(tmp_path):
    (tmp_path / "hostdev-mdev.xml").write_text("<hostdev>")
    with pytest.raises(HostError, match=r"hostdev-mdev\.xml is broken"):
        TemplateSet(tmp_path).hostdev()
