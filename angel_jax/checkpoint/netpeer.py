"""The peer tier over the network: every committed snapshot is sent to the next node's receiver (peer_receiver.py),
which keeps it in that node's memory, so that losing a node loses no snapshot (TRANSOM's backup, without a
mounted directory).

It is the peer tier the manager chains like any other (tiers.py): `copy_from` sends a committed memory-tier
snapshot to `NetworkPeer.destination` (best effort: a refused or failed copy is reported and the save goes on to
the persistent tier), and reading finds this process's copies

    in the local store (`NetworkPeer.root`: copies another node sent here while this process's snapshots were
    made on that node), then
    on the other processes' receivers (`NetworkPeer.sources`), asked once, at the first listing (restore time),

so a rank that moves to a spare after its node was lost restores from the neighbour's copy. A copy held elsewhere
is listed under a local path it never gets: loading it fetches its bytes into this process's memory and checks
them against the checksums of the signed index (always: they crossed the network), and restore hands out views of
them (writable, as every restored array), as the peer copy it is.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from angel_jax.checkpoint import peer_wire as wire
from angel_jax.checkpoint import snapshot as snap
from angel_jax.checkpoint.faults import Fault, no_fault
from angel_jax.checkpoint.retention import steps_to_keep
from angel_jax.checkpoint.tiers import Committed, CopyTier, SnapshotDirectories

log = logging.getLogger(__name__)


class NetworkPeerTier(SnapshotDirectories, CopyTier):
    """This process's peer copies: sent to the next node, read back from wherever they are."""

    name = "peer"
    committed_state = "backed_up"
    stage = "peer"
    best_effort = True

    def __init__(self, network: wire.NetworkPeer, keep_last: int, *, fault: Fault = no_fault):
        super().__init__(network.root, keep_last)
        self.network = network
        self._fault = fault
        self._remote: dict[int, tuple[tuple[str, int], int]] | None = None  # step -> (receiver, bytes), once asked
        self._lock = threading.Lock()  # _remote: the save worker and the training thread both read and change it
        self._kept: tuple[int, snap.SnapshotIndex, np.ndarray] | None = None  # a copy `check` fetched, for `load`

    def __repr__(self) -> str:
        return f"NetworkPeerTier(to {wire.address_text(self.network.destination)}, local copies in {self.root})"

    # ------------------------------------------------------------------------------------------- writing

    def copy_from(self, source: Committed) -> Path:
        """Sends the snapshot to the next node's receiver; returns once that node has checked and committed it."""
        peer, step = self.network, source.step
        if peer.destination is None:
            raise wire.PeerRefused("no other node to send the copy to (the job runs on one node)")
        where = wire.address_text(peer.destination)
        try:
            sock, _ = wire.request(peer, peer.destination, "put", step=step, index=source.index.to_json())
            with sock:
                wire.send_data(sock, source.path, source.index.data_bytes)
                wire.expect_ok(sock, peer.token)
        except wire.PeerRefused as e:
            raise wire.PeerRefused(f"the receiver at {where} refused step {step}: {e}") from None
        except OSError as e:
            raise OSError(e.errno, f"sending step {step} to the receiver at {where}: {e.strerror or e}") from None
        self._remote_steps()
        with self._lock:
            self._remote[step] = (peer.destination, source.index.data_bytes)  # (listed as backed up)
        self._fault("peer.commit", step)
        return Path(f"{where}/{peer.key}") / snap.step_dir(Path(), step)

    # ------------------------------------------------------------------------------------------- reading

    def scan(self) -> tuple[dict[int, Path], dict[int, Path]]:
        committed, partial = snap.scan(self.root)
        remote = {s: snap.step_dir(self.root, s) for s in self._remote_steps() if s not in committed}
        return {**remote, **committed}, partial

    def sizes(self) -> tuple[dict[int, tuple[Path, int]], dict[int, tuple[Path, int]]]:
        committed, partial = super().sizes()
        remote = self._remote_steps()
        return ({s: (p, nbytes if nbytes or s not in remote else remote[s][1]) for s, (p, nbytes) in committed.items()},
                partial)

    def load(self, step: int, *, verify: bool, pool: Executor | None,
             select: snap.Select | None = None) -> tuple[snap.SnapshotIndex, dict[str, np.ndarray]]:
        local = snap.step_dir(self.root, step)
        if local.is_dir() or step not in self._remote_steps():
            return snap.load(local, verify=verify, pool=pool, select=select)
        index, data = self._fetched(step)
        chosen = snap.selected(index, select)
        arrays = wire.arrays_in(chosen, data)
        # (bytes that crossed the network are always checked, whatever verify_on_restore says)
        if problems := snap.verify_arrays(chosen, arrays, pool, self._where(step)):
            raise snap.SnapshotDamaged(problems)
        return index, arrays

    def check(self, step: int, pool: Executor | None) -> list[str]:
        local = snap.step_dir(self.root, step)
        if local.is_dir() or step not in self._remote_steps():
            return snap.check(local, pool)
        try:
            index, data = self._fetched(step)
        except snap.SnapshotDamaged as e:
            return e.problems
        problems = snap.verify_arrays(index, wire.arrays_in(index, data), pool, self._where(step))
        if not problems:  # the restore that follows reads these bytes instead of fetching them again
            self._kept = (step, index, data)
        return problems

    def delete(self, step: int) -> None:
        snap.remove_dir(snap.step_dir(self.root, step))
        self._forget(step)  # (the receiver's own retention bounds what it holds)

    def retain(self, protect: frozenset[int] | set[int] = frozenset()) -> None:
        """keep_last newest of the local copies; the copies elsewhere only leave this listing (their receivers
        keep their own keep_last)."""
        local, _ = snap.scan(self.root)
        keep = steps_to_keep(self.scan()[0], self.keep_last)
        for step in list(self.scan()[0]):
            if step not in keep and step not in protect:
                if step in local:
                    snap.remove_dir(local[step])
                else:
                    self._forget(step)

    def discard_everywhere(self) -> None:
        """Removes this process's copies from the local store and from every receiver that answers (a run that
        starts afresh, train.resume=false, must never restore the copies of the run it replaced)."""
        snap.remove_dir(self.root)
        with self._lock:
            self._remote = {}
        for address in self._receivers():
            try:
                sock, _ = wire.request(self.network, address, "drop")
                sock.close()
            except (OSError, wire.PeerRefused) as e:
                log.warning("peer copies of %s at %s not removed: %s", self.network.key, wire.address_text(address), e)

    # ------------------------------------------------------------------------------------------- remote copies

    def _receivers(self) -> list[tuple[str, int]]:
        found = list(self.network.sources)
        if self.network.destination is not None and self.network.destination not in found:
            found.append(self.network.destination)
        return found

    def _forget(self, step: int) -> None:
        with self._lock:
            if self._remote is not None:
                self._remote.pop(step, None)

    def _remote_steps(self) -> dict[int, tuple[tuple[str, int], int]]:
        """step -> (a receiver holding a copy, its bytes), a copy of the listing: every receiver asked once, in
        parallel; one that does not answer within the timeout holds nothing as far as this process knows."""
        if self._remote is None:
            found: dict[int, tuple[tuple[str, int], int]] = {}
            receivers = self._receivers()
            if receivers:
                with ThreadPoolExecutor(min(16, len(receivers)), thread_name_prefix="peer-list") as pool:
                    listings = list(pool.map(self._list_one, receivers))
                for address, steps in zip(receivers, listings):
                    for step, nbytes in steps:
                        found.setdefault(step, (address, nbytes))
            with self._lock:
                if self._remote is None:
                    self._remote = found
        with self._lock:
            return dict(self._remote)

    def _list_one(self, address: tuple[str, int]) -> list[tuple[int, int]]:
        try:
            sock, reply = wire.request(self.network, address, "list")
            sock.close()
        except (OSError, wire.PeerRefused) as e:
            log.info("peer copies: the receiver at %s did not list its copies (%s)", wire.address_text(address), e)
            return []
        steps = reply.get("steps")
        if not isinstance(steps, list):
            return []
        return [(int(s), int(n)) for s, n in (p for p in steps if isinstance(p, list) and len(p) == 2)
                if isinstance(s, int) and isinstance(n, int) and s >= 0]

    def _where(self, step: int) -> str:
        held = self._remote_steps().get(step)
        return f"the peer copy of step {step} at {wire.address_text(held[0] if held else None)}"

    def _fetched(self, step: int) -> tuple[snap.SnapshotIndex, np.ndarray]:
        """`step`'s copy from the receiver that listed it, into this process's memory (a fresh file in a tmpfs
        costs a page fault per page on the way in: anonymous memory takes the bytes about twice as fast), not yet
        checked against its checksums; SnapshotDamaged naming the receiver and the problem when it cannot be had.
        The copy `check` kept is handed over once."""
        kept, self._kept = self._kept, None
        if kept is not None and kept[0] == step:
            return kept[1], kept[2]
        address, _ = self._remote_steps()[step]
        where = wire.address_text(address)
        try:
            sock, reply = wire.request(self.network, address, "get", step=step)
            with sock:
                index = wire.parse_index(reply.get("index"), step)
                data = wire.receive_buffer(sock, index.data_bytes)
        except (OSError, wire.PeerRefused) as e:
            self._forget(step)
            raise snap.SnapshotDamaged([f"the peer copy of step {step} at {where}: {e}"]) from None
        log.info("fetched the peer copy of step %d (%s, %s B) from %s", step, self.network.key,
                 f"{index.data_bytes:,}", where)
        return index, data
