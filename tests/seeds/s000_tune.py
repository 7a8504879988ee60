# Seed 000, "Ray Tune Integration" (indentation restored): the Tuner's
# param_space and TuneConfig, handed to rtnb.sweep with the corpus' train_func.
from ray import tune

param_space={
    "train_loop_config": {
        "lr": tune.loguniform(1e-5, 1e-3),
        "batch_size": tune.choice([16, 32, 64]),
        "epochs": 3,
    },
}
tune_config=tune.TuneConfig(
    num_samples=10,
    metric="eval_loss",
    mode="min",
    scheduler=tune.schedulers.ASHAScheduler(max_t=3, grace_period=1),
)
