"""The registry composed of parts (#21): one resolver for prefixes and frames, file-system
primitives private to the package, a frame whose tools are parsed once."""

from __future__ import annotations

import pytest

from prefixreg.core import frame as frame_mod
from prefixreg.core.errors import AmbiguousRefError, RefNotFoundError
from prefixreg.core.frame import Frame
from prefixreg.registry.store import NameConflictError, Registry

TOOLS = '[{"type":"function","function":{"name":"grep","parameters":{}}}]'


def test_one_resolver_for_prefixes_and_frames(registry: Registry) -> None:
    system = registry.add("system\n", name="sys")
    frame = registry.add_frame(system, tools=TOOLS, name="loop")
    assert registry.resolve("loop") == frame and registry.resolve(frame[:9]) == frame
    head = registry.head(frame[:9])
    assert isinstance(head, Frame) and head.sha256 == frame and head.system.sha256 == system
    assert registry.head("loop").name == "loop" and registry.head("sys").kind == "prefix"
    with pytest.raises(RefNotFoundError, match="names frame"):
        registry.get("loop")  # get is prefixes only, through the same resolution
    with pytest.raises(RefNotFoundError):
        registry.frame("sys")
    # An abbreviation both an object and a frame share is ambiguous, whoever asks.
    twin = frame[:8] + ("0" if frame[8] != "0" else "1") + frame[9:]
    registry.object_path(twin).parent.mkdir(exist_ok=True)
    registry.object_path(twin).write_bytes(b"twin")
    for call in (registry.head, registry.get, registry.resolve):
        with pytest.raises(AmbiguousRefError):
            call(frame[:8])


def test_a_name_changes_kind_only_when_forced(registry: Registry) -> None:
    system = registry.add("system\n", name="head")
    frame = registry.add_frame(system, settings={"tool_choice": "none"})
    with pytest.raises(NameConflictError, match="changes what the loop sends"):
        registry.move_name("head", frame)
    with pytest.raises(NameConflictError, match="changes what the loop sends"):
        registry.add_frame(system, settings={"tool_choice": "none"}, name="head")
    assert registry.move_name("head", frame, force=True) is not None
    with pytest.raises(NameConflictError):
        registry.move_name("head", system)
    assert registry.move_name("head", system, force=True) is not None
    assert [m.to_sha for m in registry.name_log()] == [system, frame, system]


def test_file_system_primitives_are_not_on_the_registry(registry: Registry) -> None:
    for name in ("read_file", "entries", "walk", "lstat", "writable_dir", "path", "point_name"):
        assert not hasattr(registry, name), name


def test_a_frame_parses_its_tools_once(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    system = registry.add("system\n")
    frame = registry.add_frame(system, tools=TOOLS, settings={"tool_choice": "auto"})
    calls = []
    real = frame_mod.parse_tools

    def counted(data: bytes, *, where: str = "tools") -> object:
        calls.append(where)
        return real(data, where=where)

    monkeypatch.setattr(frame_mod, "parse_tools", counted)
    head = registry.head(frame)
    assert isinstance(head, Frame)
    for _ in range(3):
        body = head.body([{"role": "user", "content": "hi"}], model="m")
        body["tools"][0]["type"] = "changed by the caller"  # a copy: the frame keeps its own
        assert head.drift(head.body([{"role": "user", "content": "x"}])) == []
    assert head.tools is not None and head.tools[0]["type"] == "function"
    assert len(calls) == 1
