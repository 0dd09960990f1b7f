"""`Checkpointer`: asynchronous, atomic, resumable checkpoints saved along the training schedule.

save(step, state)                        training thread
  validate; wait for the previous save   (at most one save in flight)
  get_state_dict + RNG capture
  stage tensors into reused CPU buffers  (all an async save blocks on; see _writer.py)
  write + commit                         background thread or writer process (_process_writer),
                                         or inline when synchronous

named stateful objects                   ckpt.track("loader", loader): saved with every save
                                         (its state_dict(), in this rank's extra under the
                                         name) and restored by load() (load_state_dict)

load(state)                              newest committed step first
  verify metadata, file sizes and checksums (each rank hashes 1/world_size of the files, all
  agree), read the rank record; damaged: warn, try the previous
  compare stored shapes with the live state (mismatch: ValueError, no fallback)
  dcp.load in place, set_state_dict, restore RNG, return extra
"""

from __future__ import annotations

import json
import logging
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeAlias

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from yatt.ckpt._config import CkptConfig
from yatt.ckpt._group import RankGroup
from yatt.ckpt._layout import (
    CheckpointError,
    CheckpointInfo,
    check_root_writable,
    list_committed_steps,
    read_dcp_metadata,
    read_info,
    read_rank_record,
    remove_leftovers,
    step_dirname,
    verify_checksums,
)
from yatt.ckpt._process_writer import ProcessWriter
from yatt.ckpt._rng import capture_rng_state, restore_rng_state
from yatt.ckpt._runlock import RunLock, RunLockedError, lock_file
from yatt.ckpt._schedule import DEFAULT_STOP_SIGNALS, SaveDecision, SaveSchedule
from yatt.ckpt._space import CheckpointSpaceError, ranks_sharing_disk, shortfall, state_nbytes
from yatt.ckpt._staging import HostStager
from yatt.ckpt._state import (
    apply_state_dict,
    check_shapes,
    collect_state_dict,
    flatten_tensors,
    validate_state,
)
from yatt.ckpt._writer import create_stager, stage_to_cpu, write_and_commit

logger = logging.getLogger("yatt.ckpt")
# A JSON-able value, or a zero-argument callable returning one (called only when a save happens)
Extra: TypeAlias = Any | Callable[[], Any]
WRITER_LOCK_FILE = ".yatt-ckpt-writer.lock"

# DCP warns on every single-process save and load, even when asked for one with no_dist=True.
# Narrow global filter (DCP's module, that message); catch_warnings() would not do, as it is not
# thread-safe and saves run in a background thread.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    category=UserWarning,
    module=r"torch\.distributed\.checkpoint\.",
)


