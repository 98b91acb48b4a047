"""The fleet file: the replicas a router follows, as JSON::

    {"replicas": [
        {"name": "a", "url": "http://a:8000",
         "events": "tcp://a:5557", "replay": "tcp://a:5558",
         "hash_algo": "sha256", "hash_block_size": 16, "hash_seed": "0",
         "kinds": ["full_attention"]}
    ]}

Per replica: its name; optionally the URL the answer names; its KV event endpoints (vLLM's
``--kv-events-config`` ``endpoint`` and ``replay_endpoint``; without ``events`` the replica
is registered but nothing updates it); its engine's ``PrefixHashConfig``: ``hash_algo``,
``hash_block_size``, ``num_lookahead_tokens`` (default 0) and its NONE_HASH, as
``none_hash`` (hex) or as the ``hash_seed`` vLLM derives it from (the engine's
``PYTHONHASHSEED``); with neither, a SHA-256 engine's (vLLM's fixed seed when
``PYTHONHASHSEED`` is unset; an xxhash engine without it draws its NONE_HASH at random, so
that one must be given); and its KV-cache groups, as :class:`kvblocks.router.ReplicaLayout`
takes them (``kinds``, default one full-attention group; ``block_size``, default the hash
block size; ``sliding_window`` and ``attention_chunk_size`` where a group needs them;
``lookup_sets``; ``use_eagle`` and ``eagle_groups``); optionally ``models``, the model names
(LoRA adapters included) the replica serves, as requests name them in ``model``: the endpoint
picker (:mod:`kvblocks.router.picker`) sends a request only to a replica that serves its model
(without ``models``, a replica serves any).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from kvblocks._core import BlockHasher
from kvblocks.router.index import ReplicaLayout

if TYPE_CHECKING:
    from kvblocks._signals import ReloadSignal, StopSignals

__all__ = ["Fleet", "FleetFile", "ReplicaSpec", "follow_fleet_file", "load_fleet"]


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica of the fleet file (see the module's documentation)."""

    name: str
    prefix_hash_config: SimpleNamespace
    layout: ReplicaLayout
    url: str | None = None
    events: str | None = None
    replay: str | None = None
    #: The model names it serves (None: any).
    models: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Fleet:
    replicas: tuple[ReplicaSpec, ...]


_REPLICA_FIELDS = frozenset(
    {
        "name",
        "url",
        "events",
        "replay",
        "hash_algo",
        "hash_block_size",
        "num_lookahead_tokens",
        "none_hash",
        "hash_seed",
        "kinds",
        "block_size",
        "sliding_window",
        "attention_chunk_size",
        "lookup_sets",
        "use_eagle",
        "eagle_groups",
        "models",
    }
)


def _str_field(entry: Mapping[str, Any], key: str, where: str) -> str | None:
    value = entry.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where}: {key} must be a string, got {value!r}")
    return value


