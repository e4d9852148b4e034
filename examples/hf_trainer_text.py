"""K-FAC with the Hugging Face Trainer: a tiny Llama, built from a config, on
the English text of Python's own documentation (bytes as tokens).

    python examples/hf_trainer_text.py --steps 60

Nothing is downloaded: the model is initialised from a ``LlamaConfig`` and
the text is ``pydoc_data.topics``.  The callback preconditions in
``on_pre_optimizer_step``; ``max_grad_norm=0`` leaves bounding the step to
the KL clip, and since Llama's loss is ``Σℓ / num_items_in_batch`` the
callback uses ``loss_average='items'`` and reads the count from the Trainer.
"""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
from pydoc_data.topics import topics

import torch
import transformers

from kaisa.integrations.transformers import KFACCallback

LENGTH = 64


def dataset(count: int) -> list[dict[str, torch.Tensor]]:
    text = "\n".join(topics[k] for k in sorted(topics)).encode("ascii", "replace")
    data = torch.tensor(list(text[: count * LENGTH]), dtype=torch.long).view(count, LENGTH)
    return [{"input_ids": row, "labels": row} for row in data]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--accumulate", type=int, default=2)
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=LENGTH,
    )
    model = transformers.LlamaForCausalLM(config)
    train = dataset(16 * args.steps * args.accumulate)
    held_out = dataset(16 * args.steps * args.accumulate + 64)[-64:]
    with tempfile.TemporaryDirectory() as out:
        training = transformers.TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=16,
            gradient_accumulation_steps=args.accumulate,
            max_steps=args.steps,
            learning_rate=3e-3,
            lr_scheduler_type="constant",
            optim="adamw_torch",
            max_grad_norm=0.0,  # the KL clip bounds the step
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        )
        callback = KFACCallback(damping=0.003, kl_clip=0.01, inv_update_steps=10)
        trainer = transformers.Trainer(
            model=model, args=training, train_dataset=train, callbacks=[callback]
        )
        before = trainer.evaluate(held_out)["eval_loss"]
        trainer.train()
        after = trainer.evaluate(held_out)["eval_loss"]
    print(f"layers preconditioned: {len(callback.preconditioner.layers)}")  # type: ignore[union-attr]
    print(f"held-out bits per byte: {before / math.log(2):.3f} -> {after / math.log(2):.3f}")


if __name__ == "__main__":
    main()
