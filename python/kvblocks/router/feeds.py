"""One replica's KV event stream (vLLM's ``ZmqEventPublisher``) applied to a
:class:`~kvblocks.router.index.RoutingIndex` in sequence order, with gaps repaired through the
replica's replay endpoint. Needs ``pyzmq`` and ``msgspec`` (``pip install "kvblocks[router]"``).
"""

from __future__ import annotations

from typing import Any

from kvblocks.router.index import RoutingIndex

__all__ = ["END_SEQ", "ReplicaFeed"]

#: vLLM's replay protocol: the sequence number that ends a replay.
END_SEQ = (1 << 64) - 1


def _event_decoders() -> tuple[Any, Any]:
    """msgspec decoders for a ``KVEventBatch``'s wire form (``[ts, [event, ...], dp_rank]``)
    and for one event (a map tagged ``type``: vLLM's class name). Only the fields the index
    reads are declared; msgspec skips the rest, so fields a later vLLM adds decode too."""
    import msgspec

    hashes_and_where: list[tuple[str, Any, Any]] = [
        ("block_hashes", list[bytes | int], []),
        ("medium", str | None, None),
        ("group_idx", int | None, None),
    ]
    stored = msgspec.defstruct("BlockStored", hashes_and_where, tag=True)
    removed = msgspec.defstruct("BlockRemoved", hashes_and_where, tag=True)
    cleared = msgspec.defstruct("AllBlocksCleared", [], tag=True)
    batch = msgspec.defstruct(
        "KVEventBatch",
        [("ts", float), ("events", list[msgspec.Raw]), ("data_parallel_rank", int | None, None)],
        array_like=True,
    )
    event = msgspec.msgpack.Decoder(stored | removed | cleared)
    return msgspec.msgpack.Decoder(batch), event


class ReplicaFeed:
    """One replica's KV event stream, as vLLM's ``ZmqEventPublisher`` publishes it
    (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
    ..., "replay_endpoint": ...}'``), applied to a :class:`RoutingIndex` in sequence order.

    A ZMQ SUB socket connects to ``endpoint``; each message is ``[topic, seq, batch]``
    (an 8-byte big-endian sequence number, the msgpack batch). A gap in the sequence numbers
    (messages the SUB socket dropped, or sent before it connected) is repaired through the
    replica's replay endpoint (a DEALER asks for every batch from the first one missing);
    where the replay cannot cover the gap (no replay endpoint, or its buffer no longer holds
    the batches), the replica's blocks are cleared, since what it holds is unknown, and
    counted as a resync. A sequence number going backwards is a restarted replica: its blocks
    are cleared before the new stream is applied. A batch that does not decode is counted and
    skipped; an event of a type the index does not know is counted and skipped.

    Needs ``pyzmq`` and ``msgspec`` (``pip install ".[router]"``).
    """

    def __init__(
        self,
        index: RoutingIndex,
        name: str,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout_ms: int = 2_000,
        context: Any = None,
    ) -> None:
        import zmq

        index._replica(name)  # a KeyError for a replica the index does not have
        self.index, self.name = index, name
        self._zmq = zmq
        self._context = context or zmq.Context.instance()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_ms = replay_timeout_ms
        self._decode_batch, self._decode_event = _event_decoders()
        #: The sequence number of the last batch applied (None: none yet).
        self.last_seq: int | None = None
        self.batches = 0
        self.malformed = 0
        self.replayed = 0
        self.resyncs = 0
        self.restarts = 0

    def close(self) -> None:
        self._sub.close(linger=0)

    @property
    def socket(self) -> Any:
        """The SUB socket, for a caller that waits on several feeds at once (a
        ``zmq.Poller``) before polling the ready ones with ``timeout_ms=0``."""
        return self._sub

    def poll(self, timeout_ms: int = 0) -> int:
        """Applies every message that arrives within ``timeout_ms`` (then whatever is already
        queued); returns how many batches were applied."""
        applied = 0
        wait = timeout_ms
        while self._sub.poll(wait):
            frames = self._sub.recv_multipart()
            wait = 0
            if len(frames) != 3 or len(frames[1]) != 8:
                self.malformed += 1
                continue
            applied += self._receive(int.from_bytes(frames[1], "big"), frames[2])
        return applied

    def _receive(self, seq: int, payload: bytes) -> int:
        last = self.last_seq
        if last is not None and seq <= last:
            if seq == last:
                return 0  # already applied
            # A publisher numbers its batches from 0 and never repeats one on its stream: a
            # lower number is a restarted replica, whose cache starts empty.
            self.restarts += 1
            self.index.clear_replica(self.name)
            self.last_seq = None
        expected = 0 if self.last_seq is None else self.last_seq + 1
        applied = 0
        if seq > expected:
            applied += self._repair(expected, seq)
        return applied + self._apply(seq, payload)

    def _repair(self, first: int, upto: int) -> int:
        """Asks the replay endpoint for the batches from ``first``; applies those before
        ``upto``. Clears the replica where they cannot all be had."""
        replayed: dict[int, bytes] = {}
        if self._replay_endpoint is not None:
            replayed = self._replay(first)
        if all(s in replayed for s in range(first, upto)):
            for s in range(first, upto):
                self._apply(s, replayed[s])
            self.replayed += upto - first
            return upto - first
        # Batches are lost: what the replica holds is unknown until it stores again.
        self.resyncs += 1
        self.index.clear_replica(self.name)
        return 0

    def _replay(self, first: int) -> dict[int, bytes]:
        zmq = self._zmq
        dealer = self._context.socket(zmq.DEALER)
        found: dict[int, bytes] = {}
        try:
            dealer.connect(self._replay_endpoint)
            dealer.send_multipart([b"", first.to_bytes(8, "big")])
            while dealer.poll(self._replay_timeout_ms):
                frames = dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self.malformed += 1
                    continue
                seq = int.from_bytes(frames[2], "big")
                if seq == END_SEQ:
                    break
                found[seq] = frames[3]
        finally:
            dealer.close(linger=0)
        return found

    def _apply(self, seq: int, payload: bytes) -> int:
        self.last_seq = seq
        try:
            batch = self._decode_batch.decode(payload)
        except Exception:  # msgspec's DecodeError / ValidationError: a malformed batch
            self.malformed += 1
            return 0
        events: list[Any] = []
        for raw in batch.events:
            try:
                events.append(self._decode_event.decode(raw))
            except Exception:  # an event type (or shape) the index does not know: kept in
                events.append(raw)  # its place, for apply_events to count and skip
        self.index.apply_events(self.name, events)
        self.batches += 1
        return 1
