"""The domain XML asks for an NVMe share (queue pairs and namespace size) in vmlend's metadata;
it round-trips, and bad values are refused with a message naming the device."""

from __future__ import annotations

import uuid

import pytest
from lxml import etree

from vmlend.domain import (
    DeviceRequest,
    DomainSpec,
    NvmeShareRequest,
    TemplateSet,
    new_domain,
    read_domain,
)
from vmlend.errors import DomainXMLError
from vmlend.topology.model import GiB, MiB

NS = {"v": "http://vmlend.org/xmlns/domain/1.0"}


def xml_with(share: NvmeShareRequest | None) -> bytes:
    spec = DomainSpec(
        name="db",
        memory_bytes=512 * MiB,
        uuid=uuid.UUID(int=7),
        devices=[DeviceRequest(0x12, share=share), DeviceRequest(0x10)],
    )
    return new_domain(spec, templates=TemplateSet()).to_bytes()


def test_a_share_request_round_trips():
    xml = xml_with(NvmeShareRequest(2, 64 * GiB))
    entry = etree.fromstring(xml).xpath("//v:device[@fdid='0x12']", namespaces=NS)[0]
    assert entry.get("nvme-queues") == "2" and entry.get("nvme-size") == "64G"
    info = read_domain(xml)
    nvme, gpu = info.devices
    assert nvme.share == NvmeShareRequest(2, 64 * GiB) and gpu.share is None
    assert nvme.to_json()["nvme_share"] == {"queue_pairs": 2, "size": 64 * GiB, "paths": 1}
    assert "nvme_share" not in gpu.to_json()  # whole devices look as before


def test_a_share_with_a_backup_path_round_trips():
    xml = xml_with(NvmeShareRequest(1, GiB, paths=2))
    entry = etree.fromstring(xml).xpath("//v:device[@fdid='0x12']", namespaces=NS)[0]
    assert entry.get("nvme-paths") == "2"
    nvme, _ = read_domain(xml).devices
    assert nvme.share == NvmeShareRequest(1, GiB, 2)
    assert nvme.to_json()["nvme_share"]["paths"] == 2
    # one path is the default and is not written: older readers see the same XML
    assert etree.fromstring(xml_with(NvmeShareRequest(1, GiB))).xpath(
        "//v:device[@nvme-paths]", namespaces=NS
    ) == []


def test_without_a_share_the_xml_is_unchanged():
    assert b"nvme-" not in xml_with(None)


@pytest.mark.parametrize(
    ("attrs", "words"),
    [
        ({"nvme-queues": "2"}, "needs both"),
        ({"nvme-size": "1G"}, "needs both"),
        ({"nvme-queues": "two", "nvme-size": "1G"}, "bad nvme-queues"),
        ({"nvme-queues": "0", "nvme-size": "1G"}, "1..65534 queue pairs"),
        ({"nvme-queues": "1", "nvme-size": "lots"}, "bad nvme-size"),
        ({"nvme-queues": "1", "nvme-size": "100"}, "512-byte blocks"),
        ({"nvme-queues": "1", "nvme-size": "1G", "nvme-paths": "3"}, "1 or 2 paths"),
        ({"nvme-queues": "1", "nvme-size": "1G", "nvme-paths": "two"}, "bad nvme-paths"),
        ({"nvme-paths": "2"}, "nvme-paths is for an NVMe share"),
    ],
)
def test_bad_share_attributes_are_refused(attrs, words):
    root = etree.fromstring(xml_with(None))
    entry = root.xpath("//v:device[@fdid='0x12']", namespaces=NS)[0]
    for k, v in attrs.items():
        entry.set(k, v)
    with pytest.raises(DomainXMLError, match=words):
        read_domain(etree.tostring(root))
