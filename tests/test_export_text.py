"""A cell written as a Ray Train script (driver/scripts/_export)."""

from __future__ import annotations


def test_cells_are_written_in_ray_trains_names_with_their_comments_and_layout():
    from rtnb.driver.scripts._export import to_ray_train

    known: tuple[set[str], dict[str, str]] = ({"rtnb"}, {})
    first, helpers = to_ray_train(
        "import torch, rtnb as r  # the API\nfrom rtnb import report as rep", known
    )
    assert first == (
        "import torch; import ray.train, ray.train.torch  # the API\n"
        "from ray.train import report as rep"
    ), first
    later, helpers = to_ray_train(
        "ckpt = r.get_checkpoint()\n"
        "if ckpt:\n"
        "    state = ckpt.load_state()   # résumé\n"
        "model = r.prepare_model(net)\n"
        "sharded = r.prepare_model(big, parallel_strategy='fsdp')\n"
        "rep({'loss': 1.0}, checkpoint=r.Checkpoint.from_state({'w': 1}))\n",
        known,
    )
    # get_checkpoint: Ray Train's, else the one named by the script's --resume-from;
    # FSDP stays FSDP2 (Ray Train's "fsdp" is FSDP1's wrapper).
    assert later == (
        "ckpt = get_checkpoint()\n"
        "if ckpt:\n"
        "    state = load_state(ckpt)   # résumé\n"
        "model = ray.train.torch.prepare_model(net)\n"
        "sharded = prepare_model_fsdp(big, parallel_strategy='fsdp')\n"
        "rep({'loss': 1.0}, checkpoint=checkpoint_from_state({'w': 1}))\n"
    ), later
    assert helpers == {
        "load_state",
        "checkpoint_from_state",
        "get_checkpoint",
        "prepare_model_fsdp",
    }


def test_an_exported_trial_reads_its_config_from_the_loops_argument():
    from rtnb.driver.scripts._export import to_ray_train

    code, _helpers = to_ray_train(
        "import rtnb\nlr = rtnb.get_config()['lr']\nrtnb.report({'lr': lr})"
    )
    assert "rtnb" not in code.replace("__rtnb_config__", "")
    assert "lr = dict(loop_config.get('__rtnb_config__', loop_config))['lr']" in code
    assert "ray.train.report({'lr': lr})" in code
