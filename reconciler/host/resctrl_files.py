"""The resctrl filesystem's file formats: ``schemata`` as the kernel shows it, and ``info/``.

Pure text in, values out (and back): the reads themselves go through :class:`~.sysfs.SysFs`.
"""

from __future__ import annotations

from collections.abc import Mapping

from hooks.resctrl import ResctrlInfo, Schemata
from hooks.untrusted import bounded_repr

MBPS_MAX = (1 << 32) - 1
"""What the root schemata shows for MB under the ``mba_MBps`` mount option (MBA_MAX_MBPS,
U32_MAX): values are then MB/s, which this agent does not manage."""


class ResctrlUnavailable(Exception):
    """resctrl is not mounted here, or offers nothing this agent can use."""


class UnreadableInfo(ResctrlUnavailable):
    """A file of ``info/`` (or the root schemata) is missing or does not parse."""


def parse_schemata(text: str) -> dict[str, dict[int, str]]:
    """``"L3:0=7ff;1=7ff\\n  MB:0=100;1=100"`` -> ``{"L3": {0: "7ff", 1: "7ff"}, ...}``.

    The kernel right-aligns resource names, hence the stripping; malformed entries are skipped.
    """
    result: dict[str, dict[int, str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        name, sep, rest = line.partition(":")
        if not sep or not name:
            continue
        entries = result.setdefault(name.strip(), {})
        for item in rest.split(";"):
            cid, eq, value = item.strip().partition("=")
            if eq and cid.strip().isdigit():
                entries[int(cid)] = value.strip()
    return result


def schemata_text(schemata: Schemata) -> str:
    """What to write into a group's ``schemata`` file."""
    return "".join(line + "\n" for line in schemata.lines())


def schemata_matches(schemata: Schemata, current: Mapping[str, Mapping[int, str]]) -> bool:
    """True when ``current`` (see :func:`parse_schemata`) already holds every value of
    ``schemata``."""
    try:
        return (all(int(current.get("L3", {})[cid], 16) == v for cid, v in schemata.l3.items())
                and all(int(current.get("MB", {})[cid]) == v for cid, v in schemata.mb.items()))
    except (KeyError, ValueError):
        return False


def _int(files: Mapping[str, str | None], name: str, base: int = 10) -> int:
    text = files.get(name)
    if text is None:
        raise UnreadableInfo(f"info/{name} is missing")
    try:
        return int(text.strip(), base)
    except ValueError as exc:
        raise UnreadableInfo(
            f"info/{name} does not parse: {bounded_repr(text.strip(), 40)}") from exc


def parse_info(root_schemata: str, info: Mapping[str, str | None], *,
               has_l3: bool, has_mb: bool, monitoring: bool, amd_mb_max: int) -> ResctrlInfo:
    """Describe the hardware from the root ``schemata`` and the ``info/`` files (keyed by their
    path below ``info/``, None for a missing file); raise :class:`ResctrlUnavailable` when
    nothing usable is offered."""
    current = parse_schemata(root_schemata)
    closids: list[int] = []
    cbm_mask, min_bits = 0, 1
    l3_ids: tuple[int, ...] = ()
    if has_l3 and "L3" in current:
        cbm_mask = _int(info, "L3/cbm_mask", 16)
        min_bits = _int(info, "L3/min_cbm_bits")
        closids.append(_int(info, "L3/num_closids"))
        l3_ids = tuple(sorted(current["L3"]))
    gran, mb_min, linear, absolute, mb_max = 10, 10, True, False, 100
    mb_ids: tuple[int, ...] = ()
    if has_mb and "MB" in current:
        try:
            values = [int(v) for v in current["MB"].values()]
        except ValueError as exc:
            raise UnreadableInfo(f"root schemata MB line does not parse: {exc}") from exc
        if not any(v == MBPS_MAX for v in values):
            gran = _int(info, "MB/bandwidth_gran")
            mb_min = _int(info, "MB/min_bandwidth")
            linear = info.get("MB/delay_linear") is None or _int(info, "MB/delay_linear") == 1
            closids.append(_int(info, "MB/num_closids"))
            mb_ids = tuple(sorted(current["MB"]))
            # Intel shows percent (the root group at 100); AMD absolute units above 100.
            absolute = any(v > 100 for v in values)
            mb_max = amd_mb_max if absolute else 100
    if not closids:
        raise ResctrlUnavailable("resctrl offers neither L3 nor MB allocation")
    return ResctrlInfo(
        num_closids=min(closids), cbm_mask=cbm_mask, min_cbm_bits=min_bits, l3_ids=l3_ids,
        mb_ids=mb_ids, mb_gran=gran, mb_min=mb_min, mb_delay_linear=linear,
        mb_absolute=absolute, mb_max=mb_max, monitoring=monitoring,
    )


INFO_FILES = ("L3/cbm_mask", "L3/min_cbm_bits", "L3/num_closids", "MB/bandwidth_gran",
              "MB/min_bandwidth", "MB/num_closids", "MB/delay_linear")
"""The ``info/`` files :func:`parse_info` reads."""
