"""Checkpoint manifests: every file with its size and SHA-256 digest; each kind of damage named."""

import hashlib
import json

from rltrain.trainer.manifest import MANIFEST, verify_manifest, write_manifest

FILES = {
    "driver_state.json": b'{"step": 2}\n',
    "actor/latest": b"step_2",
    "actor/step_2/__0_0.distcp": bytes(range(256)) * 40,
    "actor/step_2/common.pt": b"\x80\x02common" * 3,
}


def make_checkpoint(root):
    for rel, data in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    write_manifest(root)
    return root


def test_manifest_lists_every_file_with_size_and_digest(tmp_path):
    make_checkpoint(tmp_path)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["checksum"] == "sha256"
    assert manifest["files"] == {
        rel: {"size": len(data), "digest": hashlib.sha256(data).hexdigest()}
        for rel, data in sorted(FILES.items())
    }
    check = verify_manifest(tmp_path)
    assert check.ok and check.problems == []
    assert (check.num_files, check.num_bytes) == (4, sum(len(d) for d in FILES.values()))


def test_truncated_zero_filled_and_missing_files_are_each_named(tmp_path):
    make_checkpoint(tmp_path)
    shard, state = tmp_path / "actor/step_2/__0_0.distcp", tmp_path / "driver_state.json"
    shard.write_bytes(FILES["actor/step_2/__0_0.distcp"][:1000])
    state.write_bytes(b"\x00" * len(FILES["driver_state.json"]))
    (tmp_path / "actor/latest").unlink()
    now = hashlib.sha256(bytes(len(FILES["driver_state.json"]))).hexdigest()
    saved = hashlib.sha256(FILES["driver_state.json"]).hexdigest()
    check = verify_manifest(tmp_path)
    assert not check.ok
    assert check.problems == [
        f"{tmp_path / 'actor/latest'} is missing",
        f"{shard} has 1000 bytes, the manifest says 10240 (truncated)",
        f"{state}: its bytes differ from the saved ones "
        f"(sha256 {now[:12]}... != {saved[:12]}... in the manifest)",
    ]
    assert check.summary() == check.problems[0] + " (and 2 more files at fault)"


def test_files_added_after_the_save_are_not_checked(tmp_path):
    make_checkpoint(tmp_path)
    (tmp_path / "notes.txt").write_text("written later")
    assert verify_manifest(tmp_path).ok


def test_a_missing_or_garbled_manifest_is_named(tmp_path):
    assert verify_manifest(tmp_path).problems == [
        f"{tmp_path / MANIFEST} is missing (a save that did not finish, or not a checkpoint)"
    ]
    make_checkpoint(tmp_path)
    (tmp_path / MANIFEST).write_bytes(b"\xff\xfe{garbage")
    (problem,) = verify_manifest(tmp_path).problems
    assert problem.startswith(f"{tmp_path / MANIFEST} is damaged: not UTF-8 text")
    (tmp_path / MANIFEST).write_text('{"checksum": "sha256", "files": {"a": {"size": "3"}}}')
    (problem,) = verify_manifest(tmp_path).problems
    assert (
        problem == f"{tmp_path / MANIFEST} is damaged: its 'files' are not {{path: {{size, digest}}}} entries"
    )
