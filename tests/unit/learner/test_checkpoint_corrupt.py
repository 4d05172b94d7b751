"""The learner's checkpoint load: a truncated optimizer.pt / scheduler.pt raises an error naming the file, not
PyTorch's bare "PytorchStreamReader failed reading zip archive"."""

import pytest
import torch

from rlasync.learner.checkpoint import OPTIMIZER_FILE, SCHEDULER_FILE, load_optimizer_state


@pytest.mark.parametrize("name", [OPTIMIZER_FILE, SCHEDULER_FILE])
def test_a_truncated_torch_file_is_named(tmp_path, name):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    torch.save(optimizer.state_dict(), tmp_path / OPTIMIZER_FILE)  # position-keyed: loads with one rank
    torch.save(scheduler.state_dict(), tmp_path / SCHEDULER_FILE)
    assert load_optimizer_state(tmp_path, model, optimizer, scheduler)
    data = (tmp_path / name).read_bytes()
    (tmp_path / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError) as info:
        load_optimizer_state(tmp_path, model, optimizer, scheduler)
    assert str(tmp_path / name) in str(info.value) and "corrupt" in str(info.value)
