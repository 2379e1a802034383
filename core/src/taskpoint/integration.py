"""What core gives the author of a framework adapter: the building blocks under ``taskpoint_*``.

The framework adapters (``taskpoint_pytorch``, ``taskpoint_lightning``, ``taskpoint_hf``,
``taskpoint_sklearn``, ``taskpoint_unsloth``) import from two places only: ``taskpoint``
(what every user sees) and this module (what an adapter author needs besides: mirrors of
a framework's checkpoint folder, step boundaries and preemption stops, the rank helpers,
restores to several nodes' disks). ``tests/test_adapter_api.py`` keeps them to that. Each
name here is re-exported from the module that defines it; its behaviour, errors and units
are documented there. The names are grouped by the job they do:

- a framework's checkpoint folder, uploaded while training goes on: :class:`FolderMirror`
  (one process), :class:`JobMirror` and :class:`Nodes` (every rank of a job),
  :class:`MirrorStats` and :func:`combined_metrics` (what the uploads cost), :func:`unshare`;
- an adapter's own background uploads: :class:`UploadThread`,
  :func:`track`, :func:`note_coalesced`, :func:`make_way`, :func:`settle_uploads`,
  :func:`uploads_in_flight`;
- what a checkpoint holds: :class:`Manifest` (:meth:`taskpoint.Checkpoint.committed`'s
  items), :func:`stores_by_content`;
- the checkpoint an adapter is given: :func:`check_checkpoint_like`;
- local files on their way to a save, which a process killed mid-save leaves to the next
  process to remove: :func:`scratch_folder`, :func:`remove_scratch_folder`;
- a warning both logged and issued as a :class:`taskpoint.TaskpointWarning`: :func:`warn`;
- when to save: :class:`BoundarySaves` and its :class:`Turn` (a plain loop's save call),
  :class:`SaveSchedule`, :class:`TimedSaves`, :func:`check_every`, :class:`StepBoundary`,
  :func:`estimate_save_s`;
- a save at a failure, of the state as it was at the last step boundary: :class:`FailureHook`
  (when a plain loop's attempt fails), and for a torch job :class:`WriteWatch`,
  :func:`module_tensors`, :func:`snapshot_rng`, :func:`reset_rng`;
- preemption: :func:`saves_on_preemption`, :func:`install`, :func:`deferred`,
  :func:`requested`, :class:`PreemptionStop`, :class:`Decision`, :func:`within_grace`,
  :class:`AnyRank`, :func:`wait_on_preemption`;
- ranks: :func:`rank_and_size`, :func:`current_ranks`, :class:`Ranks`,
  :func:`is_distributed`, :func:`all_gather_object`, :func:`broadcast_from_zero`,
  :func:`barrier`, :func:`gather_or_raise`, :func:`raise_first_failure`,
  :func:`describe_error`, :func:`check_agreement`, :func:`check_timeout`,
  :func:`check_wait`;
- coordinators and nodes' disks: :class:`TorchCoordinator`, :func:`torch_job_coordinator`,
  :func:`run_everywhere`, :class:`Disks`, :func:`restore_to_every_disk`, :func:`list_files`.

Example: a framework whose save hook has just written a complete checkpoint folder::

    from taskpoint.integration import FolderMirror, settle_uploads

    settle_uploads()                            # restore: a failed attempt's upload first
    mirror = FolderMirror(checkpoint)           # any taskpoint.CheckpointLike
    mirror.save(output_dir, step=step)          # in the framework's save hook
    mirror.wait()                               # at the end of training

This module is a face of core, like ``taskpoint`` itself: it sits above every layer
(``tests/test_layers.py``) and holds no logic of its own.
"""

from taskpoint._scratch import remove as remove_scratch_folder
from taskpoint._scratch import scratch_folder
from taskpoint._types import check_checkpoint_like
from taskpoint.checkpoint._settle import settle_uploads, track
from taskpoint.checkpoint._upload_thread import UploadThread
from taskpoint.checkpoint.checkpoint import stores_by_content
from taskpoint.checkpoint.job_mirror import JobMirror, Nodes
from taskpoint.checkpoint.mirror import (
    FolderMirror,
    MirrorStats,
    combined_metrics,
    make_way,
    note_coalesced,
    unshare,
    uploads_in_flight,
)
from taskpoint.distributed.coordination import check_agreement, check_timeout, check_wait
from taskpoint.distributed.nodes import Disks, list_files, restore_to_every_disk, run_everywhere
from taskpoint.distributed.torch_collectives import (
    Ranks,
    all_gather_object,
    barrier,
    broadcast_from_zero,
    current_ranks,
    describe_error,
    gather_or_raise,
    is_distributed,
    raise_first_failure,
    rank_and_size,
)
from taskpoint.distributed.torch_coordination import (
    AnyRank,
    TorchCoordinator,
    torch_job_coordinator,
)
from taskpoint.errors import warn
from taskpoint.format.manifest import Manifest
from taskpoint.preemption import deferred, install, requested
from taskpoint.runtime.boundary_saves import BoundarySaves, Turn
from taskpoint.runtime.context import saves_on_preemption
from taskpoint.runtime.failure_hook import FailureHook
from taskpoint.runtime.interval import SaveSchedule, TimedSaves, check_every
from taskpoint.runtime.preemption_stop import (
    Decision,
    PreemptionStop,
    wait_on_preemption,
    within_grace,
)
from taskpoint.runtime.step_boundary import StepBoundary, estimate_save_s
from taskpoint.runtime.torch_state import WriteWatch, module_tensors, reset_rng, snapshot_rng

__all__ = [
    "AnyRank",
    "BoundarySaves",
    "Decision",
    "Disks",
    "FailureHook",
    "FolderMirror",
    "JobMirror",
    "Manifest",
    "MirrorStats",
    "Nodes",
    "PreemptionStop",
    "Ranks",
    "SaveSchedule",
    "StepBoundary",
    "TimedSaves",
    "TorchCoordinator",
    "Turn",
    "UploadThread",
    "WriteWatch",
    "all_gather_object",
    "barrier",
    "broadcast_from_zero",
    "check_agreement",
    "check_checkpoint_like",
    "check_every",
    "check_timeout",
    "check_wait",
    "combined_metrics",
    "current_ranks",
    "deferred",
    "describe_error",
    "estimate_save_s",
    "gather_or_raise",
    "install",
    "is_distributed",
    "list_files",
    "make_way",
    "module_tensors",
    "note_coalesced",
    "raise_first_failure",
    "rank_and_size",
    "remove_scratch_folder",
    "requested",
    "reset_rng",
    "restore_to_every_disk",
    "run_everywhere",
    "saves_on_preemption",
    "scratch_folder",
    "settle_uploads",
    "snapshot_rng",
    "stores_by_content",
    "torch_job_coordinator",
    "track",
    "unshare",
    "uploads_in_flight",
    "wait_on_preemption",
    "warn",
    "within_grace",
]
