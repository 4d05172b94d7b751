"""bench/pyspy_top.py: per-process summaries of py-spy's collapsed stacks."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))

import pyspy_top  # noqa: E402


def summaries(path: Path, stacks: str) -> list[str]:
    """`stacks` written to `path`, summarised: one string per `== ` section, the marker dropped."""
    path.write_text(stacks)
    text = pyspy_top.summarise(path, top=5)
    assert text.startswith("== ")
    return text.split("== ")[1:]


def test_stacks_recorded_with_subprocesses_are_summarised_per_process(tmp_path):
    actor, core = summaries(
        tmp_path / "spy.txt",
        'process 11:"ray::GenerationActor";run (/x/a.py:1);step (/x/b.py:2) 30\n'
        'process 11:"ray::GenerationActor";run (/x/a.py:9) 10\n'
        'process 12:"VLLM::EngineCore";busy (/y/c.py:3);copy (/y/d.py:4) 60\n',
    )
    assert actor.startswith('spy.txt process 11:"ray::GenerationActor": 40 samples')
    assert "75.0%  75.0%  step (b.py)" in actor and "25.0% 100.0%  run (a.py)" in actor
    assert core.startswith('spy.txt process 12:"VLLM::EngineCore": 60 samples') and "copy (d.py)" in core
    assert "copy" not in actor


def test_plain_stacks_are_one_summary(tmp_path):
    path = tmp_path / "spy.txt"
    path.write_text("main (/a.py:1);work (/b.py:2) 3\nmain (/a.py:1) 1\nnot a stack line\n")
    text = pyspy_top.summarise(path, top=5)
    assert text.startswith("== spy.txt: 4 samples") and "75.0%  75.0%  work (b.py)" in text
    assert pyspy_top.summarise(tmp_path / "spy.txt", 5).count("== ") == 1


def test_stacks_recorded_with_threads_are_summarised_per_thread_busiest_first(tmp_path):
    first, second = summaries(
        tmp_path / "spy.txt",
        'process 11:"ray::GenerationActor";thread (0x1);run (/x/a.py:1);launch (/x/b.py:2) 30\n'
        'process 11:"ray::GenerationActor";thread (0x2);loop (/x/c.py:3) 10\n'
        'process 11:"ray::GenerationActor";thread (0x1);run (/x/a.py:1) 30\n',
    )
    assert first.startswith('spy.txt process 11:"ray::GenerationActor" thread (0x1) (85.7% of the process): 60 samples')
    assert "50.0%  50.0%  launch (b.py)" in first and "loop" not in first
    assert second.startswith(
        'spy.txt process 11:"ray::GenerationActor" thread (0x2) (14.3% of the process): 10 samples'
    )
    (plain,) = summaries(tmp_path / "plain.txt", "thread (0x9);main (/a.py:1) 2\n")
    assert plain.startswith("plain.txt thread (0x9) (100.0% of the process): 2 samples")
