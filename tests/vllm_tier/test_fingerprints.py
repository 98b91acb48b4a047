"""kvblocks knows exactly which vLLM it reproduces: the stored fingerprints are those of the
installed vllm 0.33.0, and a part whose vLLM sources differ (or a vLLM without fingerprints)
falls back to vLLM's own code, saying which files, without ever raising."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager

import kvblocks.vllm
from kvblocks.vllm import _state, fingerprints
from kvblocks.vllm.block_hasher import get_request_block_hasher
from kvblocks.vllm.fingerprints import __main__ as fingerprints_cli
from kvblocks.vllm.fingerprints import extract
from kvblocks.vllm.fingerprints.ported import PORTED, sources
from kvblocks.vllm.kv_cache_manager import KVCacheManager
from tests.vllm_driver import SchedulerSpec, block_hasher, make_scheduler

VERSION = "0.33.0"
STORED = fingerprints.stored_path(VERSION)
NEXT_STORED = fingerprints.stored_path("0.34.0")
KV_CACHE_UTILS = "vllm/v1/core/kv_cache_utils.py"
_REQUEST = "vllm/v1/request.py"
#: An allocation-rule change a patch release could make: usage counts the null block.
POOL_EDIT = ("vllm/v1/core/block_pool.py", "self.num_gpu_blocks - 1\n", "self.num_gpu_blocks\n")
SCHEDULER = "vllm/v1/core/sched/scheduler.py"
OURS, STOCK = "kvblocks.vllm.block_hasher", "vllm.v1.core.kv_cache_utils"


@pytest.fixture(autouse=True)
def _fresh_check() -> Iterator[None]:
    """Each test checks afresh, and logs each fallback reason again."""
    fingerprints.forget()
    _state.fallbacks.clear()
    _state._logged.clear()
    yield
    fingerprints.forget()


@pytest.fixture
def vllm_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the fingerprinted vllm files, which the check then reads instead."""
    real = fingerprints.vllm_root()
    for path in {s.path for part in PORTED for s in sources(part, VERSION)}:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(real / path, tmp_path / path)
    monkeypatch.setattr(fingerprints, "vllm_root", lambda: tmp_path)
    return tmp_path


def edit(root: Path, path: str, old: str, new: str) -> None:
    text = (root / path).read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{old!r} in {path}"
    (root / path).write_text(text.replace(old, new), encoding="utf-8")


# -- the stored file is true ---------------------------------------------------------------


def test_stored_fingerprints_are_the_installed_vllms() -> None:
    assert kvblocks.vllm.status().vllm_version == VERSION
    stored = fingerprints.load(STORED)
    assert fingerprints.compute(fingerprints.vllm_root(), VERSION) == stored
    assert fingerprints.check(VERSION) == {}


def _module_object(path: str, name: str) -> Any:
    obj: Any = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    for part in name.split("."):
        obj = inspect.getattr_static(obj, part, None)  # None: annotated, not yet assigned
    return obj.fget if isinstance(obj, property) else obj


def test_stored_fingerprints_match_an_independent_reading() -> None:
    """Whole files against hashlib over the file; named functions, methods and classes
    against hashlib over ``inspect.getsource``."""
    root = fingerprints.vllm_root()
    checked = 0
    for part, stored in fingerprints.load(STORED)["parts"].items():
        for path, entry in stored.items():
            assert entry["sha256"] == hashlib.sha256((root / path).read_bytes()).hexdigest()
            if "mentions" in entry:
                continue
            for name, digest in entry.get("objects", {}).items():
                obj = _module_object(path, name)
                if inspect.isfunction(obj) or inspect.isclass(obj):
                    source = inspect.getsource(obj).encode()
                    assert hashlib.sha256(source).hexdigest() == digest, f"{part}: {path}::{name}"
                    checked += 1
    assert checked > 40


def test_fingerprint_files_are_package_data() -> None:
    """Next to the module that reads them, under the name it looks for."""
    assert STORED.parent == Path(fingerprints.__file__).parent
    assert fingerprints.stored_versions() == [VERSION, "0.34.0"]
    assert fingerprints.stored_path("0.33.0+cu129") == STORED


def test_every_part_source_appears_once() -> None:
    """Among the sources of every release, a file is listed once per part; a file a release
    adds objects of is listed again only for that release."""
    for entries in PORTED.values():
        paths = [s.path for s in entries if not s.releases]
        assert len(paths) == len(set(paths))
        for release in {r for s in entries for r in s.releases}:
            paths = [s.path for s in entries if release in s.releases]
            assert len(paths) == len(set(paths))