def _replica_spec(entry: Any, where: str) -> ReplicaSpec:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: a replica must be an object, got {entry!r}")
    unknown = set(entry) - _REPLICA_FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
    name = _str_field(entry, "name", where)
    if not name:
        raise ValueError(f"{where}: a replica needs a name")
    algo = _str_field(entry, "hash_algo", where) or "sha256"
    block = entry.get("hash_block_size", 16)
    lookahead = entry.get("num_lookahead_tokens", 0)
    for key, value in (("hash_block_size", block), ("num_lookahead_tokens", lookahead)):
        if type(value) is not int or value < 0 or (key == "hash_block_size" and value < 1):
            raise ValueError(f"{where}: {key} must be a non-negative int, got {value!r}")
    if "none_hash" in entry and "hash_seed" in entry:
        raise ValueError(f"{where}: give the engine's none_hash or its hash_seed, not both")
    if "none_hash" in entry:
        text = _str_field(entry, "none_hash", where) or ""
        try:
            none_hash = bytes.fromhex(text)
        except ValueError:
            raise ValueError(f"{where}: none_hash must be hex, got {text!r}") from None
    else:
        seed = BlockHasher.engine_seed(algo, _str_field(entry, "hash_seed", where))
        if seed is None:
            raise ValueError(
                f"{where}: a {algo} engine draws its NONE_HASH at random unless PYTHONHASHSEED "
                "is set: give its hash_seed (or none_hash)"
            )
        none_hash = BlockHasher(algo, seed=seed).none_hash
    config = SimpleNamespace(
        hash_algo=algo,
        hash_block_size=block,
        none_hash=none_hash,
        num_lookahead_tokens=lookahead,
    )
    kinds = entry.get("kinds", ["full_attention"])
    if not isinstance(kinds, list):
        raise ValueError(f"{where}: kinds must be a list of group kinds, got {kinds!r}")
    sets = entry.get("lookup_sets")
    if sets is not None and not (isinstance(sets, list) and all(isinstance(s, list) for s in sets)):
        raise ValueError(f"{where}: lookup_sets must be a list of lists of group ids")
    if not isinstance(entry.get("use_eagle", False), bool):
        raise ValueError(f"{where}: use_eagle must be true or false")
    drafts = entry.get("eagle_groups")
    if drafts is not None and not isinstance(drafts, list):
        raise ValueError(f"{where}: eagle_groups must be a list of group ids")
    try:
        layout = ReplicaLayout(
            tuple(kinds),
            entry.get("block_size"),
            sliding_window=entry.get("sliding_window"),
            attention_chunk_size=entry.get("attention_chunk_size"),
            lookup_sets=None if sets is None else tuple(tuple(s) for s in sets),
            use_eagle=entry.get("use_eagle", False),
            eagle_groups=None if drafts is None else tuple(drafts),
        )
        layout.hit_rule(block)  # bad lookup sets fail here, naming the replica
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    models = entry.get("models")
    if models is not None and not (
        isinstance(models, list) and all(isinstance(m, str) and m for m in models)
    ):
        raise ValueError(f"{where}: models must be a list of model names, got {models!r}")
    return ReplicaSpec(
        name=name,
        prefix_hash_config=config,
        layout=layout,
        url=_str_field(entry, "url", where),
        events=_str_field(entry, "events", where),
        replay=_str_field(entry, "replay", where),
        models=None if models is None else tuple(models),
    )


def load_fleet(source: str | Path | Mapping[str, Any]) -> Fleet:
    """The fleet of a JSON file (a path) or of its parsed content; ValueError naming the
    first bad field."""
    if isinstance(source, (str, Path)):
        try:
            data = json.loads(Path(source).read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{source}: not JSON: {error}") from None
    else:
        data = source
    replicas = data.get("replicas") if isinstance(data, Mapping) else None
    if not isinstance(replicas, list) or not replicas:
        raise ValueError('a fleet is {"replicas": [...]} with at least one replica')
    specs = tuple(_replica_spec(r, f"replicas[{i}]") for i, r in enumerate(replicas))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"replica names must be unique, got {names}")
    return Fleet(specs)


class FleetFile:
    """A fleet file followed for changes, for a command that serves until stopped:
    :meth:`changed` reads the file again where its modification time, size or inode moved
    (an editor's save, a rename over it, a Kubernetes ConfigMap's update) or where asked
    (SIGHUP), and returns the new fleet, or None where nothing changed. A file that no
    longer loads raises once per change (OSError, ValueError); the caller keeps its fleet."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._stamp = self._stat()

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def load(self) -> Fleet:
        """The fleet as the file says now (and the file's state, for :meth:`changed`)."""
        self._stamp = self._stat()
        return load_fleet(self.path)

    def changed(self, force: bool = False) -> Fleet | None:
        stamp = self._stat()
        if stamp == self._stamp and not force:
            return None
        self._stamp = stamp
        return load_fleet(self.path)


def follow_fleet_file(
    fleet_file: FleetFile,
    stop: StopSignals,
    hup: ReloadSignal,
    reload: Callable[[Fleet], None],
    command: str,
    interval: float = 1.0,
) -> None:
    """Until a stop signal: reads the fleet file again when it changes or SIGHUP asks, and
    hands the new fleet to ``reload``; a file that does not load, or a fleet ``reload``
    refuses, is reported on stderr and the fleet stays as it was."""
    while stop.wait(interval) is None:
        try:
            fleet = fleet_file.changed(force=hup.take())
            if fleet is None:
                continue
            reload(fleet)
        except (OSError, ValueError) as error:
            print(f"{command}: {fleet_file.path} not reloaded: {error}", file=sys.stderr)
            continue
        names = ", ".join(spec.name for spec in fleet.replicas)
        print(f"{command}: fleet reloaded: {names}", file=sys.stderr, flush=True)
