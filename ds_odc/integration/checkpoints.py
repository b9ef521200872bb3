"""Checkpoint hooks of the ODC engine: a crash-safe ``latest``, and loading at another world size.

Files stay exactly ZeRO-3's (``zero_to_fp32``, ``ds_to_universal`` and the HF Trainer read them);
what changes is *when* ``latest`` is written and what a universal load restores.

* ``save_checkpoint``: DeepSpeed 0.19.8 lets rank 0 write ``latest`` as soon as *its own* files are
  written, without waiting for the other ranks, and truncates the file in place. A rank that dies
  in the middle of a save can therefore leave ``latest`` naming a checkpoint with a missing or
  half-written shard, or leave ``latest`` empty. Here every rank first finishes and fsyncs its files,
  all ranks meet, and only then does rank 0 replace ``latest`` atomically (temp file, fsync,
  ``os.replace``, fsync of the directory). A crash at any point before that leaves ``latest``
  naming the previous, complete checkpoint. The save's barriers (DeepSpeed's own ``dist.barrier``
  calls inside it, and ours) are ODC rounds: a rank that fails or dies while saving makes the
  others raise at once, naming it, instead of waiting in a collective for the process group's
  timeout.
* ``load_checkpoint`` with ``"checkpoint": {"load_universal": true}``: DeepSpeed's universal path
  restores the trainable fp32 weights and the optimizer state at any world size, but for ZeRO-3 it
  skips the module state entirely, so frozen parameters and buffers would keep their fresh
  initial values. They are restored here from the ``*_model_states.pt`` files (frozen fragments of
  all saving ranks concatenated in rank order, then re-partitioned for this rank).
* loading a non-universal checkpoint saved at another world size fails up front with an error
  that says how to convert it, instead of DeepSpeed's missing-file or world-size error.
"""
from __future__ import annotations

import contextlib
import glob
import os
import re
import tempfile
from typing import Optional

import deepspeed.comm as dist
import torch

from ds_odc.errors import ODCError
from ds_odc.integration.patching import swapped

LATEST = "latest"


def write_latest_atomically(save_dir: str, tag: str) -> None:
    """Replace ``<save_dir>/latest`` with ``tag`` so that a reader sees the old or the new tag, never
    an empty or partial file, even if this process dies half-way."""
    fd, temp_path = tempfile.mkstemp(prefix=".latest.", dir=save_dir)
    try:
        with os.fdopen(fd, "w") as temp_file:
            temp_file.write(tag)
            temp_file.flush()
            os.fsync(temp_file.fileno())
        os.replace(temp_path, os.path.join(save_dir, LATEST))
    except BaseException:
        if os.path.exists(temp_path):
            os.unlink(temp_path)
        raise
    _fsync_directory(save_dir)