def test_the_sources_of_a_release() -> None:
    """What vLLM 0.34 added is fingerprinted there only, merged with the file's other
    objects (one entry per file)."""
    old = {s.path: s for s in sources("hasher", "0.33.0")}
    new = {s.path: s for s in sources("hasher", "0.34.1+cu130")}
    added = {"vllm/v1/token_buffer.py", "vllm/v1/engine/__init__.py"}
    assert set(new) - set(old) == added
    assert not added & set(old)
    assert new["vllm/v1/token_buffer.py"].whole_file
    added_objects = set(new[KV_CACHE_UTILS].objects) - set(old[KV_CACHE_UTILS].objects)
    assert added_objects == {"frontend_block_hashes"}
    assert "frontend_block_hashes" not in old[KV_CACHE_UTILS].objects
    core = "vllm/v1/engine/core.py"
    assert new[core].mentions == (
        *old[core].mentions,
        "frontend_block_hashes",
        "prefix_hash_config",
    )
    assert all(not s.releases for s in new.values())
    assert {r for entries in PORTED.values() for s in entries for r in s.releases} == {
        "0.33",
        "0.34",
    }
    # The manager's rule that moved: 0.33's hit-limit flag, 0.34's methods of the request.
    old_request = next(s for s in sources("kv_cache_manager", "0.33.0") if s.path == _REQUEST)
    new_request = next(s for s in sources("kv_cache_manager", "0.34.0") if s.path == _REQUEST)
    assert "Request.get_skip_reading_prefix_cache" in old_request.objects
    assert "Request.get_skip_reading_prefix_cache" not in new_request.objects
    assert "Request.get_max_cache_hit_length" in new_request.objects


# -- the check is cheap ------------------------------------------------------------------


def test_unchanged_files_are_hashed_not_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_parsing(data: bytes) -> None:
        raise AssertionError("parsed an unchanged file")

    monkeypatch.setattr(fingerprints, "Module", no_parsing)
    assert fingerprints.check(VERSION) == {}


def test_the_result_is_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = fingerprints._check
    monkeypatch.setattr(fingerprints, "_check", lambda *a: calls.append(a) or real(*a))
    for _ in range(3):
        assert fingerprints.check(VERSION) == {}
    assert len(calls) == 1


# -- a changed source turns its part off ---------------------------------------------------


def install_logging(caplog: pytest.LogCaptureFixture) -> list[str]:
    with caplog.at_level(logging.INFO, logger="vllm.kvblocks"):
        kvblocks.vllm.install("all")
    return [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()]


def manager_type(model_dir: Path) -> type:
    return type(make_scheduler(model_dir, SchedulerSpec()).kv_cache_manager)


