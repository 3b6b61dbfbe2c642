"""Fakes and counters shared by the offload tests."""

from __future__ import annotations

from reconciler.host.values import PAGE_SIZE
from tests.support.fakesys import MIB

GIB = 1024 * MIB
INACTIVE = 1000 * MIB


def pages(n: int) -> int:
    return n // PAGE_SIZE * PAGE_SIZE


STAT = ("anon {anon}\nfile {file}\ninactive_anon {ia}\ninactive_file {ifile}\n"
        "pgscan {scan}\npgsteal {steal}\nworkingset_refault_anon {ra}\n"
        "workingset_refault_file {rf}\n")
PRESSURE = "some avg10=0.00 avg60=0.00 avg300=0.00 total={some}\n" \
           "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"


def stat_text(**kw: int) -> str:
    values = dict(anon=0, file=INACTIVE, ia=0, ifile=INACTIVE, scan=0, steal=0, ra=0, rf=0)
    values.update(kw)
    return STAT.format(**values)
