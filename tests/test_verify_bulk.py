"""`verify` and `ls` read each fan-out and `meta/` through one descriptor (#33, item 16):
every check still fires through that path, on real files (the speed is
`benchmarks/storage.py`'s, never a timed test)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from prefixreg.core.errors import CorruptRecordError, IntegrityError
from prefixreg.core.jsonio import JSONObject
from prefixreg.core.records import Meta
from prefixreg.registry.store import Registry
from prefixreg.registry.verify import verify_registry


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    registry = Registry(tmp_path / "reg")
    for i in range(40):
        registry.add(f"prefix {i}\n" * 20, name=f"p{i}")
    return registry


def _kinds(reg: Registry) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in verify_registry(reg).findings:
        out.setdefault(f.kind, set()).add(f.path)
    return out


def _meta_path(reg: Registry, sha: str) -> Path:
    return reg.root / "meta" / f"{sha}.json"


def test_every_object_and_record_check_fires_through_the_bulk_read(reg: Registry) -> None:
    shas = sorted(reg.iter_shas())
    assert verify_registry(reg).findings == [] and verify_registry(reg).objects == 40
    flipped, writable, lost_meta, sized, orphan, odd = shas[:6]
    obj = reg.object_path(flipped)
    obj.chmod(0o644)
    obj.write_bytes(obj.read_bytes()[:-1] + b"?")
    obj.chmod(0o444)
    reg.object_path(writable).chmod(0o666)
    _meta_path(reg, lost_meta).unlink()
    record = orjson.loads(_meta_path(reg, sized).read_bytes())
    _meta_path(reg, sized).chmod(0o644)
    _meta_path(reg, sized).write_bytes(orjson.dumps(record | {"bytes": 1}))
    reg.object_path(orphan).unlink()
    _meta_path(reg, odd).chmod(0o644)
    _meta_path(reg, odd).write_bytes(orjson.dumps(record | {"sha256": odd, "bytes": "12"}))
    fan = reg.object_path(shas[6]).parent
    (fan / f"{'0' * 64}.txt").symlink_to(reg.object_path(shas[6]))

    kinds = _kinds(reg)

    def rel(sha: str) -> str:
        return f"objects/{sha[:2]}/{sha}.txt"

    assert rel(flipped) in kinds["corrupt"]
    assert kinds["bad_mode"] == {rel(writable)} and rel(writable) in kinds["insecure_mode"]
    assert kinds["incomplete"] == {rel(lost_meta)}
    assert f"meta/{sized}.json" in kinds["bad_record"]  # records 1 byte, the object differs
    assert f"meta/{odd}.json" in kinds["bad_record"]  # not a count: the strict reader says so
    assert kinds["orphan_meta"] == {f"meta/{orphan}.json"}
    assert any(p.endswith(f"{'0' * 64}.txt") for p in kinds["symlink"])
    assert not verify_registry(reg).ok


def test_a_record_in_another_valid_shape_is_read_by_the_strict_reader(reg: Registry) -> None:
    sha = next(iter(reg.iter_shas()))
    record = orjson.loads(_meta_path(reg, sha).read_bytes())
    _meta_path(reg, sha).chmod(0o644)
    _meta_path(reg, sha).write_bytes(orjson.dumps(record | {"extra": [1, {"a": None}]}))
    assert verify_registry(reg).ok  # a field it does not know is not an error, as before
    assert reg.meta(sha) == Meta.from_dict(record)
    rows = {o.sha256: o for o in reg.list_objects()}
    assert rows[sha].bytes == record["bytes"] and rows[sha].names


def test_ls_refuses_a_symlinked_meta_record_and_a_corrupt_one(reg: Registry) -> None:
    a, b = sorted(reg.iter_shas())[:2]
    _meta_path(reg, a).unlink()
    _meta_path(reg, a).symlink_to(_meta_path(reg, b))
    with pytest.raises(IntegrityError, match="symlink"):
        reg.list_objects()
    _meta_path(reg, a).unlink()
    _meta_path(reg, a).write_bytes(b'{"sha256": 1}')
    with pytest.raises(CorruptRecordError, match=f"meta/{a}.json"):
        reg.list_objects()


def test_plain_meta_reads_equal_the_strict_readers() -> None:
    sha = "a" * 64
    base: JSONObject = {"sha256": sha, "bytes": 5, "created": "2026", "source": "x", "note": None}
    for data in (base, {k: v for k, v in base.items() if k != "note"}, base | {"note": "n"}):
        assert Meta.from_flat(data, sha) == Meta.from_dict(data)
    for bad in (base | {"bytes": True}, base | {"bytes": -1}, base | {"note": 3}, base | {"x": 1}):
        assert Meta.from_flat(bad, sha) is None  # the strict reader then judges it
    assert Meta.from_flat(base, "b" * 64) is None
