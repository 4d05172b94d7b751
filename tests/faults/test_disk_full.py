"""A disk that fills during a save (a small tmpfs as output_dir; skipped where the test cannot mount one): the run
stops naming the folder, the space and the newest intact checkpoint, which is kept; no partial folder is left."""

import shutil
import subprocess

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.usefixtures("pickle_by_value")]


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16M", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode(errors='replace').strip()})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


class FillAfterFirstSave:
    """on_save of the first checkpoint: fill the disk, leaving a few KB (less than a checkpoint's model file)."""

    def __init__(self, mount):
        self.mount, self.filled = mount, False

    def on_save(self, args, state, control, **kwargs):
        if not self.filled:
            free = shutil.disk_usage(self.mount).free
            with open(self.mount / "filler", "wb") as f:
                f.write(b"\0" * max(free - 16_384, 0))
            self.filled = True


def test_a_save_on_a_full_disk_names_the_folder_and_keeps_the_previous_checkpoint(
    ray_cluster, tiny_model_dir, small_disk
):
    from rlasync import AsyncGRPOTrainer
    from rlasync.driver.checkpoint import CheckpointSaveError
    from tests.faults.test_faults import NUM_ROWS, make_config
    from tests.integration.tiny_runs import arithmetic_rows, digit_reward

    output_dir = small_disk / "run"
    args = make_config(output_dir, max_steps=4, save_steps=1)
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=digit_reward, args=args, train_dataset=arithmetic_rows(NUM_ROWS)
    )
    trainer.callbacks.append(FillAfterFirstSave(small_disk))
    with pytest.raises(CheckpointSaveError) as info:
        trainer.train()
    message = str(info.value)
    assert f"saving checkpoint-2 into {output_dir} failed" in message and "No space left on device" in message
    assert "GB free" in message and f"the newest intact checkpoint is {output_dir / 'checkpoint-1'}" in message
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-1"]  # no checkpoint-2.tmp
    assert (output_dir / "checkpoint-1" / "trainer_state.json").is_file()
