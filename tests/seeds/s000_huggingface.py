# Seed 000, "HuggingFace Transformers Integration" (indentation restored): the
# train_func a %%rtrain cell runs; `model`, `train_ds`, `eval_ds` and `config` are
# the corpus' (a tiny GPT-2 built from a config: nothing downloaded).
from ray.train.huggingface.transformers import prepare_trainer, RayTrainReportCallback


def train_func(config):
    from transformers import Trainer, TrainingArguments
    training_args = TrainingArguments(
        output_dir="/tmp/hf-output",
        per_device_train_batch_size=config["batch_size"],
        num_train_epochs=config["epochs"],
        learning_rate=config["lr"],
        bf16=True,
        gradient_accumulation_steps=config.get("grad_accum", 1),
        save_strategy="epoch",
        logging_steps=10,
        # Do NOT set deepspeed or fsdp here — Ray Train handles distribution
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        callbacks=[RayTrainReportCallback()], # reports metrics + checkpoints to Ray
    )
    trainer = prepare_trainer(trainer) # sets up distributed training
    trainer.train()