class Checkpointer:
    """Saves and loads checkpoints of `state` under `root`; see `CkptConfig` for the settings.

    In a torch.distributed run, build it on every rank (it creates two private gloo groups) and
    call save/load/maybe_save on every rank in the same order; `root` must be one folder that all
    ranks see (a shared filesystem when ranks span hosts).

    writer="process" writes async saves in one persistent writer process per rank (spawned at
    the first save, stopped by close()) instead of a background thread: the staging buffers are
    shared memory (page-locked with cudaHostRegister on CUDA), so nothing is copied twice. A
    thread's write contends for the GIL with the training loop; use the process writer for large
    states saved often beside a Python-heavy loop (a launch-bound GPU loop is one). The spawned
    process re-imports the launching script as `__mp_main__`: guard its entry point with
    `if __name__ == "__main__":`.

    One writer per root: a writing Checkpointer (the default) holds an advisory lock on
    `root/.yatt-ckpt-writer.lock` (rank 0, from construction to close()) and removes the `.tmp`
    leftovers of killed saves; a second writer of the root gets `RunLockedError`, because its
    clean-up would delete the first one's save in progress. read_only=True opens the root for
    latest/load/verify/step_path only: it takes no lock and changes nothing on disk, so an
    export or eval job can read beside a running trainer.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int = 3,
        keep_every: int | None = None,
        async_save: bool = True,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        phases: tuple[str, ...] = (),
        writer: str = "thread",
        when_busy: str = "wait",
        read_only: bool = False,
    ) -> None:
        if not isinstance(read_only, bool):
            raise ValueError(f"read_only={read_only!r} must be a bool")
        config = CkptConfig(
            keep_last=keep_last,
            keep_every=keep_every,
            async_save=async_save,
            every_steps=every_steps,
            every_seconds=every_seconds,
            phases=phases,
            writer=writer,
            when_busy=when_busy,
        )
        self.config = config
        self.root = Path(root).expanduser().absolute()
        self.read_only = read_only
        self._schedule = SaveSchedule(config)
        self._stager: HostStager | None = None
        # (the writing thread, or None for the writer process; the step being written)
        self._pending: tuple[threading.Thread | None, int] | None = None
        self._pending_error: BaseException | None = None
        self.num_deferred_saves = 0  # due saves that found the writer busy (when_busy="defer")
        # Due saves maybe_save skipped because they would not fit on the disk (_space.py).
        self.num_skipped_saves = 0
        self.last_skip_reason: str | None = None
        self._process_writer: ProcessWriter | None = None
        self._is_closed = False
        self._writer_lock: RunLock | None = None
        self._group = RankGroup()
        self._tracked: dict[str, Any] = {}  # name -> an object with state_dict/load_state_dict
        self.missing_on_load: list[str] = []  # tracked names the last loaded checkpoint lacked
        self._config: dict[str, Any] | None = None  # keep_config's, stored with every save
        self._watched: tuple[str, ...] = ()
        # (field, saved, now) of the watched fields the last loaded checkpoint's config differs in
        self.config_changes: list[tuple[str, Any, Any]] = []
        error = None
        lock_error: RunLockedError | None = None
        if self._group.rank == 0 and not read_only:
            try:
                self._prepare_root()
            except RunLockedError as e:
                error, lock_error = str(e), e
            except ValueError as e:
                error = str(e)
        # Other ranks wait here until rank 0 cleaned up, so no rank writes into a folder that is
        # being removed.
        errors = self._group.gather_errors(error, on_io=False)
        if errors:
            self._release_writer_lock()
            self._group.close()
            if lock_error is not None:
                raise lock_error
            raise ValueError("; ".join(errors))

    @classmethod
    def from_config(
        cls, root: str | os.PathLike[str], config: CkptConfig, *, read_only: bool = False
    ) -> Checkpointer:
        return cls(
            root,
            keep_last=config.keep_last,
            keep_every=config.keep_every,
            async_save=config.async_save,
            every_steps=config.every_steps,
            every_seconds=config.every_seconds,
            phases=config.phases,
            writer=config.writer,
            when_busy=config.when_busy,
            read_only=read_only,
        )

    # -- named stateful objects ------------------------------------------------------------------

    def track(self, name: str, obj: Any) -> None:
        """Save `obj.state_dict()` (JSON-able) with every save, in this rank's extra under
        `name`, and restore it with `obj.load_state_dict(saved)` on load() (a data loader's
        position, a sampler's keep rate, held partial rollouts). A checkpoint without `name`
        (written before it was tracked) leaves `obj` as it is: see `missing_on_load`."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"track(name={name!r}): the name must be a non-empty string")
        if name in self._tracked:
            raise ValueError(f"track(name={name!r}): that name is already tracked")
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(obj, method, None)):
                raise ValueError(
                    f"track(name={name!r}): a {type(obj).__name__} has no {method}(); track "
                    "objects with state_dict() and load_state_dict(state)"
                )
        self._tracked[name] = obj

    def keep_config(self, config: dict[str, Any], *, watched: tuple[str, ...] = ()) -> None:
        """Store `config` (the run's resolved config, JSON-able) with every save, in extra under
        "config". On load, the checkpoint's config is compared with this one on the `watched`
        dotted fields (e.g. "loss.objective"): the differences go into `config_changes` as
        (field, saved, now) and are warned about once. Call before load()."""
        try:
            self._config = json.loads(json.dumps(config, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise ValueError(f"keep_config: the config is not JSON-able ({e})") from None
        self._watched = tuple(watched)

    @property
    def tracked(self) -> dict[str, Any]:
        """The tracked objects by name, in the order they were tracked (and restored)."""
        return dict(self._tracked)

    def _with_tracked(self, extra: Any) -> Any:
        named = dict(self._tracked)
        if self._config is not None:
            named["config"] = None
        if not named:
            return extra
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(
                f"extra is a {type(extra).__name__}; with tracked objects "
                f"({sorted(named)}) extra must be a dict (or None) to hold them too"
            )
        clash = sorted(set(extra or {}) & set(named))
        if clash:
            raise ValueError(f"extra has keys {clash} that tracked objects use; rename one")
        states = {name: obj.state_dict() for name, obj in self._tracked.items()}
        if self._config is not None:
            states["config"] = self._config
        return {**(extra or {}), **states}

    def _restore_tracked(self, extra: Any) -> None:
        self.missing_on_load = [
            name for name in self._tracked if not isinstance(extra, dict) or name not in extra
        ]
        for name, obj in self._tracked.items():
            if name not in self.missing_on_load:
                obj.load_state_dict(extra[name])
        saved = extra.get("config") if isinstance(extra, dict) else None
        self.config_changes = []
        if self._config is not None and isinstance(saved, dict):  # older: nothing to compare
            for name in self._watched:
                before, now = _dotted(saved, name), _dotted(self._config, name)
                if before != now:
                    self.config_changes.append((name, before, now))
        if self.config_changes:
            changes = "; ".join(f"{n} {b!r} -> {a!r}" for n, b, a in self.config_changes)
            logger.warning("resuming with changed settings (the run's meaning): %s", changes)

    # -- saving -----------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], *, extra: Extra = None) -> None:
        """Checkpoint `state` (modules, optimizers, tensors, stateful objects) as `step`.

        `extra` is any JSON-able value (config, data-loader position), saved per rank, or a
        zero-argument callable returning one: called here, once, on this thread, before any
        background work, so a large extra is built only when a save happens. It is encoded to
        JSON here too (a snapshot: changing it after save returns changes nothing). With
        async_save this returns once the tensors are copied to CPU memory; a second call first
        waits for the previous save. Errors of a background save are raised by the next
        save/wait/close.
        """
        self._check_writable("save")
        _check_step(step)
        owners = validate_state(state)
        if callable(extra):
            extra = extra()
        extra_json = _encode_extra(self._with_tracked(extra))
        self.wait()
        record = {"rank": self._group.rank, "rng": capture_rng_state(), "extra_json": extra_json}
        live = collect_state_dict(state, owners)
        self._check_space(step, live)
        self._schedule.note_saved(step)
        if not self.config.async_save:
            self._write_and_commit(step, live, record)
            return
        is_process = self.config.writer == "process"
        if self._stager is None:
            self._stager = create_stager(share_memory=is_process)
        staged = stage_to_cpu(self._stager, live)
        if is_process:
            if self._process_writer is None:
                self._process_writer = ProcessWriter(
                    self.root,
                    keep_last=self.config.keep_last,
                    keep_every=self.config.keep_every,
                    group=self._group,
                )
            self._process_writer.submit(step, staged, record)
            self._pending = (None, step)
            return
        thread = threading.Thread(
            target=self._write_in_background, args=(step, staged, record), name=f"yatt-ckpt-{step}"
        )
        self._pending = (thread, step)
        thread.start()

    def _check_space(self, step: int, live: dict[str, Any]) -> None:
        """CheckpointSpaceError on every rank when the save would not fit on some rank's disk
        (after the previous save committed and pruned: save() waited for it)."""
        need = state_nbytes(live) * ranks_sharing_disk()
        error = shortfall(self.root, step, need, keep_last=self.config.keep_last)
        errors = self._group.gather_errors(error, on_io=False)
        if errors:
            raise CheckpointSpaceError("; ".join(errors))

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed; raise its error if it failed."""
        if self._pending is None:
            return
        thread, step = self._pending
        if thread is not None:
            thread.join()
        else:
            assert self._process_writer is not None
            message = self._process_writer.wait()
            self._pending_error = None if message is None else CheckpointError(message)
        self._pending = None
        error, self._pending_error = self._pending_error, None
        if error is not None:
            raise CheckpointError(
                f"saving step {step} under {str(self.root)!r} failed: {error}"
            ) from error

    def maybe_save(
        self, step: int, state: dict[str, Any], *, phase: str | None = None, extra: Extra = None
    ) -> SaveDecision:
        """Save if the schedule says so (see `CkptConfig`); after a stop signal, save, wait for
        the commit and return should_stop=True. `extra` as for save(): pass a callable when it
        is costly to build, and it is called only on the steps that save."""
        self._check_writable("maybe_save")
        if not self._schedule.is_eligible(phase):
            return SaveDecision(is_saved=False, should_stop=False)
        local = [
            int(self._schedule.is_stop_requested),
            int(self._schedule.is_time_due()),
            self._schedule.stop_signal or 0,
        ]
        if self._group.is_distributed and (
            self.config.every_seconds is not None or self._schedule.has_signal_handlers
        ):
            # Clocks and signals differ per rank; save when any rank says so, or the ranks would
            # enter the save's collectives at different steps and hang. The signal number rides
            # along (max), so every rank reports the same one.
            local = self._group.max_over_ranks(local)
        should_stop, is_time_due, stop_signal = bool(local[0]), bool(local[1]), local[2]
        if should_stop:
            self._schedule.is_stop_requested = True
            self._schedule.stop_signal = stop_signal or self._schedule.stop_signal
            self.save(step, state, extra=extra)
            self.wait()
            return SaveDecision(
                is_saved=True, should_stop=True, stop_signal=self._schedule.stop_signal
            )
        if not (is_time_due or self._schedule.is_step_due(step) or self._schedule.is_deferred):
            return SaveDecision(is_saved=False, should_stop=False)
        if self.config.when_busy == "defer":
            (is_busy,) = self._group.any_rank([self.is_writing()])  # every rank defers alike
            if is_busy:
                self._schedule.is_deferred = True
                self.num_deferred_saves += 1
                return SaveDecision(is_saved=False, should_stop=False, is_deferred=True)
        try:
            self.save(step, state, extra=extra)
        except CheckpointSpaceError as e:
            # A scheduled save that cannot fit: the run goes on with its newest checkpoint
            # (a crash would lose the steps since, not the run), counted and warned at each
            # due save; the next due save tries again. Every rank raised alike.
            self.num_skipped_saves += 1
            self.last_skip_reason = str(e)
            logger.warning("checkpoint skipped (%d so far): %s", self.num_skipped_saves, e)
            return SaveDecision(is_saved=False, should_stop=False, is_skipped=True)
        return SaveDecision(is_saved=True, should_stop=False)

    def is_writing(self) -> bool:
        """True while an async save is still being written (a save now would wait for it)."""
        if self._pending is None:
            return False
        thread, _ = self._pending
        if thread is not None:
            return thread.is_alive()
        assert self._process_writer is not None
        return self._process_writer.is_busy()

    def install_signal_handlers(self, signals: tuple[int, ...] = DEFAULT_STOP_SIGNALS) -> None:
        """Turn `signals` (default SIGTERM, SIGUSR1, SIGINT, SIGHUP) into a stop flag: the next eligible
        `maybe_save` does a final blocking save and returns should_stop=True with the signal in
        `stop_signal` (exit with `decision.exit_code`, 128 + signum). A second SIGINT raises
        KeyboardInterrupt at once, so Ctrl-C twice still aborts. Call on every rank from the
        main thread; `close()` restores the previous handlers."""
        self._check_writable("install_signal_handlers")
        self._schedule.install_signal_handlers(signals)

    @property
    def stop_signal(self) -> int | None:
        """The signal that asked this run to stop (None before one arrived); after a stop
        decision of a distributed run, the same on every rank."""
        return self._schedule.stop_signal

    # -- loading ----------------------------------------------------------------------------------

    def load(self, state: dict[str, Any], *, step: int | None = None) -> Any:
        """Load the newest sound checkpoint (or exactly `step`) into `state`; restore this rank's
        RNG states and the tracked objects (`track`), and return its `extra` (the tracked
        objects' saved states included). A damaged newest checkpoint is skipped with a warning;
        a checkpoint of a different model shape raises ValueError."""
        self._check_open()
        owners = validate_state(state)
        self.wait()
        if step is not None:
            _check_step(step)
            candidates = [step]
        else:
            candidates = list(reversed(list_committed_steps(self.root)))
        if not candidates:
            raise CheckpointError(f"no committed checkpoint under {str(self.root)!r}")
        # Collective, once, before any rank can fall back on its own: the tensor keys every rank
        # loads (per-rank keyed states hold only their own keys on each rank).
        all_live_keys = self._group.union(set(flatten_tensors(collect_state_dict(state, owners))))
        failures = []
        for candidate in candidates:
            try:
                extra = self._load_one(candidate, state, owners, all_live_keys)
            except CheckpointError as e:
                if step is not None:
                    raise
                failures.append(str(e))
                warnings.warn(f"{e}; falling back to the previous checkpoint", stacklevel=2)
                continue
            self._restore_tracked(extra)
            return extra
        raise CheckpointError(
            f"no loadable checkpoint under {str(self.root)!r}: " + "; ".join(failures)
        )

    def latest(self) -> int | None:
        """The newest committed step under root, or None."""
        steps = list_committed_steps(self.root)
        return steps[-1] if steps else None

    def step_path(self, step: int) -> Path:
        """The folder of committed checkpoint `step` (a torch.distributed.checkpoint folder,
        e.g. for yatt.core.export_hf_from_checkpoint); CheckpointError if it is not committed."""
        if step not in list_committed_steps(self.root):
            raise CheckpointError(
                f"step {step} has no committed checkpoint under {str(self.root)!r}; committed: "
                f"{list_committed_steps(self.root)}"
            )
        return self.root / step_dirname(step)

    def verify(self, step: int) -> CheckpointInfo:
        """Check `step`'s metadata (step, time, world size, versions, file sizes, DCP index) and
        every file's checksum against the disk (reads the whole checkpoint, in this process);
        raise CheckpointError naming the checkpoint, the file and the problem."""
        info = read_info(self.root, step)
        read_dcp_metadata(info)
        verify_checksums(info, sorted(info.checksums))
        return info

    def close(self) -> None:
        """Wait for the in-flight save, restore signal handlers, release buffers and groups."""
        if self._is_closed:
            return
        try:
            self.wait()
        finally:
            self._is_closed = True
            self._schedule.restore_signal_handlers()
            if self._process_writer is not None:
                self._process_writer.close()
                self._process_writer = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            self._group.close()
            self._release_writer_lock()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._is_closed:
            raise ValueError("this Checkpointer is closed; build a new one")

    def _check_writable(self, method: str) -> None:
        self._check_open()
        if self.read_only:
            raise ValueError(
                f"{method}() on a Checkpointer built with read_only=True; build it without "
                "read_only to save (one writer per root)"
            )

    def _prepare_root(self) -> None:
        """Rank 0 of a writer: create root, take the writer lock, remove leftovers, probe."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._writer_lock = lock_file(
                self.root / WRITER_LOCK_FILE,
                purpose="checkpoint writer",
                hint=(
                    "a second writer of one root would delete its save in progress; read "
                    "beside it with Checkpointer(root, read_only=True), or write elsewhere"
                ),
            )
        except OSError:
            error = check_root_writable(self.root)  # names the problem with the folder
            raise ValueError(error or f"cannot lock checkpoint root {str(self.root)!r}") from None
        # Leftovers first: a save that failed on a full disk holds the space the write probe
        # needs, and a refusal then would keep it held forever. Only a lock holder removes
        # them: they may be another writer's save in progress otherwise.
        try:
            removed = remove_leftovers(self.root)
        except OSError as exc:  # the probe below says what is wrong with the folder
            removed = []
            logger.warning("could not remove checkpoint leftovers: %s", exc)
        if removed:
            logger.info("removed unfinished checkpoint leftovers under %s: %s", self.root, removed)
        error = check_root_writable(self.root)
        if error is not None:
            raise ValueError(error)

    def _release_writer_lock(self) -> None:
        if self._writer_lock is not None:
            self._writer_lock.release()
            self._writer_lock = None

    def _write_in_background(self, step: int, staged: dict[str, Any], record: dict) -> None:
        try:
            self._write_and_commit(step, staged, record)
        except BaseException as e:  # re-raised in the training thread by wait()
            self._pending_error = e

    def _write_and_commit(self, step: int, state_dict: dict[str, Any], record: dict) -> None:
        write_and_commit(
            self.root,
            step,
            state_dict,
            record,
            self._group,
            keep_last=self.config.keep_last,
            keep_every=self.config.keep_every,
        )

    def _load_one(
        self, step: int, state: dict[str, Any], owners: dict, all_live_keys: set[str]
    ) -> Any:
        info = read_info(self.root, step)
        # Contents, split over the ranks (each reads 1/world_size of the bytes), then agreed:
        # every rank must fall back from the same checkpoint, or their collectives would part.
        share = sorted(info.checksums)[self._group.rank :: self._group.world_size]
        try:
            verify_checksums(info, share)
            error = None
        except CheckpointError as e:
            error = str(e)
        errors = self._group.gather_errors(error, on_io=False)
        if errors:
            raise CheckpointError("; ".join(errors))
        source_rank = self._group.rank % info.world_size
        record = read_rank_record(info, source_rank)
        metadata = read_dcp_metadata(info)
        if info.world_size != self._group.world_size:
            warnings.warn(
                f"checkpoint {str(info.path)!r} was written by {info.world_size} ranks and is "
                f"loaded on {self._group.world_size}: tensors are resharded; rank "
                f"{self._group.rank} takes the RNG states and extra of rank {source_rank}",
                stacklevel=3,
            )
        if info.versions.get("torch") != torch.__version__:
            warnings.warn(
                f"checkpoint {str(info.path)!r} was written with torch "
                f"{info.versions.get('torch')}, loading with {torch.__version__}",
                stacklevel=3,
            )
        live = collect_state_dict(state, owners)
        check_shapes(live, metadata, name=str(info.path), all_live_keys=all_live_keys)
        try:
            dcp.load(
                live,
                storage_reader=dcp.FileSystemReader(info.path),
                process_group=self._group.io,
                no_dist=not self._group.is_distributed,
            )
        except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
            raise CheckpointError(
                f"checkpoint {str(info.path)!r}: reading tensors failed: {e!r}"
            ) from e
        apply_state_dict(state, owners, live)
        restore_rng_state(record["rng"], source=str(info.path))
        self._schedule.note_saved(step)
        return record["extra"]


def _dotted(config: dict[str, Any], name: str) -> Any:
    """config["a"]["b"] for "a.b" (None where a part is missing)."""
    value: Any = config
    for part in name.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _encode_extra(extra: Any) -> str:
    """`extra` as JSON text, once, with the C encoder: the writer stores this text as it is,
    so a large extra is not encoded again (indented, by the pure-Python encoder) in the
    writing thread, holding the GIL against the training loop, nor pickled as a tree to the
    writer process."""
    try:
        return json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"extra is not JSON-able ({e}); pass dicts/lists of str, int, float, bool, None, "
            "or a callable returning one"
        ) from e


def _check_step(step: int) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step={step!r} must be an int >= 0 (the training step being saved)")
