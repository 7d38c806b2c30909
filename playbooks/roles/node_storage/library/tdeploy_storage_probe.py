#!/usr/bin/python
"""Ansible module: does each storage path exist, take a write, and have the free space the job needs."""

from __future__ import annotations

import os
import tempfile

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: tdeploy_storage_probe
short_description: Check storage paths for existence, writability and free space
description:
  - For every path, whether it exists as a directory, whether a file can really be written and
    removed there (permissions, read-only mounts, full disks), its filesystem, mount point and free space.
  - Never fails on a bad path; the result says what is wrong.
options:
  mounts:
    description: Paths to check, each with an optional minimum of free space.
    type: list
    elements: dict
    required: true
    suboptions:
      path:
        description: Absolute path.
        type: str
        required: true
      min_free_gb:
        description: Free space the path needs, in GB (10^9 bytes).
        type: float
"""

RETURN = r"""
mounts:
  description: One result per path, in the order given.
  returned: always
  type: list
"""


def mount_of(path):
    """(mount point, filesystem type) of the longest /proc/mounts entry containing path."""
    best = ("/", None)
    try:
        with open("/proc/mounts", encoding="utf-8") as handle:
            for line in handle:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best[0]):
                    best = (point, fields[2])
    except OSError:
        pass
    return best


def write_error(path):
    """None when a file can be created, written, synced and removed in path; else the error."""
    try:
        fd, name = tempfile.mkstemp(prefix=".tdeploy-write-check-", dir=path)
    except OSError as err:
        return err.strerror or str(err)
    try:
        os.write(fd, b"ok")
        os.fsync(fd)
    except OSError as err:
        return err.strerror or str(err)
    finally:
        os.close(fd)
        os.unlink(name)
    return None


def check(path, min_free_gb):
    """The result of one path."""
    result = {"path": path, "min_free_gb": min_free_gb, "exists": False, "writable": False, "error": None}
    if not os.path.isdir(path):
        result["error"] = "does not exist" if not os.path.exists(path) else "is not a directory"
        return result
    result["exists"] = True
    result["mount_point"], result["fs_type"] = mount_of(os.path.realpath(path))
    stats = os.statvfs(path)
    result["free_bytes"] = stats.f_bavail * stats.f_frsize
    result["total_bytes"] = stats.f_blocks * stats.f_frsize
    error = write_error(path)
    result["writable"] = error is None
    if error is not None:
        result["error"] = f"not writable: {error}"
    elif min_free_gb is not None and result["free_bytes"] < min_free_gb * 1e9:
        result["error"] = "{:.1f} GB free, needs {:g} GB".format(result["free_bytes"] / 1e9, min_free_gb)
    return result


def main():
    """Entry point."""
    module = AnsibleModule(
        argument_spec={
            "mounts": {
                "type": "list",
                "elements": "dict",
                "required": True,
                "options": {"path": {"type": "str", "required": True}, "min_free_gb": {"type": "float"}},
            }
        },
        supports_check_mode=True,
    )
    mounts = [check(m["path"], m["min_free_gb"]) for m in module.params["mounts"]]
    module.exit_json(changed=False, mounts=mounts)


if __name__ == "__main__":
    main()
