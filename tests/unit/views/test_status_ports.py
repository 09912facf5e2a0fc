"""``vmlend status``'s switch port table: the fullest few, so a large fabric's stays short."""

from __future__ import annotations

from vmlend.views.status import render_ports


def _port(name: str, used: int, capacity: int = 256) -> dict[str, object]:
    return {"switch": name.split("/")[0], "port": name, "used": used, "capacity": capacity}


def test_the_fullest_ports_first_and_how_many_more():
    ports = [_port(f"sw{i}/n{i}:0", 1) for i in range(2000)]
    ports.append(_port("sw7/n9:0", 200))
    ports.append(_port("small/n1:0", 60, capacity=64))  # 4 free: fuller than 200 of 256
    text = render_ports(ports, limit=3)
    lines = text.splitlines()
    assert lines[0].split() == ["SWITCH", "PORT", "REQUESTERS", "USED"]
    assert [ln.split() for ln in lines[1:4]] == [
        ["small/n1:0", "60/64"],
        ["sw7/n9:0", "200/256"],
        ["sw0/n0:0", "1/256"],
    ]
    assert lines[4] == "(1999 more switch port(s) in use, less full; --json lists every one)"
    assert len(lines) == 5


def test_few_ports_all_shown_and_none_shows_nothing():
    text = render_ports([_port("sw/a:0", 3), _port("sw/b:0", 3)])
    assert "more switch port" not in text
    assert [ln.split()[0] for ln in text.splitlines()[1:]] == ["sw/a:0", "sw/b:0"]
    assert render_ports([]) == ""