def test_changed_manager_file_turns_the_manager_off(
    vllm_copy: Path, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    edit(vllm_copy, *POOL_EDIT)
    lines = install_logging(caplog)
    assert len(lines) == 1
    assert "kv_cache_manager" in lines[0]
    assert "vllm/v1/core/block_pool.py" in lines[0]
    assert manager_type(model_dir) is VllmKVCacheManager
    # ... while the hasher stays kvblocks'.
    assert kv_cache_utils.get_request_block_hasher.__module__ == OURS
    assert block_hasher("sha256", 16).__module__ == OURS
    status = kvblocks.vllm.status()
    assert status.active == {"hasher": "sha256"}
    [reason] = status.fallbacks
    assert reason.startswith("kv_cache_manager: ")
    assert reason.endswith("(vllm 0.33.0: vllm/v1/core/block_pool.py)")


def test_explicit_scheduler_class_falls_back_too(vllm_copy: Path, model_dir: Path) -> None:
    edit(vllm_copy, *POOL_EDIT)
    kvblocks.vllm.install("off")
    spec = SchedulerSpec(scheduler={"scheduler_cls": "kvblocks.vllm.Scheduler"})
    sched = make_scheduler(model_dir, spec, scheduler_cls=kvblocks.vllm.Scheduler)
    assert type(sched.kv_cache_manager) is VllmKVCacheManager
    assert dict(_state.fallbacks) == {("kv_cache_manager", "vllm_sources"): 1}


def test_changed_hasher_object_turns_the_hasher_off(
    vllm_copy: Path, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    edit(
        vllm_copy,
        KV_CACHE_UTILS,
        "curr_block_token_ids_tuple = tuple(",
        "curr_block_token_ids_tuple = list(",
    )
    lines = install_logging(caplog)
    assert len(lines) == 1
    assert "hasher" in lines[0]
    assert f"{KV_CACHE_UTILS}::hash_block_tokens" in lines[0]
    assert kv_cache_utils.get_request_block_hasher.__module__ == STOCK
    # kvblocks' own factory, called directly, hands out vLLM's hasher too.
    assert get_request_block_hasher(16, sha256).__module__ == STOCK
    # ... while the manager stays kvblocks'.
    assert manager_type(model_dir) is KVCacheManager
    assert set(kvblocks.vllm.status().active) == {"kv_cache_manager"}


def test_a_source_both_parts_read_turns_both_off(
    vllm_copy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    edit(
        vllm_copy,
        "vllm/v1/request.py",
        "self.block_hashes: list[BlockHash] = []",
        "self.block_hashes = []",
    )
    lines = install_logging(caplog)
    assert len(lines) == 2
    assert all("vllm/v1/request.py::Request.__init__" in line for line in lines)
    assert kvblocks.vllm.status().active == {}


def test_unrelated_edits_change_nothing(vllm_copy: Path, model_dir: Path) -> None:
    """An edit outside the fingerprinted objects, and one inside a scheduler method but not
    in a statement that calls the manager."""
    edit(vllm_copy, KV_CACHE_UTILS, '"%s KV cache size: %s tokens, "', '"%s KV cache: %s tokens, "')
    edit(vllm_copy, SCHEDULER, "self.sched_step_seq = 0\n", "self.sched_step_seq = 0  # edited\n")
    assert fingerprints.check(VERSION) == {}
    kvblocks.vllm.install("all")
    assert manager_type(model_dir) is KVCacheManager
    assert kv_cache_utils.get_request_block_hasher.__module__ == OURS


def test_changed_call_into_the_manager_is_seen(vllm_copy: Path) -> None:
    edit(
        vllm_copy,
        SCHEDULER,
        "self.kv_cache_manager.new_step_starts()",
        "self.kv_cache_manager.new_step_starts(0)",
    )
    stale = fingerprints.check(VERSION)
    assert set(stale) == {"kv_cache_manager"}
    assert stale["kv_cache_manager"] == (
        "vllm_sources",
        f"vllm 0.33.0: {SCHEDULER}::Scheduler.schedule",
    )


def test_new_call_into_the_manager_is_seen(vllm_copy: Path) -> None:
    edit(
        vllm_copy,
        SCHEDULER,
        "    def get_kv_connector(self)",
        "    def reset_everything(self):\n        self.kv_cache_manager.reset()\n\n"
        "    def get_kv_connector(self)",
    )
    _, detail = fingerprints.check(VERSION)["kv_cache_manager"]
    assert detail == f"vllm 0.33.0: {SCHEDULER}::Scheduler.reset_everything (new)"


def test_removed_object_is_seen(vllm_copy: Path) -> None:
    edit(vllm_copy, "vllm/multimodal/utils.py", "def get_mm_features_in_window(", "def mm_window(")
    _, detail = fingerprints.check(VERSION)["hasher"]
    assert detail == "vllm 0.33.0: vllm/multimodal/utils.py::get_mm_features_in_window (removed)"


def test_missing_file_is_seen(vllm_copy: Path) -> None:
    (vllm_copy / "vllm/v1/core/sched/async_scheduler.py").unlink()
    _, detail = fingerprints.check(VERSION)["kv_cache_manager"]
    assert detail == "vllm 0.33.0: vllm/v1/core/sched/async_scheduler.py (removed)"


# -- no fingerprints, or unusable ones ---------------------------------------------------------


def test_patch_release_with_the_same_sources_runs(
    monkeypatch: pytest.MonkeyPatch, model_dir: Path
) -> None:
    """0.33.9, whose sources are 0.33.0's: compared with 0.33.0's fingerprints, it runs."""
    monkeypatch.setattr(kvblocks.vllm.versions, "installed_vllm_version", lambda: "0.33.9")
    assert fingerprints.check() == {}
    kvblocks.vllm.install()
    assert kv_cache_utils.get_request_block_hasher.__module__ == OURS
    assert manager_type(model_dir) is KVCacheManager
    assert "kv_cache_manager" in kvblocks.vllm.status().active
    assert kvblocks.vllm.status().fallbacks == {}


def test_patch_release_with_changed_sources_says_against_what(
    vllm_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvblocks.vllm.versions, "installed_vllm_version", lambda: "0.33.9")
    edit(vllm_copy, *POOL_EDIT)
    assert fingerprints.check() == {
        "kv_cache_manager": (
            "vllm_sources",
            "vllm 0.33.9 (against 0.33.0's sources): vllm/v1/core/block_pool.py",
        )
    }


def test_unknown_version_turns_everything_off(
    monkeypatch: pytest.MonkeyPatch,
    model_dir: Path,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    """A supported release with no fingerprint file of its major.minor (here 0.33's file is
    taken away): both parts off, naming what kvblocks has."""
    shutil.copyfile(NEXT_STORED, tmp_path / NEXT_STORED.name)
    monkeypatch.setattr(fingerprints, "DIRECTORY", tmp_path)
    monkeypatch.setattr(kvblocks.vllm.versions, "installed_vllm_version", lambda: "0.33.9")
    lines = install_logging(caplog)
    assert len(lines) == 2
    known = "no fingerprints of vllm 0.33.9 (kvblocks has: 0.34.0)"
    assert all(known in line for line in lines)
    assert kv_cache_utils.get_request_block_hasher.__module__ == STOCK
    assert manager_type(model_dir) is VllmKVCacheManager
    status = kvblocks.vllm.status()
    assert status.mode == "all"
    assert status.active == {}
    assert {key.split(":")[0] for key in status.fallbacks} == {"hasher", "kv_cache_manager"}
    # An explicitly named kvblocks scheduler gets vLLM's manager as well.
    sched = make_scheduler(
        model_dir,
        SchedulerSpec(scheduler={"scheduler_cls": "kvblocks.vllm.Scheduler"}),
        scheduler_cls=kvblocks.vllm.Scheduler,
    )
    assert type(sched.kv_cache_manager) is VllmKVCacheManager


BAD_FILES = {
    "missing": None,
    "not json": "{",
    "not an object": "[]",
    "other format": json.dumps({"format": 99, "parts": {}}),
    "parts not objects": json.dumps({"format": 1, "parts": {"hasher": []}}),
    "entries not objects": json.dumps({"format": 1, "parts": {"hasher": {KV_CACHE_UTILS: 3}}}),
}


@pytest.mark.parametrize("content", list(BAD_FILES.values()), ids=list(BAD_FILES))
def test_register_never_raises_on_a_bad_fingerprint_file(
    content: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_dir: Path
) -> None:
    if content is not None:
        (tmp_path / f"vllm-{VERSION}.json").write_text(content)
    monkeypatch.setattr(fingerprints, "DIRECTORY", tmp_path)
    monkeypatch.delenv("KVBLOCKS_VLLM", raising=False)
    kvblocks.vllm.register()
    status = kvblocks.vllm.status()
    assert status.mode == "all"
    assert status.active == {}
    assert {part for part, _ in _state.fallbacks} == {"hasher", "kv_cache_manager"}
    assert {reason for _, reason in _state.fallbacks} <= {"vllm_unknown", "vllm_sources"}
    assert kv_cache_utils.get_request_block_hasher.__module__ == STOCK
    assert manager_type(model_dir) is VllmKVCacheManager


def test_unlocatable_vllm_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def lost() -> Path:
        raise ImportError("vllm is not installed")

    monkeypatch.setattr(fingerprints, "vllm_root", lost)
    stale = fingerprints.check(VERSION)
    assert set(stale) == set(PORTED)
    assert stale["hasher"] == ("vllm_unknown", "cannot locate vllm: vllm is not installed")


# -- regenerating ------------------------------------------------------------------------------


def test_cli_check_passes_on_the_installed_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    assert fingerprints_cli.main([]) == 0
    out = capsys.readouterr().out
    assert "hasher: unchanged" in out
    assert "kv_cache_manager: unchanged" in out


def test_cli_writes_a_new_release(
    vllm_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new release: differences printed against the newest stored one, then its file
    written, which the check then accepts."""
    store = tmp_path / "store"
    store.mkdir()
    shutil.copyfile(STORED, store / STORED.name)
    edit(vllm_copy, *POOL_EDIT)
    args = ["--vllm-root", str(vllm_copy), "--version", "0.33.1", "--dir", str(store)]
    assert fingerprints_cli.main(args) == 1
    out = capsys.readouterr().out
    assert "hasher: unchanged" in out
    assert "changed  vllm/v1/core/block_pool.py" in out
    assert not (store / "vllm-0.33.1.json").exists()
    assert fingerprints_cli.main([*args, "--write"]) == 0
    written = fingerprints.load(store / "vllm-0.33.1.json")
    assert written["vllm"] == "0.33.1"
    assert fingerprints.changes(written, vllm_copy) == {}
    assert fingerprints_cli.main(args) == 0


def test_extract_counts_decorators_and_rejects_deep_names() -> None:
    source = (
        b"import x\n\n@dec\n@other(1)\ndef f():\n    return 1\n\n"
        b"class C:\n    @property\n    def p(self):\n        return 2\n"
    )
    module = extract.Module(source)
    found = module.objects(["f", "C.p"])
    assert found["f"] == hashlib.sha256(b"@dec\n@other(1)\ndef f():\n    return 1\n").hexdigest()
    assert (
        found["C.p"]
        == hashlib.sha256(b"    @property\n    def p(self):\n        return 2\n").hexdigest()
    )
    assert module.objects(["g", "C.q", "D.p"]) == {}
    with pytest.raises(ValueError):
        module.objects(["A.B.c"])


# -- a release kvblocks is ported to part by part ------------------------------------------------

NEXT = os.environ.get("KVBLOCKS_NEXT_VLLM")
needs_next = pytest.mark.skipif(
    NEXT is None, reason="KVBLOCKS_NEXT_VLLM names no vLLM 0.34 tree (.ci/run installs one)"
)


def test_a_part_the_release_file_lacks_falls_back_naming_the_ported_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_dir: Path
) -> None:
    """A release whose fingerprint file holds the hasher only (as 0.34.0's did while its
    manager was being ported): the hasher runs, the manager is vLLM's, and status() says it
    is not ported there yet."""
    document = fingerprints.compute(fingerprints.vllm_root(), VERSION, ["hasher"])
    (tmp_path / STORED.name).write_text(json.dumps(document), encoding="utf-8")
    monkeypatch.setattr(fingerprints, "DIRECTORY", tmp_path)
    assert fingerprints.not_ported(document) == ["kv_cache_manager"]
    assert fingerprints.check(VERSION) == {
        "kv_cache_manager": (
            "not_ported",
            "vllm 0.33.0; ported there: hasher; see docs/porting.md",
        )
    }
    kvblocks.vllm.install()
    assert kv_cache_utils.get_request_block_hasher.__module__ == OURS
    assert manager_type(model_dir) is VllmKVCacheManager
    (text,) = kvblocks.vllm.status().fallbacks
    assert text.startswith("kv_cache_manager: kvblocks supports this vLLM release, but this part ")


def test_cli_writes_the_parts_ported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    store.mkdir()
    args = ["--version", "0.33.7", "--dir", str(store), "--write"]
    assert fingerprints_cli.main([*args, "--parts", "hasher"]) == 0
    written = fingerprints.load(store / "vllm-0.33.7.json")
    assert list(written["parts"]) == ["hasher"]
    capsys.readouterr()
    assert fingerprints_cli.main(["--version", "0.33.7", "--dir", str(store)]) == 0
    assert "kv_cache_manager: not ported to vllm 0.33.7" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        fingerprints_cli.main([*args, "--parts", "hasher,nope"])
    assert "no part nope" in capsys.readouterr().err


@needs_next
def test_the_stored_0_34_fingerprints_are_vllm_0_34s() -> None:
    """The 0.34.0 file holds both parts, computed from the real 0.34.0 tree: the whole files'
    digests against hashlib over the files."""
    assert NEXT is not None
    root = Path(NEXT)
    stored = fingerprints.load(NEXT_STORED)
    assert stored["vllm"] == "0.34.0"
    assert fingerprints.not_ported(stored) == []
    assert fingerprints.compute(root, "0.34.0") == stored
    assert fingerprints.changes(stored, root) == {}
    for part in PORTED:
        for path, entry in stored["parts"][part].items():
            assert entry["sha256"] == hashlib.sha256((root / path).read_bytes()).hexdigest()
        assert {s.path for s in sources(part, "0.34.0")} == set(stored["parts"][part])


#: Statements vLLM 0.34 added or moved that kvblocks relies on, each changed the way a patch
#: release could: (file, old text, new text, the parts that must step aside, the object named).
NEXT_EDITS = {
    "token_buffer": (
        "vllm/v1/token_buffer.py",
        'return super().__new__(cls, "i", tokens)',
        'return super().__new__(cls, "l", tokens)',
        ("hasher", "kv_cache_manager"),
        "vllm/v1/token_buffer.py",
    ),
    "frontend_block_hashes": (
        KV_CACHE_UTILS,
        "max(prompt_len - prefix_hash_config.num_lookahead_tokens, 0)",
        "max(prompt_len, 0)",
        ("hasher",),
        f"{KV_CACHE_UTILS}::frontend_block_hashes",
    ),
    "engine_core_frontend_hashes": (
        "vllm/v1/engine/core.py",
        "frontend_hashes = frontend_block_hashes(request, self.prefix_hash_config)",
        "frontend_hashes = frontend_block_hashes(request, None)",
        ("hasher",),
        "vllm/v1/engine/core.py::EngineCore.preprocess_add_request",
    ),
    # The hit limit both of the manager's lookups take.
    "hit_limit": (
        "vllm/v1/request.py",
        "if params is not None and params.skip_reading_prefix_cache:",
        "if params is not None and not params.skip_reading_prefix_cache:",
        ("kv_cache_manager",),
        "vllm/v1/request.py::Request.get_prefix_cache_hit_limit",
    ),
    # NIXL and Mooncake truncate a prefill's hashes with its tokens.
    "truncate_block_hashes": (
        "vllm/v1/request.py",
        "max(0, self.num_tokens - num_hash_lookahead_tokens) // hash_block_size",
        "max(0, self.num_tokens) // hash_block_size",
        ("kv_cache_manager",),
        "vllm/v1/request.py::Request.truncate_block_hashes",
    ),
    # When vLLM hashes with lookahead: with the connectors that declare it.
    "lookahead_resolution": (
        "vllm/config/vllm.py",
        "if not connector_cls.supports_lookahead_block_hashes(kv_transfer_config):",
        "if connector_cls.supports_lookahead_block_hashes(kv_transfer_config):",
        ("kv_cache_manager",),
        "vllm/config/vllm.py::VllmConfig._resolve_num_hash_lookahead_tokens",
    ),
    # The scheduler's condition around a call into the manager (it names no manager itself):
    # Mamba's states are cached at a request's stop in synchronous mode too.
    "if_around_cache_blocks": (
        SCHEDULER,
        "self.has_mamba_layers\n" + " " * 28 + "and not self.scheduler_config.async_scheduling",
        "self.has_mamba_layers\n" + " " * 28 + "and self.scheduler_config.async_scheduling",
        ("kv_cache_manager",),
        f"{SCHEDULER}::Scheduler.update_from_output",
    ),
}


@needs_next
@pytest.mark.parametrize("case", list(NEXT_EDITS))
def test_a_changed_0_34_statement_turns_its_parts_off(case: str, tmp_path: Path) -> None:
    assert NEXT is not None
    for part in PORTED:
        for source in sources(part, "0.34.0"):
            (tmp_path / source.path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(NEXT) / source.path, tmp_path / source.path)
    path, old, new, parts, named = NEXT_EDITS[case]
    edit(tmp_path, path, old, new)
    found = fingerprints.changes(fingerprints.load(NEXT_STORED), tmp_path)
    assert found == {part: [fingerprints.Change("changed", named)] for part in parts}


@needs_next
def test_cli_diff_lists_what_a_new_release_changed(capsys: pytest.CaptureFixture[str]) -> None:
    """Step 2 of docs/porting.md: the 0.34.0 tree against 0.33.0's fingerprints lists, by
    part, the sources 0.34 changed (exit status 1); --diff and --write exclude each other."""
    assert NEXT is not None
    argv = ["--diff", "--vllm-root", NEXT, "--version", "0.33.0"]
    assert fingerprints_cli.main(argv) == 1
    out = capsys.readouterr().out
    assert "hasher: 2 differ" in out
    assert "kv_cache_manager: " in out
    assert "  changed  vllm/v1/core/block_pool.py" in out
    assert "  removed  vllm/v1/request.py::Request.get_skip_reading_prefix_cache" in out
    with pytest.raises(SystemExit):
        fingerprints_cli.main(["--diff", "--write"])
