"""`%rtnb import` of scripts in the shapes Ray's own examples use: the trainer built in
a function whose parameters feed train_loop_config, an argparse ``__main__``, a
``ray.init(...)`` with options. The cell it makes computes the config the script would
have used; a value it cannot work out is one line. (Running such a cell on a group:
tests/test_export.py.)"""

from __future__ import annotations

import sys

import pytest

import rtnb
from rtnb.driver.scripts._import import read_train_script

DOCS_SHAPE = """
import argparse
import ray
import ray.train
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer


def train_func(config):
    ray.train.report({"lr": config["lr"]})


def train_fashion_mnist(num_workers=2, use_gpu=False, lr=1e-3, epochs=3):
    global_batch_size = 32
    train_config = {
        "lr": lr,
        "epochs": epochs,
        "batch_size_per_worker": global_batch_size // num_workers,
        "smoke": SMOKE,
    }
    scaling_config = ScalingConfig(num_workers=num_workers, use_gpu=use_gpu)
    trainer = TorchTrainer(
        train_loop_per_worker=train_func,
        train_loop_config=train_config,
        scaling_config=scaling_config,
    )
    print(trainer.fit().metrics)


SMOKE = False

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=False, type=str)
    parser.add_argument("--num-workers", "-n", type=int, default=4)
    parser.add_argument("--use-gpu", action="store_true", default=False)
    parser.add_argument("--epochs", type=int, default=2)
    args, _ = parser.parse_known_args()
    ray.init(address=args.address, num_cpus=4)
    train_fashion_mnist(num_workers=args.num_workers, use_gpu=args.use_gpu, epochs=args.epochs)
"""


def _config_of(code: str) -> dict:
    """The config the cell passes to its loop, computed as a rank would."""
    definitions = code.split("# train_loop_config as the script's driver code builds it\n")[1]
    namespace: dict = {"SMOKE": False}
    exec(definitions.split("\n\ntrain_func(")[0], namespace)  # noqa: S102 - the test's own code
    return namespace["_script_config"]()


def test_the_config_of_a_trainer_built_in_a_function_called_from_an_argparse_main(tmp_path):
    script = tmp_path / "fashion.py"
    script.write_text(DOCS_SHAPE)
    plan = read_train_script(str(script))
    # The __main__ call passes args.num_workers (--num-workers' default 4) and epochs
    # (--epochs' 2); lr is the function's default; the batch size divides by 4.
    assert plan.workers == 4 and plan.gpu is False
    assert _config_of(plan.code) == {
        "lr": 1e-3,
        "epochs": 2,
        "batch_size_per_worker": 8,
        "smoke": False,
    }
    assert plan.code.rstrip().endswith("train_func(_script_config())")
    notes = "\n".join(plan.notes)
    assert "num_workers = 4 (the default of --num-workers)" in notes, notes
    assert "lr = 0.001 (the default of train_fashion_mnist())" in notes, notes
    assert "ray.init(" not in plan.code.split("def train_func")[0]
    compile(plan.code, "cell", "exec")


def test_args_read_in_the_main_block_take_the_options_defaults(tmp_path):
    script = tmp_path / "main_block.py"
    script.write_text(
        "import argparse\nfrom ray.train import ScalingConfig\nfrom ray.train.torch import TorchTrainer\n"
        "def loop(config):\n    pass\n"
        "if __name__ == '__main__':\n"
        "    parser = argparse.ArgumentParser()\n"
        "    parser.add_argument('--lr', type=float, default=0.25)\n"
        "    parser.add_argument('--smoke-test', action='store_true')\n"
        "    args = parser.parse_args()\n"
        "    TorchTrainer(loop, train_loop_config={'lr': args.lr, 'smoke': args.smoke_test},\n"
        "                 scaling_config=ScalingConfig(num_workers=2)).fit()\n"
    )
    plan = read_train_script(str(script))
    assert plan.code.rstrip().endswith("loop({'lr': 0.25, 'smoke': False})"), plan.code
    assert plan.workers == 2
    assert "args.lr = 0.25 (the default of --lr)" in plan.notes


def test_a_value_the_script_does_not_give_is_one_line_naming_it(tmp_path):
    script = tmp_path / "unknown.py"
    script.write_text(
        "from ray.train.torch import TorchTrainer\n"
        "def loop(config):\n    pass\n"
        "def main(seed):\n"
        "    TorchTrainer(loop, train_loop_config={'seed': seed}).fit()\n"
    )
    with pytest.raises(rtnb.ConfigError) as info:
        read_train_script(str(script))
    line = str(info.value)
    assert "\n" not in line and "uses 'seed'" in line and "give seed a value there" in line, line


def test_a_script_that_hands_datasets_says_exactly_what_to_hand_and_how(tmp_path):
    script = tmp_path / "regression.py"
    script.write_text(
        "import ray, ray.train\nfrom ray.train import DataConfig, ScalingConfig\n"
        "from ray.train.torch import TorchTrainer\n"
        "def train_func(config):\n"
        "    ray.train.get_dataset_shard('train')\n"
        "def main():\n"
        "    dataset = ray.data.read_csv('s3://anonymous@air-example-data/regression.csv')\n"
        "    train_dataset, val_dataset = dataset.train_test_split(test_size=0.3)\n"
        "    trainer = TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=2),\n"
        "        datasets={'train': train_dataset, 'validation': val_dataset},\n"
        "        dataset_config=DataConfig(datasets_to_split=['train']))\n"
        "    trainer.fit()\n"
    )
    plan = read_train_script(str(script))
    note = next(n for n in plan.notes if "hands the ranks" in n)
    assert "hands the ranks train, validation" in note, note
    assert "train = train_dataset, validation = val_dataset" in note, note
    assert note.endswith("%rtnb datasets train=train validation=validation --split train"), note


def test_a_torchrun_script_is_read_with_its_command_line_and_arguments_only_go_to_one(
    tmp_path, monkeypatch, capsys
):
    """A script with no trainer and a ``__main__`` block runs whole with torchrun's
    ``sys.argv``; a missing positional, or arguments for a TorchTrainer script, are
    one line each."""
    script = tmp_path / "job.py"
    script.write_text(
        "import argparse\n"
        "if __name__ == '__main__':\n"
        "    p = argparse.ArgumentParser()\n"
        "    p.add_argument('epochs', type=int)\n"
        "    p.add_argument('every', type=int)\n"
        "    p.add_argument('--lr', type=float, default=0.1)\n"
        "    p.add_argument('--fast', action='store_true')\n"
        "    print(p.parse_args())\n"
    )
    read = read_train_script(str(script), ["3", "--lr", "0.5", "--fast", "1"])
    assert (
        read.loop == "__main__"
        and f"argv = {[str(script), '3', '--lr', '0.5', '--fast', '1']!r}" in read.code
    )
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the cell sets it, as on a rank
    exec(read.code, {"__name__": "__main__"})  # noqa: S102 - the test's own script
    assert "Namespace(epochs=3, every=1, lr=0.5, fast=True)" in capsys.readouterr().out
    with pytest.raises(rtnb.ConfigError, match="needs its positional argument 'every'"):
        read_train_script(str(script), ["3", "--lr", "0.5"])
    trainer = tmp_path / "ray_job.py"
    trainer.write_text(DOCS_SHAPE)
    with pytest.raises(rtnb.ConfigError, match="arguments \\(5\\) are for a torchrun script"):
        read_train_script(str(trainer), ["5"])
