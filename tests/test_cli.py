"""The command line tells the truth and stops cleanly.

* ``ppoflow --help`` and ``ppoflow config`` import none of the heavy libraries (checked in a subprocess's
  ``sys.modules``, not by the clock);
* ``ppoflow cache ls|show|rm`` fail on a dump_dir that is not a directory (exit 2), ``ls`` on invalid entries
  (exit 1, after listing them all; ``--list-only`` lists without failing), in one line naming the path;
* a path key that names a symlink loop, a dangling symlink or a FIFO is one message naming the key and the
  path (exit 2), never a traceback or a hang;
* SIGTERM and Ctrl-C stop ``ppoflow train`` with 143 / 130 and one line naming the checkpoint that the
  rerun of the same command resumes from.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppoflow.flows.cli import main
from ppoflow.storage.step_cache import StepCache, config_dir
from tests.preflight_helpers import DEMO, DEMO_TRAIN, assert_user_error, run_cli
from tests.step_cache_helpers import make_batch

HEAVY = ("torch", "prefect", "ray", "transformers")


def imported_by(*argv: str) -> set[str]:
    """The heavy libraries that ``ppoflow argv...`` imports, run in a fresh interpreter."""
    script = (
        "import sys\nfrom ppoflow.flows.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n"
        "    pass\nprint(' '.join(sorted({name.split('.')[0] for name in sys.modules} & set("
        f"{HEAVY!r}))), file=sys.stderr)"
    )
    result = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120)
    return set(result.stderr.split("\n")[-2].split())


def test_help_and_config_import_no_heavy_library():
    assert imported_by("--help") == set()
    assert imported_by("cache", "--help") == set()
    assert imported_by("config") == set()


# ------------------------------------------------------------------------------------ cache commands


@pytest.fixture
def dump(tmp_path) -> tuple[str, StepCache]:
    """A dump_dir with three rollout entries, two of them then damaged (a torn payload, a lost marker)."""
    root = config_dir(
        str(tmp_path / "dump"),
        experiment_name="e",
        project_name="p",
        gbs=2,
        n=1,
        max_prompt_length=3,
        max_response_length=3,
    )
    cache = StepCache(root)
    for step in (1, 2, 3):
        cache.write(step, make_batch(["a", "a", "b", "b"], seed=step))
    Path(root, "2", "rollout.safetensors").write_bytes(b"torn")
    Path(root, "3", "meta.json").unlink()
    return str(tmp_path / "dump"), cache


@pytest.mark.reliability
def test_cache_commands_refuse_what_is_not_a_cache_directory(capsys, tmp_path):
    (tmp_path / "plain").write_text("")
    os.symlink(tmp_path / "loop_b", tmp_path / "loop_a")
    os.symlink(tmp_path / "loop_a", tmp_path / "loop_b")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    cases = {
        "missing": "no such directory",
        "plain": "is a file, not a directory",
        "loop_a": "is a symlink loop",
        "dangling": f"is a dangling symlink to {tmp_path / 'nowhere'}",
    }
    for name, reason in cases.items():
        for command in (["ls"], ["show", "--step", "1"], ["rm", "--step", "1"]):
            code, stderr = run_cli(capsys, "cache", *command, str(tmp_path / name))
            assert_user_error(code, stderr, f"{tmp_path / name}: {reason}")
            assert stderr.count("\n") == 1, stderr


@pytest.mark.reliability
def test_cache_ls_lists_every_entry_then_fails_on_the_invalid_ones(capsys, dump):
    dump_dir, cache = dump
    code = main(["cache", "ls", dump_dir])
    out, err = capsys.readouterr()
    assert code == 1
    rows = [line.split() for line in out.splitlines() if line.startswith("e_p ")]
    assert [(row[2], row[4]) for row in rows] == [("1", "yes"), ("2", "NO"), ("3", "NO")]  # every entry listed
    assert "3 entries, 1 valid" in out
    assert err.count("\n") == 1 and f"{dump_dir}: 2 of 3 entries are invalid" in err and "Traceback" not in err
    assert run_cli(capsys, "cache", "ls", dump_dir, "--quick")[0] == 1
    assert run_cli(capsys, "cache", "ls", dump_dir, "--list-only")[0] == 0

    assert_user_error(*run_cli(capsys, "cache", "show", dump_dir, "--step", "2"), "2/rollout.safetensors: ")
    assert run_cli(capsys, "cache", "show", dump_dir, "--step", "1")[0] == 0
    assert run_cli(capsys, "cache", "rm", dump_dir, "--step", "2")[0] == 0  # rm is how an invalid entry goes
    assert cache.load(1)[0] is not None


# ------------------------------------------------------------------------------------------ path keys


@pytest.mark.reliability
def test_path_keys_name_loops_fifos_and_dangling_links(capsys, tmp_path, tiny_overrides, tiny_model):
    os.symlink(tmp_path / "loop_b", tmp_path / "loop_a")
    os.symlink(tmp_path / "loop_a", tmp_path / "loop_b")
    os.symlink(tmp_path / "gone.parquet", tmp_path / "dangling.parquet")
    os.mkfifo(tmp_path / "fifo.parquet")  # a read of it would block for ever
    cases = [
        (
            f"data.train_files={tmp_path}/fifo.parquet",
            "data.train_files",
            f"{tmp_path}/fifo.parquet is a FIFO, not a file",
        ),
        (f"data.val_files={tmp_path}/loop_a", "data.val_files", f"{tmp_path}/loop_a is a symlink loop"),
        (
            f"data.train_files={tmp_path}/dangling.parquet",
            "data.train_files",
            f"{tmp_path}/dangling.parquet is a dangling symlink to {tmp_path}/gone.parquet",
        ),
        (
            f"actor_rollout_ref.model.path={tmp_path}/loop_a",
            "actor_rollout_ref.model.path",
            f"{tmp_path}/loop_a is a symlink loop",
        ),
        (
            f"actor_rollout_ref.model.tokenizer_path={tmp_path}/fifo.parquet",
            "actor_rollout_ref.model.tokenizer_path",
            "is a FIFO, not a directory",
        ),
        (f"trainer.default_local_dir={tmp_path}/loop_a/run", "trainer.default_local_dir", "is a symlink loop"),
        (
            f"trainer.default_local_dir={tmp_path}/fifo.parquet",
            "trainer.default_local_dir",
            f"{tmp_path}/fifo.parquet is a FIFO, not a directory",
        ),
    ]
    for override, key, message in cases:
        code, stderr = run_cli(capsys, *DEMO, *tiny_overrides, override)
        assert_user_error(code, stderr, f"{key}: ", message)
    os.mkfifo(tmp_path / "fifo.yaml")
    code, stderr = run_cli(capsys, "config", "--config", str(tmp_path / "fifo.yaml"))
    assert_user_error(code, stderr, "--config: ", f"{tmp_path}/fifo.yaml is a FIFO, not a file")


# ------------------------------------------------------------------------------------------- signals


@pytest.mark.slow
@pytest.mark.reliability
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signalled_train_stops_cleanly_and_its_rerun_resumes(
    prefect_server, ray_local, tiny_model, tmp_path, signum, code
):
    from tests.conftest import small_run

    words = [word for word in small_run(tiny_model, tmp_path) if not word.startswith("trainer.total_training")]
    command = [
        *DEMO_TRAIN,
        *words,
        "trainer.total_training_steps=3",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
    ]
    env = {**os.environ, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}
    first = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    checkpoint = tmp_path / "run" / "global_step_1"
    deadline = time.monotonic() + 240
    while not (checkpoint / "checkpoint.json").exists():
        assert first.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.02)
    first.send_signal(signum)
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == code, stderr
    last_lines = stderr.strip().splitlines()[-5:]
    assert not any("Traceback" in line or line.startswith("  File ") for line in last_lines), stderr
    said = [line for line in stderr.splitlines() if line.startswith("ppoflow: ")]
    assert len(said) == 1 and said[0].startswith(f"ppoflow: interrupted ({signal.Signals(signum).name}) after step")
    newest = max(tmp_path.joinpath("run").glob("global_step_*/checkpoint.json")).parent
    assert f"the last checkpoint is {newest}; rerun the same command" in said[0]

    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"resumed from {newest}: continuing at step {int(newest.name.rsplit('_', 1)[1]) + 1}" in rerun.stdout
    assert (tmp_path / "run" / "global_step_3" / "checkpoint.json").exists()
