"""A TensorFlow job's file, without TensorFlow: the settings that only mean something to PyTorch
are one line each, never ignored; a missing TensorFlow is one line naming the extra; a PyTorch
job, the CLI and --help never import TensorFlow."""

import subprocess
import sys

import pytest

from scaletrain.config import parse_job
from scaletrain.errors import ConfigError
from tests.helpers.keras_jobs import keras_job
from tests.helpers.run import REPO


def problems(data):
    with pytest.raises(ConfigError) as info:
        parse_job(data)
    return info.value.problems


def with_(job, **sections):
    for key, value in sections.items():
        job[key] = {**job[key], **value}
    return job


def test_a_tensorflow_job_is_a_task_of_its_own_kind(tmp_path):
    job = parse_job(keras_job(tmp_path))
    assert (job.kind, job.scale.strategy, job.scale.resolved_strategy) == ("tensorflow", "mirrored", "mirrored")
    one = parse_job(with_(keras_job(tmp_path), scale={"workers": 1}))
    assert one.scale.resolved_strategy == "single"
    assert parse_job(with_(keras_job(tmp_path), scale={"strategy": "mirrored", "workers": 1})).kind == "tensorflow"


@pytest.mark.parametrize(("sections", "line"), [
    ({"scale": {"strategy": "fsdp"}}, "scale.strategy fsdp is a PyTorch strategy; a TensorFlow job runs mirrored "
     "(MultiWorkerMirroredStrategy, a full replica per worker) or auto"),
    ({"scale": {"strategy": "zero1"}}, "scale.strategy zero1 is a PyTorch strategy; a TensorFlow job runs mirrored "
     "(MultiWorkerMirroredStrategy, a full replica per worker) or auto"),
    ({"scale": {"fsdp": {"reshard_after_forward": False}}}, "scale.fsdp configures PyTorch's FSDP; remove it"),
    ({"scale": {"activation_checkpointing": True}}, "scale.activation_checkpointing is PyTorch's; remove it "
     "(TensorFlow jobs do not recompute activations yet)"),
    ({"train": {"grad_accum": 2}}, "train.grad_accum is not supported for TensorFlow jobs yet; raise "
     "data.batch_size or scale.workers instead"),
    ({"data": {"loader_workers": 2}}, "data.loader_workers starts PyTorch DataLoader processes; a TensorFlow job "
     "reads through tf.data (remove it)"),
    ({"checkpoint": {"async_save": True}}, "checkpoint.async_save is not supported for TensorFlow jobs yet (their "
     "checkpoints are written by TF, synchronously); set it to false"),
])
def test_pytorch_only_settings_are_one_line_each(tmp_path, sections, line):
    assert problems(with_(keras_job(tmp_path), **sections)) == [line]


def test_mirrored_in_a_pytorch_job_is_one_line(tmp_path):
    job = keras_job(tmp_path)
    job["task"] = {"target": "tests.helpers.tasks:ToyTask"}
    job["scale"]["strategy"] = "mirrored"
    assert problems(job) == ["scale.strategy mirrored is TensorFlow's (task.framework: tensorflow); a PyTorch job "
                             "replicates with ddp, or auto"]


def test_without_tensorflow_a_tensorflow_job_is_one_line_naming_the_extra(tmp_path):
    import yaml

    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(keras_job(tmp_path)))
    code = ("import sys; sys.modules['tensorflow'] = None\n"  # as if it were not installed
            "from scaletrain.cli.main import entrypoint\n"
            f"sys.argv = ['scaletrain', 'run', {str(job_file)!r}]\n"
            "entrypoint()\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "error: task.framework is tensorflow, but TensorFlow is not installed here; pip install 'scaletrain[tensorflow]'"
    ]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.safetensors"))


def test_a_pytorch_worker_never_imports_tensorflow_and_help_imports_neither():
    code = (
        "import sys\n"
        "from scaletrain.runners import get_runner\n"
        "import scaletrain.launch.worker, scaletrain.launch.local, scaletrain.api\n"
        "get_runner('task'); get_runner('loop')\n"
        "assert not [m for m in ('tensorflow', 'keras') if m in sys.modules]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    code = (
        "import sys\n"
        "from scaletrain.cli.main import entrypoint\n"
        "sys.argv = ['scaletrain', 'run', '--help']\n"
        "try:\n    entrypoint()\nexcept SystemExit:\n    pass\n"
        "print([m for m in ('torch', 'tensorflow', 'keras') if m in sys.modules])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout + result.stderr
