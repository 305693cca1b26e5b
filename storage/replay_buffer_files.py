"""A saved replay buffer on any fsspec storage, in the commit-marker protocol (nothing unpickled).

One safetensors payload per finished group (``groups/{n}.safetensors``), then the marker ``buffer.json`` listing
them with their sizes and sha256 and carrying every prompt's tags. :meth:`ReplayBuffer.save
<ppoflow.storage.replay_buffer.ReplayBuffer.save>` and ``load`` say what a saved buffer means.
"""

from __future__ import annotations

from tensordict import TensorDict

from ppoflow.storage.batch import decode_batch, encode_batch
from ppoflow.storage.fs import StorageError, atomic_write, join, open_fs, remove_if_present
from ppoflow.storage.marker import MarkerFormat, file_entry, read_verified

MARKER = "buffer.json"
GROUPS_DIR = "groups"
BUFFER_MARKER = MarkerFormat(version=1, fields={"prompts": list, "groups": dict})
"""``buffer.json``: ``prompts`` (every prompt's tags, in insertion order) and ``groups`` ({uid: file name})."""


class ReplayBufferError(StorageError):
    """A saved buffer file that cannot be used; ``path`` names it."""


def write_buffer(url: str, storage_options: dict | None, state: dict) -> None:
    """Write a buffer's ``state_dict()`` under the folder ``url``: the old marker is removed first (then the old
    payloads), so a write interrupted anywhere leaves no valid buffer rather than a mix of two."""
    fs, root = open_fs(url, storage_options)
    marker_path = join(root, MARKER)
    remove_if_present(fs, marker_path)
    for old_payload in fs.find(join(root, GROUPS_DIR)):
        remove_if_present(fs, old_payload)
    files, groups = {}, {}
    for number, (uid, group) in enumerate(state["groups"].items()):
        name = f"{GROUPS_DIR}/{number}.safetensors"
        data = encode_batch(group)
        atomic_write(fs, join(root, name), data)
        files[name], groups[uid] = file_entry(data), name
    atomic_write(fs, marker_path, BUFFER_MARKER.encode(files, prompts=state["prompts"], groups=groups))


def read_buffer(url: str, storage_options: dict | None) -> tuple[list, dict[str, TensorDict], str]:
    """The saved prompts' tags, the finished groups and the marker's path; every payload is checked against the
    marker (size, then sha256) before it is decoded. :class:`ReplayBufferError` names a missing or damaged file."""
    fs, root = open_fs(url, storage_options)
    marker_path = join(root, MARKER)
    try:
        marker = BUFFER_MARKER.decode(fs.cat_file(marker_path))
    except FileNotFoundError as missing:
        raise ReplayBufferError(marker_path, "missing file") from missing
    except (OSError, ValueError, RecursionError) as error:  # RecursionError: JSON nested too deeply
        raise ReplayBufferError(marker_path, f"unreadable {MARKER}: {error}") from error
    groups = {}
    for uid, name in marker["groups"].items():
        if not isinstance(name, str) or name not in marker["files"]:
            raise ReplayBufferError(marker_path, f"the group of {uid!r} is in {name!r}, which is not listed")
        path = join(root, name)
        try:
            groups[uid] = decode_batch(read_verified(fs, path, marker["files"][name], error=ReplayBufferError))
        except ValueError as error:
            raise ReplayBufferError(path, f"undecodable payload: {error}") from error
    return marker["prompts"], groups, marker_path