def _fsync_directory(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems do not support fsync on directories
        pass
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    if os.path.isfile(path):
        with open(path, "rb") as written:
            os.fsync(written.fileno())


def _rank_of(model_states_path: str) -> int:
    match = re.search(r"zero_pp_rank_(\d+)_", os.path.basename(model_states_path))
    return int(match.group(1)) if match else 0


def _model_states_files(folder: str) -> list:
    return sorted(glob.glob(os.path.join(folder, "*zero_pp_rank_*_model_states.pt")), key=_rank_of)


def _read_tag(load_dir: str, latest_name: str) -> Optional[str]:
    path = os.path.join(load_dir, latest_name)
    if not os.path.isfile(path):
        return None
    with open(path) as latest_file:
        return latest_file.read().strip()


@contextlib.contextmanager
def _barriers_as_rounds(runtime):
    """Within the block, ``deepspeed.comm.barrier()`` over the whole world is an ODC round."""
    original = dist.barrier

    def barrier(group=None, *args, **kwargs):
        if group is None or dist.get_world_size(group=group) == dist.get_world_size():
            return runtime.barrier("a barrier in DeepSpeed's save_checkpoint")
        return original(group, *args, **kwargs)

    with swapped(dist, "barrier", barrier):
        yield


def save_checkpoint(engine, save, save_dir, tag, client_state, save_latest, exclude_frozen_parameters):
    """``ODCEngine.save_checkpoint``: DeepSpeed's ``save`` (the base class's method) with its barriers as
    ODC rounds, then every rank's files fsynced, then ``latest`` replaced atomically (module docstring)."""
    client_state = {} if client_state is None else client_state
    runtime = getattr(engine.optimizer, "odc", None)
    if engine.checkpoint_engine.is_decoupled() or runtime is None:  # decoupled engines commit ``latest`` later
        return save(save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    with runtime.saving():
        with _barriers_as_rounds(runtime):
            result = save(save_dir, tag, client_state=client_state, save_latest=False,
                          exclude_frozen_parameters=exclude_frozen_parameters)
        # DeepSpeed's save ended with a barrier: every rank's files are closed. Make them durable,
        # meet again, and only then point ``latest`` at them.
        for path in (engine._get_ckpt_name(save_dir, tag), engine._get_zero_ckpt_name(save_dir, tag)):
            _fsync_file(path)
        runtime.barrier("checkpoint files written (save_checkpoint)")
        if save_latest and engine.global_rank == 0:
            write_latest_atomically(save_dir, tag)
        runtime.barrier("latest written (save_checkpoint)")
    return result


def load_checkpoint(engine, load, load_dir, tag=None, *args, **kwargs):
    """``ODCEngine.load_checkpoint``: DeepSpeed's ``load``, refused up front for a non-universal
    checkpoint of another world size, followed by the frozen parameters and buffers a universal load
    skips, and the shards re-published to every rank."""
    universal = engine.load_universal_checkpoint()
    resolved = tag if tag is not None else _read_tag(load_dir, "latest_universal" if universal else LATEST)
    if resolved is not None and not universal:
        _check_world_size(engine, load_dir, str(resolved))
    load_path, client_state = load(load_dir, tag, *args, **kwargs)
    if load_path is not None and universal and resolved is not None:
        _restore_module_state(engine, os.path.join(load_dir, str(resolved)))
    if engine.odc_trains:
        engine.optimizer.odc_republish()
    elif engine.odc_runtime is not None:
        engine.odc_runtime.windows_rewritten("re-publishing shards after load_checkpoint")
    return load_path, client_state


def _check_world_size(engine, load_dir: str, tag: str) -> None:
    files = _model_states_files(os.path.join(load_dir, tag))
    world = dist.get_world_size(group=engine.optimizer.dp_process_group)
    if files and len(files) != world:
        raise ODCError(
            f"checkpoint {os.path.join(load_dir, tag)} was saved by {len(files)} data-parallel ranks, this job "
            f"has {world}. Convert it once with DeepSpeed's universal checkpoint tool and load that instead:\n"
            f"  python -m deepspeed.checkpoint.ds_to_universal --input_folder {os.path.join(load_dir, tag)} "
            f"--output_folder {os.path.join(load_dir, tag)}_universal\n"
            f'and set "checkpoint": {{"load_universal": true}} in the ds_config (see docs/checkpoints.md).')


@torch.no_grad()
def _restore_module_state(engine, folder: str) -> None:
    """Frozen parameters and buffers, which DeepSpeed's ZeRO-3 universal load leaves untouched."""
    files = _model_states_files(folder)
    if not files:
        raise ODCError(f"universal checkpoint {folder} has no *_model_states.pt files to restore frozen "
                       "parameters and buffers from")
    states = [torch.load(path, map_location="cpu", weights_only=False) for path in files]
    first = states[0]
    names = {param: name for name, param in engine.module.named_parameters()}
    fragments = [state.get("frozen_param_fragments") or {} for state in states]
    shapes = first.get("frozen_param_shapes") or {}
    rank = dist.get_rank(group=engine.optimizer.dp_process_group)
    for param in engine.module.parameters():
        name = names.get(param)
        if param.requires_grad or name not in shapes:
            continue
        full = torch.cat([f[name].reshape(-1) for f in fragments]).narrow(0, 0, shapes[name].numel())
        shard = param.ds_tensor
        piece = full.narrow(0, min(rank * shard.numel(), full.numel()),
                            max(0, min(shard.numel(), full.numel() - rank * shard.numel())))
        shard.data.zero_()
        shard.data.reshape(-1).narrow(0, 0, piece.numel()).copy_(piece.to(shard.dtype))
    saved_module = first.get("module") or {}
    for name, buffer in engine.module.named_buffers():
        if name in saved_module and saved_module[name].shape == buffer.shape:
            buffer.copy_(saved_module[name].to(buffer.dtype))
